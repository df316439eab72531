//! Baseboard management controllers: what the `metal` reconciler asks of a machine's BMC, as
//! one trait, [`Bmc`], with two implementations: [`redfish::RedfishBmc`], a DMTF Redfish client
//! over HTTPS, and [`fake::FakeBmc`], an in-memory BMC for the simulator and the deadline tests,
//! which can be told to misbehave as real BMCs do (refuse credentials, never apply power, hang).
//!
//! A BMC applies power late: [`Bmc::reset`] only asks; the caller polls
//! [`Bmc::system`] until the power state is the one it wants, or its deadline passes.
//!
//! Every call is bounded by [`REQUEST_TIMEOUT_S`]; nothing here retries (the workflow does,
//! with back-off, and counts the attempts).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub mod fake;
pub mod network;
pub mod redfish;

pub use network::BmcNetworks;

/// The longest one request to a BMC may take, connecting included.
pub const REQUEST_TIMEOUT_S: u64 = 30;

/// The longest connecting to a BMC may take (TCP and the TLS handshake): a BMC on a
/// management network answers a connection in milliseconds, and one that does not (a dead
/// address, a tarpit) holds its machine's turn no longer than this.
pub const CONNECT_TIMEOUT_S: u64 = 5;

const _: () = assert!(CONNECT_TIMEOUT_S < REQUEST_TIMEOUT_S);

/// A system's power state, as Redfish names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PowerState {
    On,
    Off,
    PoweringOn,
    PoweringOff,
}

impl PowerState {
    pub fn as_str(self) -> &'static str {
        match self {
            PowerState::On => "On",
            PowerState::Off => "Off",
            PowerState::PoweringOn => "PoweringOn",
            PowerState::PoweringOff => "PoweringOff",
        }
    }
}

/// `ComputerSystem.Reset`'s `ResetType`s this project uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResetType {
    On,
    ForceOff,
    GracefulShutdown,
    ForceRestart,
}

impl ResetType {
    pub fn as_str(self) -> &'static str {
        match self {
            ResetType::On => "On",
            ResetType::ForceOff => "ForceOff",
            ResetType::GracefulShutdown => "GracefulShutdown",
            ResetType::ForceRestart => "ForceRestart",
        }
    }
}

/// A one-time boot override's target (`Boot.BootSourceOverrideTarget`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BootSource {
    Pxe,
    Cd,
    Hdd,
}

impl BootSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BootSource::Pxe => "Pxe",
            BootSource::Cd => "Cd",
            BootSource::Hdd => "Hdd",
        }
    }
}

/// What a BMC says of its system: the fields the lifecycle reads (power, for every step; the
/// rest for inspection). Absent fields are `None`, never guessed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemInfo {
    pub power_state: Option<PowerState>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    pub uuid: Option<String>,
    pub processor_count: Option<u32>,
    pub memory_gib: Option<u32>,
    /// The pending one-time boot override, if any (`Once` with a target).
    pub boot_once: Option<BootSource>,
    /// The image in the virtual CD drive, if any.
    pub media_image: Option<String>,
}

/// Why a BMC call failed. The workflow decides from the kind: `Unauthorized` is retried a
/// bounded number of times and then puts the machine in maintenance; the others are retried
/// with back-off until the step's deadline.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BmcError {
    /// The BMC refused the credentials (HTTP 401 or 403).
    #[error("the BMC refused the credentials: {0}")]
    Unauthorized(String),
    /// No answer within [`REQUEST_TIMEOUT_S`].
    #[error("the BMC did not answer in time: {0}")]
    Timeout(String),
    /// No connection (refused, DNS, TLS: the certificate did not verify). One text for every
    /// cause, so the error does not tell a closed port from an open one; the cause is in the
    /// log.
    #[error("the BMC is unreachable: {0}")]
    Unreachable(String),
    /// The address is outside the deployment's BMC networks ([`BmcNetworks`]): nothing was
    /// sent.
    #[error("the BMC's address is refused: {0}")]
    AddressRefused(String),
    /// The BMC answered with an error status.
    #[error("the BMC refused the request (HTTP {status}): {message}")]
    Refused { status: u16, message: String },
    /// The BMC answered something that is not Redfish as this client reads it (or lacks what
    /// the call needs: no system, no virtual CD drive, no action target); or the target itself
    /// cannot be used as given (not `https://`, a CA bundle or pin that does not parse).
    #[error("the BMC's answer is not understood: {0}")]
    Protocol(String),
}

impl BmcError {
    /// A stable, short name of the kind, for events and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BmcError::Unauthorized(_) => "unauthorized",
            BmcError::Timeout(_) => "timeout",
            BmcError::Unreachable(_) => "unreachable",
            BmcError::AddressRefused(_) => "address-refused",
            BmcError::Refused { .. } => "refused",
            BmcError::Protocol(_) => "protocol",
        }
    }
}

pub type BmcResult<T> = std::result::Result<T, BmcError>;

/// One machine's BMC.
#[async_trait::async_trait]
pub trait Bmc: Send + Sync {
    /// The system's state (one GET).
    async fn system(&self) -> BmcResult<SystemInfo>;
    /// Ask for a power change (`ComputerSystem.Reset`); the BMC may apply it late.
    async fn reset(&self, reset: ResetType) -> BmcResult<()>;
    /// Boot once from `source` at the next boot (`BootSourceOverrideEnabled: Once`).
    async fn set_boot_once(&self, source: BootSource) -> BmcResult<()>;
    /// Insert `image_url` into the virtual CD drive (`VirtualMedia.InsertMedia`), ejecting
    /// what is there first.
    async fn insert_media(&self, image_url: &str) -> BmcResult<()>;
    /// Eject the virtual CD drive; an empty drive is not an error.
    async fn eject_media(&self) -> BmcResult<()>;
}

/// How the BMC's certificate is checked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "mode")]
pub enum BmcTls {
    /// Against these CA certificates (PEM).
    CaBundle { pem: String },
    /// Against this pin of the leaf's public key: `sha256/` + base64 of the SHA-256 of its
    /// DER SubjectPublicKeyInfo.
    Pin { pin: String },
    /// Not checked at all: only by an explicit flag at enrollment, and `metal get` says so.
    Insecure,
}

/// Where a BMC is and how to talk to it. The password is never serialized by `Debug`.
#[derive(Clone)]
pub struct BmcTarget {
    /// `https://host[:port]`, the Redfish service root's origin.
    pub address: url::Url,
    /// The ComputerSystem's path (`/redfish/v1/Systems/<id>`); `None`: the only system.
    pub system_path: Option<String>,
    pub username: String,
    pub password: String,
    pub tls: BmcTls,
}

impl std::fmt::Debug for BmcTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BmcTarget")
            .field("address", &self.address.as_str())
            .field("system_path", &self.system_path)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("tls", &self.tls)
            .finish()
    }
}

/// Makes a [`Bmc`] for a target: the real one opens Redfish clients, the simulator's and the
/// tests' hand out fakes.
pub trait BmcConnector: Send + Sync {
    fn connect(&self, target: &BmcTarget) -> BmcResult<Arc<dyn Bmc>>;
}

/// The connector of `dev`, `serve` and `reconcile`: a Redfish client per target, connecting
/// only to addresses inside the deployment's BMC networks.
pub struct RedfishConnector {
    pub networks: BmcNetworks,
}

impl BmcConnector for RedfishConnector {
    fn connect(&self, target: &BmcTarget) -> BmcResult<Arc<dyn Bmc>> {
        Ok(Arc::new(redfish::RedfishBmc::new(target, &self.networks)?))
    }
}
