//! Resources stored one projection row per entity, under their kind and keyed by their typed
//! id: what `get`, `list` and the answer of a `create` share across the method groups.
//!
//! A row is always read through [`Call::row`], so a handler that answers with the row its own
//! append just wrote gets it as the commit left it, not read back; an entity that is not there
//! is `NOT_FOUND` naming it (`image img_…`).

use std::fmt::Display;
use std::str::FromStr;

use bc_core::id::{ApiKeyId, CommandId, FlavorId, ImageId, InstanceId, NodeId, PoolId, ReleaseId, TenantId, WebhookId};
use bc_core::store::AppendResult;
use bc_core::{Error, Result};
use bc_projections::rollout::{KIND_RELEASE, ReleaseDoc};
use bc_projections::{
    ApiKeyDoc, CommandDoc, FlavorDoc, ImageDoc, InstanceDoc, KIND_API_KEY, KIND_COMMAND, KIND_FLAVOR, KIND_IMAGE, KIND_INSTANCE,
    KIND_NODE, KIND_POOL, KIND_WEBHOOK, NodeDoc, PoolDoc, WebhookDoc,
};
use serde::de::DeserializeOwned;

use super::body::{parse_filter, parse_id};
use super::call::{Call, doc, stream_id};
use super::paging::{Page, list_rows};

/// A stored document of one entity.
pub trait Resource: DeserializeOwned {
    /// The projection kind its rows are stored under.
    const KIND: &'static str;
    /// What an error calls it (`image`).
    const WHAT: &'static str;
    /// The input field that names one (`imageId`).
    const ID_FIELD: &'static str;
    /// Its typed id, the row's id as text.
    type Id: FromStr<Err = Error> + Display;
}

macro_rules! resource {
    ($doc:ty, $kind:expr, $what:literal, $field:literal, $id:ty) => {
        impl Resource for $doc {
            const KIND: &'static str = $kind;
            const WHAT: &'static str = $what;
            const ID_FIELD: &'static str = $field;
            type Id = $id;
        }
    };
}

resource!(ApiKeyDoc, KIND_API_KEY, "api key", "keyId", ApiKeyId);
resource!(CommandDoc, KIND_COMMAND, "command", "commandId", CommandId);
resource!(FlavorDoc, KIND_FLAVOR, "flavor", "flavorId", FlavorId);
resource!(ImageDoc, KIND_IMAGE, "image", "imageId", ImageId);
resource!(InstanceDoc, KIND_INSTANCE, "instance", "instanceId", InstanceId);
resource!(NodeDoc, KIND_NODE, "node", "nodeId", NodeId);
resource!(PoolDoc, KIND_POOL, "pool", "poolId", PoolId);
resource!(ReleaseDoc, KIND_RELEASE, "release", "releaseId", ReleaseId);
resource!(WebhookDoc, KIND_WEBHOOK, "webhook", "webhookId", WebhookId);

impl Call<'_> {
    /// The entity `id` of the tenant the call names (`tenantId`, the key's own when absent),
    /// `id` parsed as the resource's typed id, the error naming its field: what a `get` answers.
    pub async fn named<R: Resource>(&self, tenant: &Option<String>, id: &str) -> Result<R> {
        let tenant = self.tenant(tenant).await?;
        let id: R::Id = parse_id(R::ID_FIELD, id)?;
        self.row(tenant, R::KIND, &id.to_string(), R::WHAT).await
    }

    /// The entity whose stream `result`'s first event created: what a `create` answers.
    pub async fn created<R: Resource>(&self, tenant: TenantId, result: &AppendResult) -> Result<R> {
        let stream = &result.events[0].envelope.stream;
        self.row(tenant, R::KIND, stream_id(stream), R::WHAT).await
    }
}

/// One page of the entities of the tenant the call names, each as its view `V`.
pub async fn list_all<R: Resource, V: From<R>>(
    call: &Call<'_>,
    tenant: &Option<String>,
    limit: Option<u32>,
    cursor: Option<&str>,
) -> Result<Page<V>> {
    let tenant = call.tenant(tenant).await?;
    list_where(call, tenant, limit, cursor, |_: &R| true).await
}

/// One page of the entities of the tenant the call names whose `id_of` is the `filter` id
/// (every entity when it is absent; the error of a malformed one names `field`), each as its
/// view `V`.
pub async fn list_by<R: Resource, V: From<R>, I: FromStr<Err = Error> + Display>(
    call: &Call<'_>,
    tenant: &Option<String>,
    (limit, cursor): (Option<u32>, Option<&str>),
    (field, filter): (&str, &Option<String>),
    id_of: impl Fn(&R) -> &str,
) -> Result<Page<V>> {
    let tenant = call.tenant(tenant).await?;
    let filter = parse_filter::<I>(field, filter)?;
    list_where(call, tenant, limit, cursor, |entity: &R| filter.as_deref().is_none_or(|id| id == id_of(entity))).await
}

/// One page of `tenant`'s entities, each as its view `V`, those `keep` refuses left out (a
/// filtered page can come back short; `nextCursor` is set while rows remain).
pub async fn list_where<R: Resource, V: From<R>>(
    call: &Call<'_>,
    tenant: TenantId,
    limit: Option<u32>,
    cursor: Option<&str>,
    keep: impl Fn(&R) -> bool,
) -> Result<Page<V>> {
    list_rows(call, tenant, R::KIND, limit, cursor, |row| {
        let entity: R = doc(row)?;
        Ok(keep(&entity).then(|| entity.into()))
    })
    .await
}
