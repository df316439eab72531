//! A tenant's tree, read-only, as C2SP `tlog-tiles` (`schema/LOG-FORMAT.md`, "Tiles"):
//!
//! - `GET /audit/{tenant}/checkpoint`: the newest sealed checkpoint (signed note, with any
//!   witness cosignatures), short-lived (`Cache-Control: private, no-cache`);
//! - `GET /audit/{tenant}/keys`: the log keys' vkeys, one per line (a pin names one of them);
//! - `GET /audit/{tenant}/rotations`: every key rotation with its proof (the `log_key.rotated`
//!   event, the old key's signature of it, its inclusion in a root checkpoint the old key
//!   signed), as a proof file carries them, so a monitor of any tenant holding only an old pin
//!   learns the new key without reading the root tenant's chain;
//! - `GET /audit/{tenant}/tile/{L}/{N}[.p/{W}]`: the tree's hashes;
//! - `GET /audit/{tenant}/tile/entries/{N}[.p/{W}]`: the leaves' data (event hashes);
//! - `GET /audit/{tenant}/tile/events/{N}[.p/{W}]`: the events themselves with their
//!   signatures, in bundles of the same shape.
//!
//! Only what the newest checkpoint covers is served. Full tiles and bundles never change:
//! `Cache-Control: private, max-age=31536000, immutable`; partial ones are short-lived. Access
//! is that of `events.list` (`compute:events:read` on the tenant), so every answer is
//! `private`: a shared cache in front of the gateway must never serve one tenant's events,
//! webhook URLs or BMC usernames to a request that did not carry that tenant's token (RFC 9111
//! §3.5 lets a shared cache store an authenticated answer only when it says `public`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bc_core::Error;
use bc_core::id::TenantId;
use bc_core::note::CheckpointBody;
use bc_core::tiles::{self, BundledEvent, TILE_WIDTH, TilePath};

use crate::AppState;
use crate::error::ApiError;

/// The action `events.list` needs: reading a tenant's tree is reading its events.
pub const AUDIT_READ_ACTION: &str = "compute:events:read";
pub const CACHE_IMMUTABLE: &str = "private, max-age=31536000, immutable";
/// Partial tiles: the full tile replaces them as the tree grows.
pub const CACHE_PARTIAL: &str = "private, max-age=10";
pub const CACHE_CHECKPOINT: &str = "private, no-cache";

async fn authorized(state: &AppState, headers: &HeaderMap, tenant: &str) -> Result<TenantId, ApiError> {
    let header = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    let principal = crate::auth::authenticate(&*state.store, header).await?;
    let tenant = tenant.parse::<TenantId>().map_err(|e| Error::invalid(format!("tenant: {e}")))?;
    state.authorize_tenant(&principal, AUDIT_READ_ACTION, tenant).await?;
    Ok(tenant)
}

/// The newest checkpoint's note and body, or NOT_FOUND.
async fn newest(state: &AppState, tenant: TenantId) -> Result<(String, u64), ApiError> {
    let Some(cp) = bc_core::audit::newest_checkpoint(&*state.store, tenant).await? else {
        return Err(Error::not_found(format!("a checkpoint of tenant {tenant} (none sealed yet)")).into());
    };
    // The size is the note's own, not the row's column.
    let text = cp.note.split_once("\n\n").map(|(t, _)| format!("{t}\n")).unwrap_or_default();
    let body = CheckpointBody::parse(&text).map_err(|e| Error::Corrupt { tenant: tenant.to_string(), seq: cp.size, what: e })?;
    Ok((cp.cosigned_note(), body.size))
}

