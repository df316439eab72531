//! One SQLite statement, written once and run on either of the backend's connections: sqlx's
//! (a pooled connection's worker thread, for servers) or the caller's own ([`super::inline`],
//! for the simulator). [`Sql`] is the statement's text, with `?` placeholders, and its
//! arguments; [`On`] says where it runs; rows come back through [`Columns`], which both row
//! types implement, so each query has one text and one decoder.

use sqlx::sqlite::SqliteArguments;
use sqlx::{Arguments as _, Sqlite, SqlitePool};

use super::inline::InlineConn;
use crate::error::{Error, Result};
use crate::store::Columns;

/// One bound argument, in SQLite's storage classes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Arg {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Self::Int(v)
    }
}
impl From<String> for Arg {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}
impl From<&String> for Arg {
    fn from(v: &String) -> Self {
        Self::Text(v.clone())
    }
}
impl From<&str> for Arg {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}
impl From<Vec<u8>> for Arg {
    fn from(v: Vec<u8>) -> Self {
        Self::Blob(v)
    }
}
impl<T: Into<Arg>> From<Option<T>> for Arg {
    fn from(v: Option<T>) -> Self {
        v.map_or(Self::Null, Into::into)
    }
}

impl rusqlite::ToSql for Arg {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Self::Null => ValueRef::Null,
            Self::Int(v) => ValueRef::Integer(*v),
            Self::Text(v) => ValueRef::Text(v.as_bytes()),
            Self::Blob(v) => ValueRef::Blob(v),
        }))
    }
}

/// A statement's text and arguments, in placeholder order.
#[derive(Clone, Debug, Default)]
pub(super) struct Sql {
    pub(super) text: String,
    pub(super) args: Vec<Arg>,
}

/// One row of a `VALUES` list being written ([`Sql::push_values`]).
pub(super) struct Tuple<'a> {
    args: &'a mut Vec<Arg>,
}

impl Tuple<'_> {
    pub(super) fn bind(&mut self, arg: impl Into<Arg>) -> &mut Self {
        self.args.push(arg.into());
        self
    }
}

impl Sql {
    /// `text` with its placeholders still to be bound, in order, by [`Sql::bind`].
    pub(super) fn new(text: impl Into<String>) -> Self {
        Self { text: text.into(), args: Vec::new() }
    }

    /// Binds the next `?` already in the text.
    pub(super) fn bind(mut self, arg: impl Into<Arg>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub(super) fn push(&mut self, text: &str) -> &mut Self {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder and binds it.
    pub(super) fn push_bind(&mut self, arg: impl Into<Arg>) -> &mut Self {
        self.text.push('?');
        self.args.push(arg.into());
        self
    }

    /// Appends `?, ?, …`, one placeholder per item, each bound.
    pub(super) fn push_list<A: Into<Arg>>(&mut self, items: impl IntoIterator<Item = A>) -> &mut Self {
        for (i, arg) in items.into_iter().enumerate() {
            if i > 0 {
                self.text.push_str(", ");
            }
            self.push_bind(arg);
        }
        self
    }

    /// Appends `VALUES (?, …), (?, …), …`: one tuple per item, whose arguments `row` binds.
    pub(super) fn push_values<T>(
        &mut self,
        items: impl IntoIterator<Item = T>,
        mut row: impl FnMut(&mut Tuple<'_>, T),
    ) -> &mut Self {
        self.text.push_str("VALUES ");
        for (i, item) in items.into_iter().enumerate() {
            let before = self.args.len();
            row(&mut Tuple { args: &mut self.args }, item);
            self.text.push_str(if i > 0 { ", (" } else { "(" });
            for n in 0..self.args.len() - before {
                self.text.push_str(if n > 0 { ", ?" } else { "?" });
            }
            self.text.push(')');
        }
        self
    }

    fn for_sqlx(self) -> Result<sqlx::query::Query<'static, Sqlite, SqliteArguments>> {
        let mut args = SqliteArguments::default();
        for arg in self.args {
            match arg {
                Arg::Null => args.add(None::<i64>),
                Arg::Int(v) => args.add(v),
                Arg::Text(v) => args.add(v),
                Arg::Blob(v) => args.add(v),
            }
            .map_err(|e| Error::Storage(format!("sqlite: binding an argument: {e}")))?;
        }
        Ok(sqlx::query_with(sqlx::AssertSqlSafe(self.text), args))
    }

    /// Runs the statement; returns the rows it changed.
    pub(super) async fn execute(self, on: On<'_>) -> Result<u64> {
        Ok(match on {
            On::Pool(pool) => self.for_sqlx()?.execute(pool).await?.rows_affected(),
            On::Inline(inline) => inline.execute(&self)?,
        })
    }

    /// Every row the statement returns, each decoded by `decode`.
    pub(super) async fn all<T>(self, on: On<'_>, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Vec<T>> {
        let rows = match on {
            On::Pool(pool) => self.for_sqlx()?.fetch_all(pool).await?,
            On::Inline(inline) => return inline.all(&self, decode),
        };
        rows.iter().map(|row| decode(row)).collect()
    }

    /// The first row the statement returns, if any, decoded by `decode`.
    pub(super) async fn first<T>(self, on: On<'_>, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Option<T>> {
        let row = match on {
            On::Pool(pool) => self.for_sqlx()?.fetch_optional(pool).await?,
            On::Inline(inline) => return inline.first(&self, decode),
        };
        row.as_ref().map(|row| decode(row)).transpose()
    }

    /// [`Sql::first`] of a statement that always returns a row (an aggregate, `RETURNING` of a
    /// row known to exist).
    pub(super) async fn one<T>(self, on: On<'_>, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<T> {
        // The text is not cloned for the error: `counter_bump` runs this on every append.
        self.first(on, decode).await?.ok_or_else(|| Error::Storage("sqlite: a statement that returns a row returned none".into()))
    }
}

/// Runs `text`, one or more statements without arguments (a migration's script, `BEGIN`).
pub(super) async fn execute_script(on: On<'_>, text: &'static str) -> Result<()> {
    match on {
        On::Pool(pool) => sqlx::raw_sql(text).execute(pool).await.map(|_| ())?,
        On::Inline(inline) => inline.script(text)?,
    }
    Ok(())
}

/// Where a statement runs.
pub(super) enum On<'c> {
    /// Any connection of the pool (a read, or one statement committing on its own).
    Pool(&'c SqlitePool),
    /// The caller's own connection, on the caller's thread.
    Inline(&'c InlineConn),
}

impl On<'_> {
    /// The same place again, for the next statement of a sequence.
    pub(super) fn again(&mut self) -> On<'_> {
        match self {
            On::Pool(pool) => On::Pool(pool),
            On::Inline(inline) => On::Inline(inline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_lists_number_their_placeholders_with_their_arguments() {
        let mut sql = Sql::new("INSERT INTO t (a, b) ");
        sql.push_values([(1i64, "x"), (2, "y")], |t, (a, b)| {
            t.bind(a).bind(b);
        });
        sql.push(" WHERE c IN (").push_list(["p", "q", "r"]).push(")");
        assert_eq!(sql.text, "INSERT INTO t (a, b) VALUES (?, ?), (?, ?) WHERE c IN (?, ?, ?)");
        assert_eq!(sql.args.len(), 7);
        assert_eq!(sql.args[2], Arg::Int(2));
        assert_eq!(sql.args[6], Arg::Text("r".into()));
        assert_eq!(Arg::from(None::<&str>), Arg::Null);
    }
}
