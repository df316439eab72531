//! List paging: every list method returns at most [`LIST_LIMIT_MAX`] rows a page, ordered by
//! row id, with the last id of a full page as the cursor of the next.
//!
//! A page is read one row beyond its limit, so `nextCursor` is set exactly while rows remain; a
//! filter may make a page short without ending the list.

use bc_core::id::TenantId;
use bc_core::store::{READ_ROWS_MAX, Row};
use bc_core::{Error, Result};
use schemars::JsonSchema;
use serde::Serialize;

use super::call::Call;
use super::validate::CursorText;

/// Rows a list method returns at most; the default is `LIST_LIMIT_DEFAULT`.
pub const LIST_LIMIT_MAX: u32 = 500;
pub const LIST_LIMIT_DEFAULT: u32 = 100;
/// Longest list cursor (a row id).
pub const CURSOR_CHARS_MAX: usize = 64;
const _: () = assert!(LIST_LIMIT_DEFAULT <= LIST_LIMIT_MAX && LIST_LIMIT_MAX <= READ_ROWS_MAX);

pub fn limit(requested: Option<u32>) -> Result<u32> {
    match requested {
        None => Ok(LIST_LIMIT_DEFAULT),
        Some(n) if (1..=LIST_LIMIT_MAX).contains(&n) => Ok(n),
        Some(n) => Err(Error::invalid(format!("limit {n} is out of range 1 to {LIST_LIMIT_MAX}"))),
    }
}

/// One page of a list: `nextCursor` is set while rows remain.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "{T}Page")]
pub struct Page<T> {
    pub items: Vec<T>,
    #[schemars(with = "Option<CursorText>")]
    pub next_cursor: Option<String>,
}

/// Pages through one kind of row by id. `view` may drop a row (a filter) by returning `None`;
/// filtered pages can come back short, and `nextCursor` is set while rows remain.
pub async fn list_rows<T>(
    call: &Call<'_>,
    tenant: TenantId,
    kind: &str,
    limit_requested: Option<u32>,
    cursor: Option<&str>,
    view: impl Fn(Row) -> Result<Option<T>>,
) -> Result<Page<T>> {
    let limit = limit(limit_requested)?;
    if let Some(cursor) = cursor
        && (cursor.is_empty()
            || cursor.len() > CURSOR_CHARS_MAX
            || !cursor.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
    {
        return Err(Error::invalid("malformed cursor"));
    }
    let rows = call.state.store.row_list(&tenant.to_string(), kind, cursor, limit + 1).await?;
    let more = rows.len() > limit as usize;
    let rows: Vec<_> = rows.into_iter().take(limit as usize).collect();
    let next_cursor = if more { rows.last().map(|r| r.key.id.clone()) } else { None };
    let mut items = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(v) = view(row)? {
            items.push(v);
        }
    }
    Ok(Page { items, next_cursor })
}

/// Two pages of one list read from two sources under the same cursor (ids of one kind, never in
/// both, ordered alike): `first` as read, `second`'s items and its `nextCursor`, merged in id
/// order. Each source stops at its own cursor, so the merged page stops at the first of the two
/// ends; it holds at most `limit` items, and `nextCursor` is set while either source has more.
pub fn merge_pages<T>(
    first: Page<T>,
    second: Vec<T>,
    second_next: Option<String>,
    limit_requested: Option<u32>,
    id: impl Fn(&T) -> &str,
) -> Result<Page<T>> {
    let limit = limit(limit_requested)? as usize;
    let end = [first.next_cursor, second_next].into_iter().flatten().min();
    let mut items = first.items;
    items.extend(second);
    items.retain(|item| end.as_deref().is_none_or(|e| id(item) <= e));
    items.sort_by(|a, b| id(a).cmp(id(b)));
    let truncated = items.len() > limit;
    items.truncate(limit);
    let next_cursor = if truncated || end.is_some() { items.last().map(|i| id(i).to_owned()).or(end) } else { None };
    Ok(Page { items, next_cursor })
}

/// Declares a list method's input, named in the document's components: the tenant (the
/// caller's own when absent), `limit` and `cursor`, then the method's own filters in the order
/// given: `list_input!(PoolsList { /// Archived pools too. #[serde(default)] include_archived: bool, })`.
macro_rules! list_input {
    ($name:ident { $($(#[$field_meta:meta])* $field:ident: $type:ty,)* }) => {
        #[derive(::serde::Deserialize, ::schemars::JsonSchema)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct $name {
            #[schemars(with = "Option<crate::api::validate::TenantIdText>")]
            tenant_id: Option<String>,
            #[schemars(with = "Option<crate::api::validate::LimitNumber>")]
            limit: Option<u32>,
            #[schemars(with = "Option<crate::api::validate::CursorText>")]
            cursor: Option<String>,
            $($(#[$field_meta])* $field: $type,)*
        }
    };
}
pub(crate) use list_input;