fn bytes(cache: &'static str, content_type: &'static str, body: Vec<u8>) -> Response {
    let mut response = body.into_response();
    let h = response.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

pub async fn checkpoint(State(state): State<Arc<AppState>>, headers: HeaderMap, Path(tenant): Path<String>) -> Response {
    let run = async {
        let tenant = authorized(&state, &headers, &tenant).await?;
        let (note, _) = newest(&state, tenant).await?;
        Ok::<_, ApiError>(bytes(CACHE_CHECKPOINT, "text/plain; charset=utf-8", note.into_bytes()))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /audit/{tenant}/keys`: every log key's note verifier key (`vkey`), one per line, named
/// as the newest checkpoint's origin names the deployment, so a monitor holding only a pin finds
/// the public key to check with (it trusts a line only if the key matches its pin).
pub async fn keys(State(state): State<Arc<AppState>>, headers: HeaderMap, Path(tenant): Path<String>) -> Response {
    let run = async {
        let tenant = authorized(&state, &headers, &tenant).await?;
        let (note, _) = newest(&state, tenant).await?;
        let origin = note.lines().next().unwrap_or_default();
        let deployment = origin.strip_suffix(&format!("/audit/{tenant}")).unwrap_or(origin);
        let mut out = String::new();
        for vkey in bc_core::audit::known_vkeys(&*state.store, deployment).await? {
            out.push_str(&vkey.encode());
            out.push('\n');
        }
        Ok::<_, ApiError>(bytes(CACHE_CHECKPOINT, "text/plain; charset=utf-8", out.into_bytes()))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /audit/{tenant}/rotations`: `bc_core::note::encode_rotations` (deterministic CBOR).
/// Served to the tenant's readers although it concerns the root chain: it is what every proof
/// file `audit prove` writes for any tenant carries (the rotation events, a root checkpoint and
/// an inclusion path), and no more.
pub async fn rotations(State(state): State<Arc<AppState>>, headers: HeaderMap, Path(tenant): Path<String>) -> Response {
    let run = async {
        let tenant = authorized(&state, &headers, &tenant).await?;
        let (note, _) = newest(&state, tenant).await?;
        let origin = note.lines().next().unwrap_or_default();
        let deployment = origin.strip_suffix(&format!("/audit/{tenant}")).unwrap_or(origin);
        let proofs = state.rotations.get(&*state.store, deployment).await?;
        Ok::<_, ApiError>(bytes(CACHE_CHECKPOINT, "application/cbor", bc_core::note::encode_rotations(&proofs)))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn tile(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, rest)): Path<(String, String)>,
) -> Response {
    let run = async {
        let tenant = authorized(&state, &headers, &tenant).await?;
        let path = tiles::parse_tile_path(&rest)
            .ok_or_else(|| Error::not_found(format!("tile/{rest} (tiles are tile/L/N[.p/W], tile/entries/N, tile/events/N)")))?;
        let (_, size) = newest(&state, tenant).await?;
        let (level, tile) = match path {
            TilePath::Hashes { level, tile } => (level, tile),
            TilePath::Entries(tile) | TilePath::Events(tile) => (0, tile),
        };
        if !tiles::tile_exists(size, level, tile) {
            return Err(Error::not_found(format!("tile/{rest} in the tree of size {size}")).into());
        }
        let cache = if tile.width == TILE_WIDTH { CACHE_IMMUTABLE } else { CACHE_PARTIAL };
        let body = match path {
            TilePath::Hashes { level, tile } => tiles::tile_bytes(&state.tiles.tile(&*state.store, tenant, level, tile).await?),
            TilePath::Entries(tile) => {
                tiles::entry_bundle(&tiles::event_hashes(&*state.store, tenant, tile.index * TILE_WIDTH + 1, tile.width).await?)
            }
            TilePath::Events(tile) => {
                let rows = tiles::chain_rows(&*state.store, tenant, tile.index * TILE_WIDTH + 1, tile.width).await?;
                let events: Vec<BundledEvent> =
                    rows.into_iter().map(|r| BundledEvent { canonical: r.canonical, key_id: r.key_id, sig: r.sig }).collect();
                tiles::event_bundle(&events)
            }
        };
        Ok::<_, ApiError>(bytes(cache, "application/octet-stream", body))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}
