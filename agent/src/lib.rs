//! `bc-agent`: `bcd`, the node agent. It joins a machine to the fleet (`join`), keeps a signed,
//! hash-chained journal of what the machine did (`journal`), holds one long-lived session to
//! the gateway (`session`, driven by `driver`), runs commands (`runner`): GPU holds
//! (`binding`, `holds`) and instances (`hypervisor`, `images`, `disk_header`, `instances`), and
//! answers `bcd status` on a unix socket (`status`).
//!
//! Layout: [`session`] is the session logic without IO (a clock, an RNG and the transport come
//! in from outside), so the simulator runs the real logic; [`driver`] wraps it in tokio and
//! tonic; [`client`] is the pinned-TLS (or loopback h2c) channel; [`config`] the configuration
//! and the node's files; [`token`] where a join token may come from; [`join`] the join;
//! [`tpm`] the TPM's rounds of a join with no token (`--attestor tpm`), the TPM behind a trait;
//! [`well_known`] the control plane's signed document `bcd join --server` checks against its pins;
//! [`doctor`] the checks of `bcd doctor`; `sim` (fakehw builds) many agents in one process;
//! [`update`] signed releases into A/B slots, the re-exec and the watchdog (`agent.update`);
//! [`ledger`] the whole-file JSON ledgers (`holds.json`, `instances.json`); the decisions over
//! them ([`holds::decide_hold`], [`instances::decide_apply`], [`update::decide_update`]) are pure,
//! and so is [`disk_header::inspect_header`], whether a disk's header names no other file.
//!
//! Architecture invariant: this crate depends on `bc-core` and `bc-proto`, never on the gateway;
//! it is the only crate that touches the node's OS.

/// Whether this build has the seeded fake machine (`fakehw`): `bcd sim` and `dev --sim` need it.
pub const FAKE_MACHINES: bool = cfg!(feature = "fakehw");

pub mod binding;
pub mod client;
pub mod config;
pub mod disk_header;
pub mod doctor;
pub mod driver;
pub mod holds;
pub mod hypervisor;
pub mod images;
pub mod instances;
pub mod inventory;
pub mod join;
pub mod join_request;
pub mod journal;
pub mod ledger;
pub mod metrics;
pub mod node_cert;
pub mod runner;
pub mod sandbox_snapshots;
pub mod sandboxes;
pub mod session;
pub mod sim;
pub mod ssh_ca;
pub mod status;
pub mod support_bundle;
pub mod token;
pub mod tpm;
pub mod tunnel;
pub mod update;
pub mod volumes;
pub mod well_known;
