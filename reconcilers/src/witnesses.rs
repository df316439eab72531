//! The `witnesses` reconciler: sends each tenant's newest checkpoint to the witnesses the
//! deployment names (`--witness NAME=URL+VKEY`) with C2SP `tlog-witness` (`POST
//! /add-checkpoint`: `old N`, the consistency proof from `N`, the checkpoint), and records each
//! returned cosignature as a `checkpoint.cosigned` event, which the checkpoint's row (and so
//! `/audit/{tenant}/checkpoint` and `audit prove`) carries.
//!
//! Level-triggered: every pass compares each tenant's newest checkpoint with the cosignatures it
//! carries and sends it to the witnesses missing. What a witness has seen is learned from it
//! (a `409` names its size; the request is sent again once from that size). A witness that is
//! down or refuses is retried with exponential back-off (`BACKOFF_*`), and delays nothing but
//! its own cosignature: witnesses are tried one after another with a per-request timeout.
//!
//! A consistency proof is made from the tree of the last checkpoint sent (its compact range,
//! kept per tenant) and the events appended since, so each new checkpoint reads what the log grew
//! by. The whole chain is read only for a witness at another size (one that lags, or the first
//! proof after a start).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bc_core::audit;
use bc_core::id::TenantId;
use bc_core::merkle::{self, RootBuilder};
use bc_core::store::Log;
use bc_core::witness::{self, WitnessKey};

pub const NAME: &str = "witnesses";
pub const TICK_MS: u64 = 1000;
pub const REQUEST_TIMEOUT_S: u64 = 10;
pub const BACKOFF_MS_MIN: u64 = 1000;
pub const BACKOFF_MS_MAX: u64 = 5 * 60 * 1000;
/// Largest answer read from a witness.
const ANSWER_BYTES_MAX: usize = 16 * 1024;

/// One witness, from `--witness NAME=URL+VKEY`.
#[derive(Clone, Debug)]
pub struct Witness {
    pub label: String,
    pub url: String,
    pub key: WitnessKey,
}

impl Witness {
    /// Parses `NAME=URL+VKEY` (the URL ends at the first `+`; a vkey's name holds none).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (label, rest) = text.split_once('=').ok_or("a witness is NAME=URL+VKEY")?;
        let (url, vkey) = rest.split_once('+').ok_or("a witness is NAME=URL+VKEY")?;
        let parsed = url::Url::parse(url).map_err(|e| format!("witness {label}: URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!("witness {label}: the URL must be http(s)"));
        }
        Ok(Self { label: label.to_owned(), url: url.trim_end_matches('/').to_owned(), key: WitnessKey::parse(vkey)? })
    }
}

#[derive(Default)]
struct Peer {
    /// The size this witness last said it has, per tenant.
    sizes: HashMap<TenantId, u64>,
    /// Not before this time (ms, the log's clock: back-off), and the current back-off.
    retry_at_ms: Option<u64>,
    backoff_ms: u64,
}

enum Sent {
    Cosigned(String),
    Conflict(u64),
}

async fn send(http: &reqwest::Client, w: &Witness, body: String) -> Result<Sent, String> {
    let response =
        http.post(format!("{}/add-checkpoint", w.url)).body(body).send().await.map_err(|e| format!("unreachable: {e}"))?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(ANSWER_BYTES_MAX)]).into_owned();
    match status.as_u16() {
        200 => Ok(Sent::Cosigned(text)),
        409 => witness::parse_conflict(&text).map(Sent::Conflict).ok_or_else(|| "409 without a size".into()),
        _ => Err(format!("{status}: {}", text.trim())),
    }
}

/// The consistency proof from size `old` to `size` of `tenant`'s tree: none from size 0 (nothing
/// read or kept); from the tree kept in `trees` when it is of size `old` (reading only the
/// events after it); else from every leaf. The last two leave `trees` keeping the tree of
/// `size`.
async fn proof(
    log: &Log,
    trees: &mut HashMap<TenantId, RootBuilder>,
    tenant: TenantId,
    old: u64,
    size: u64,
) -> Result<Vec<merkle::Hash>, String> {
    if old == 0 {
        return Ok(vec![]);
    }
    if let Some(kept) = trees.get(&tenant).filter(|t| t.size() == old).cloned() {
        let added: Vec<merkle::Hash> = bc_core::tiles::event_hashes(&*log.store, tenant, old + 1, size - old)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .map(|h| merkle::leaf_hash(h))
            .collect();
        let proof = merkle::consistency_proof_extending(&kept, &added).ok_or("no proof from the kept tree")?;
        let mut grown = kept;
        added.iter().for_each(|leaf| grown.push_leaf_hash(*leaf));
        trees.insert(tenant, grown);
        return Ok(proof);
    }
    let leaves = audit::leaves(&*log.store, tenant, size).await.map_err(|e| e.to_string())?;
    let proof = merkle::consistency_proof(old, &leaves).unwrap_or_default();
    let mut tree = RootBuilder::new();
    leaves.iter().for_each(|leaf| tree.push_leaf_hash(*leaf));
    trees.insert(tenant, tree);
    Ok(proof)
}

