//! `system.*`: what the server is, and who the caller is.

use bc_core::Result;
use schemars::JsonSchema;
use serde::Deserialize;

use super::views::{VersionView, WhoamiView};
use super::{Access, Call, Method, method};

pub(super) const METHODS: &[Method] = &[
    method!("system.version", Access::Public, "server version and the log key's pin", Empty => VersionView, system_version),
    method!(
        "system.whoami",
        Access::Authenticated,
        "the calling key: tenant, key id, actions",
        Empty => WhoamiView,
        system_whoami,
    ),
];

/// No fields.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Empty {}

async fn system_version(call: &Call<'_>, _: Empty) -> Result<VersionView> {
    let log = &call.state.log;
    Ok(VersionView {
        version: env!("CARGO_PKG_VERSION").into(),
        backend: call.state.store.backend().into(),
        log_key_id: log.key.key_id().to_string(),
        log_key_pin: log.key.pin(),
    })
}

async fn system_whoami(call: &Call<'_>, _: Empty) -> Result<WhoamiView> {
    let p = call.principal();
    Ok(WhoamiView { tenant_id: p.tenant.to_string(), key_id: p.key_id.clone(), actions: p.actions.clone(), root: p.is_root() })
}
