//! `bc-core`: the event log of Better Compute.
//!
//! Layout:
//! - [`id`]: typed, prefixed ids (`evt_`, `ten_`, `pool_`, `node_`, `rsv_`, `key_`, `flv_`, `img_`, …);
//! - [`error`]: the one error type and its stable codes;
//! - [`canonical`]: deterministic CBOR (RFC 8949 §4.2.1);
//! - [`event`]: the envelope, its hash, the stored form, outbox positions;
//! - [`keys`]: the Ed25519 log key, key ids, pins, secret files;
//! - [`approval`]: the bytes of destructive batches (approval and approver-set messages, P-256
//!   signatures, leaves) and a node's check of a batch command's release, pure;
//! - [`release`]: signed `bcd` releases (release keys, the manifest, its signature, the update
//!   checks), pure;
//! - [`chain`]: pure verification of a tenant's hash chain;
//! - [`clock`]: time as a trait; [`id_source`]: ids as a trait, real and seeded;
//! - [`follow`]: a monitor's checks of fetched checkpoints and entries (pure);
//! - [`tiles`]: the tree as C2SP `tlog-tiles` (paths, tiles, bundles, a bounded cache);
//! - [`witness`]: the C2SP tlog-witness request and cosignatures (pure);
//! - [`well_known`]: the well-known document's signed bytes and the join token sealed with
//!   HPKE to the join encryption key (pure);
//! - [`store`]: the `EventStore` traits (split by concern), the store algorithm written once
//!   over a per-dialect transaction, the SQLite and PostgreSQL backends (SQL only), the
//!   group-committing appender and the projection fold.
//!
//! `schema/LOG-FORMAT.md` describes the bytes this crate writes.

pub mod agent;
pub mod approval;
pub mod audit;
pub mod canonical;
pub mod chain;
pub mod clock;
pub mod error;
pub mod event;
pub mod follow;
pub mod id;
pub mod id_source;
pub mod keys;
pub mod merkle;
pub mod note;
pub mod release;
pub mod sealing;
pub mod store;
pub mod testing;
pub mod tiles;
pub mod tunnel;
pub mod webhook;
pub mod well_known;
pub mod witness;

pub use error::{Error, ErrorCode, Result};