/// One witness, one tenant: send the checkpoint (again from the size a 409 names) and record
/// the cosignature.
async fn witness_one(
    log: &Log,
    http: &reqwest::Client,
    w: &Witness,
    peer: &mut Peer,
    trees: &mut HashMap<TenantId, RootBuilder>,
    tenant: TenantId,
    cp: &audit::StoredCheckpoint,
) -> Result<(), String> {
    for _ in 0..2 {
        let old = peer.sizes.get(&tenant).copied().unwrap_or(0).min(cp.size);
        let proof = proof(log, trees, tenant, old, cp.size).await?;
        match send(http, w, witness::add_checkpoint_body(old, &proof, &cp.note)).await? {
            Sent::Conflict(size) if size > cp.size => {
                return Err(format!("the witness has size {size}, past the log's {}", cp.size));
            }
            Sent::Conflict(size) => {
                peer.sizes.insert(tenant, size);
            }
            Sent::Cosigned(answer) => {
                let cosigned = witness::add_cosignatures(&cp.note, &answer);
                if !w.key.cosigned(&cosigned) {
                    return Err("the answer holds no valid cosignature by the witness's key".into());
                }
                peer.sizes.insert(tenant, cp.size);
                let line = cosigned[cp.note.len()..]
                    .lines()
                    .find(|l| w.key.cosigned(&format!("{}{l}\n", cp.note)))
                    .unwrap_or_default()
                    .to_owned();
                audit::record_cosignature(log, tenant, cp.size, &w.key.name, &line).await.map_err(|e| e.to_string())?;
                return Ok(());
            }
        }
    }
    Err("the witness keeps naming another size".into())
}

/// The reconciler: a pass every [`TICK_MS`] ([`crate::registry`]) sends each tenant's newest
/// checkpoint to the witnesses that have not cosigned it and are not backing off. Its status
/// counts the cosignatures recorded and the witnesses that did not cosign (each backs off on its
/// own); a pass fails only when the log cannot be read.
pub struct Witnesses {
    log: Arc<Log>,
    witnesses: Vec<Witness>,
    http: reqwest::Client,
    peers: Vec<Peer>,
    /// Per tenant, the tree of the last checkpoint a proof was made to.
    trees: HashMap<TenantId, RootBuilder>,
}

impl Witnesses {
    pub fn new(log: Arc<Log>, witnesses: Vec<Witness>) -> bc_core::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(REQUEST_TIMEOUT_S))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| bc_core::Error::Internal(format!("the witnesses' HTTP client: {e}")))?;
        let peers = witnesses.iter().map(|_| Peer::default()).collect();
        Ok(Self { log, witnesses, http, peers, trees: HashMap::new() })
    }

    async fn pass(&mut self) -> bc_core::Result<Vec<(&'static str, u64)>> {
        let (mut cosigned, mut refused) = (0u64, 0u64);
        let log = &*self.log;
        let tenants: Vec<TenantId> = log.store.heads().await?.into_iter().map(|(t, _)| t).collect();
        for tenant in tenants {
            let Ok(Some(cp)) = audit::newest_checkpoint(&*log.store, tenant).await else { continue };
            let note = cp.cosigned_note();
            for (w, peer) in self.witnesses.iter().zip(self.peers.iter_mut()) {
                if w.key.cosigned(&note) || peer.retry_at_ms.is_some_and(|at| log.clock.now_ms() < at) {
                    continue;
                }
                match witness_one(log, &self.http, w, peer, &mut self.trees, tenant, &cp).await {
                    Ok(()) => {
                        tracing::info!(reconciler = NAME, witness = %w.label, %tenant, size = cp.size, "cosigned");
                        cosigned += 1;
                        peer.retry_at_ms = None;
                        peer.backoff_ms = 0;
                    }
                    Err(e) => {
                        refused += 1;
                        peer.backoff_ms = (peer.backoff_ms * 2).clamp(BACKOFF_MS_MIN, BACKOFF_MS_MAX);
                        peer.retry_at_ms = Some(log.clock.now_ms().saturating_add(peer.backoff_ms));
                        tracing::warn!(reconciler = NAME, witness = %w.label, %tenant, size = cp.size, retry_ms = peer.backoff_ms, error = %e, "witness did not cosign");
                    }
                }
            }
        }
        Ok(vec![("cosigned", cosigned), ("refused", refused)])
    }
}

impl crate::driver::Reconciler for Witnesses {
    fn name(&self) -> &'static str {
        NAME
    }

    fn activate(&mut self) -> futures::future::BoxFuture<'_, crate::driver::Activation> {
        Box::pin(async move {
            match self.pass().await {
                Ok(counts) => crate::driver::Activation::ok(counts),
                Err(e) => crate::driver::Activation::failed(e),
            }
        })
    }
}
