//! `serve --roles`: which parts of the control plane one process runs, so an operator can run
//! the API on two machines, the agents' endpoint on two others and the reconcilers apart, all
//! on one PostgreSQL (`docs/operations.md`, "Roles").
//!
//! - `api`: the HTTP API on `--listen` (methods, `/watch`, `/audit`, `/tunnels`). Without it,
//!   `--listen` answers only `/healthz`, `/readyz` and `/metrics` (each role's health and metrics
//!   on its own process), every other path `UNSUPPORTED` (`api-not-served`).
//! - `agents`: the agents' endpoint on `--agents-listen`. A tunnel is relayed by the process its
//!   ticket is spent on to the node's session in that same process, so `/tunnels` needs a
//!   process with both `api` and `agents`.
//! - `reconcilers` (all of them, the server's duties among them: sealing checkpoints, witnesses)
//!   or `reconcilers:NAME[:NAME…]` (only these, as `reconcile --only`). A process without it
//!   runs no reconciler at all, not even the duties: another process must.

use bc_reconcilers::registry::{self, REGISTRY, Registration};

/// The roles, in the order `--roles` is written and printed.
pub const ROLE_NAMES: [&str; 3] = ["api", "agents", "reconcilers"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roles {
    pub api: bool,
    pub agents: bool,
    /// `None`: no reconciler; `Some([])`: every registered one; else only these.
    pub reconcilers: Option<Vec<&'static str>>,
}

impl Roles {
    /// What `dev` and `serve` without `--roles` run: everything.
    pub fn all() -> Self {
        Self { api: true, agents: true, reconcilers: Some(Vec::new()) }
    }

    /// `dev`/`serve --no-reconcilers`: the API, the agents' endpoint and the server's duties only
    /// (`Registration::duty`), the rest left to `reconcile`.
    pub fn without_reconcilers() -> Self {
        let duties = REGISTRY.iter().filter(|r| r.duty).map(|r| r.name).collect();
        Self { api: true, agents: true, reconcilers: Some(duties) }
    }

    /// `api,agents,reconcilers[:NAME…]`: each role at most once, at least one, names from the
    /// registry.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut roles = Self { api: false, agents: false, reconcilers: None };
        let mut seen = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (role, names) = part.split_once(':').map_or((part, None), |(role, names)| (role, Some(names)));
            if seen.contains(&role) {
                return Err(format!("the role {role:?} is named twice"));
            }
            match (role, names) {
                ("api", None) => roles.api = true,
                ("agents", None) => roles.agents = true,
                ("reconcilers", names) => roles.reconcilers = Some(reconciler_names(names)?),
                ("api" | "agents", Some(_)) => return Err(format!("the role {role:?} takes no names")),
                ("", _) => return Err("an empty role (roles are separated by single commas)".into()),
                _ => return Err(format!("{role:?} is not a role: the roles are {}", ROLE_NAMES.join(", "))),
            }
            seen.push(role);
        }
        Ok(roles)
    }

    /// The roles as `--roles` takes them.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.api {
            parts.push("api".to_owned());
        }
        if self.agents {
            parts.push("agents".to_owned());
        }
        match &self.reconcilers {
            Some(names) if names.is_empty() => parts.push("reconcilers".to_owned()),
            Some(names) => parts.push(format!("reconcilers:{}", names.join(":"))),
            None => {}
        }
        parts.join(",")
    }

    /// The reconcilers this process starts, in the registry's order.
    pub fn chosen(&self) -> Vec<&'static Registration> {
        match &self.reconcilers {
            None => Vec::new(),
            Some(names) => REGISTRY.iter().filter(|r| names.is_empty() || names.contains(&r.name)).collect(),
        }
    }
}

/// `reconcilers:NAME:NAME…`'s names: known, each once, at least one after a colon.
fn reconciler_names(names: Option<&str>) -> Result<Vec<&'static str>, String> {
    let Some(names) = names else { return Ok(Vec::new()) };
    let mut chosen: Vec<&'static str> = Vec::new();
    for name in names.split(':') {
        let known = registry::find(name).ok_or_else(|| {
            format!("reconcilers:{name:?} is not a reconciler: the reconcilers are {}", registry::NAMES.join(", "))
        })?;
        if chosen.contains(&known.name) {
            return Err(format!("the reconciler {name:?} is named twice"));
        }
        chosen.push(known.name);
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_once_and_reconcilers_by_name() {
        let all = Roles::parse("api,agents,reconcilers").unwrap();
        assert_eq!(all, Roles::all());
        assert_eq!(all.chosen().len(), REGISTRY.len());
        assert_eq!(all.describe(), "api,agents,reconcilers");

        let api = Roles::parse("api").unwrap();
        assert!(api.api && !api.agents && api.reconcilers.is_none() && api.chosen().is_empty());

        let first = REGISTRY[0].name;
        let last = REGISTRY[REGISTRY.len() - 1].name;
        let some = Roles::parse(&format!("agents, reconcilers:{last}:{first}")).unwrap();
        assert!(!some.api && some.agents);
        // In the registry's order, whatever the order given.
        assert_eq!(some.chosen().iter().map(|r| r.name).collect::<Vec<_>>(), vec![first, last]);
        assert_eq!(Roles::parse(&some.describe()).unwrap(), some);
    }

    #[test]
    fn what_is_refused_says_why() {
        for (text, why) in [
            ("", "empty role"),
            ("api,,agents", "empty role"),
            ("api,api", "named twice"),
            ("api:x", "takes no names"),
            ("controllers", "is not a role"),
            ("reconcilers:nope", "is not a reconciler"),
            ("reconcilers:", "is not a reconciler"),
            (&format!("reconcilers:{0}:{0}", REGISTRY[0].name), "named twice"),
            ("reconcilers,reconcilers:webhooks", "named twice"),
        ] {
            let refused = Roles::parse(text).expect_err(text);
            assert!(refused.contains(why), "{text:?}: {refused}");
        }
    }

    #[test]
    fn without_reconcilers_keeps_only_the_duties() {
        let roles = Roles::without_reconcilers();
        assert!(roles.api && roles.agents);
        assert!(!roles.chosen().is_empty());
        assert!(roles.chosen().iter().all(|r| r.duty));
    }
}
