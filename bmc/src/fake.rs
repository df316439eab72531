//! An in-memory BMC: what the simulator and the deadline tests drive the real workflows
//! against. It does no IO and keeps no time of its own; it can be told to misbehave as real
//! BMCs do ([`Misbehaviour`]), and it records every call so a test can say what was asked.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::{Bmc, BmcConnector, BmcError, BmcResult, BmcTarget, BootSource, PowerState, ResetType, SystemInfo};

/// How a fake BMC misbehaves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Misbehaviour {
    /// It does what it is asked; power applies after [`FakeState::power_lag_polls`] reads.
    #[default]
    None,
    /// Every call answers 401.
    Unauthorized,
    /// Resets are accepted and never applied.
    PowerNeverApplies,
    /// Every call times out.
    Hangs,
}

/// One fake machine's state, shared between the BMC the reconciler holds and the test.
#[derive(Clone, Debug, Default)]
pub struct FakeState {
    pub power: Option<PowerState>,
    /// The power state a reset asked for, applied after `power_lag_polls` more reads.
    pub pending_power: Option<(PowerState, u32)>,
    pub power_lag_polls: u32,
    pub boot_once: Option<BootSource>,
    /// How many times a boot override was set, and the last target.
    pub boot_overrides: Vec<BootSource>,
    pub media_image: Option<String>,
    pub misbehaviour: Misbehaviour,
    /// Every call, in order (`system`, `reset:On`, `boot-once:Cd`, `insert:<url>`, `eject`).
    pub calls: Vec<String>,
    /// Power states as applied, in order.
    pub power_history: Vec<PowerState>,
}

/// A fake BMC: a handle on its shared state.
#[derive(Clone, Debug, Default)]
pub struct FakeBmc {
    pub state: Arc<Mutex<FakeState>>,
}

impl FakeBmc {
    pub fn new(power: PowerState) -> Self {
        let state = FakeState { power: Some(power), ..FakeState::default() };
        FakeBmc { state: Arc::new(Mutex::new(state)) }
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut FakeState) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn call(&self, what: String) -> BmcResult<std::sync::MutexGuard<'_, FakeState>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.calls.push(what);
        match state.misbehaviour {
            Misbehaviour::Unauthorized => Err(BmcError::Unauthorized("HTTP 401 from the fake BMC".into())),
            Misbehaviour::Hangs => Err(BmcError::Timeout(format!("no answer in {} s", crate::REQUEST_TIMEOUT_S))),
            Misbehaviour::None | Misbehaviour::PowerNeverApplies => Ok(state),
        }
    }
}

#[async_trait::async_trait]
impl Bmc for FakeBmc {
    async fn system(&self) -> BmcResult<SystemInfo> {
        let mut state = self.call("system".into())?;
        if let Some((want, polls)) = state.pending_power {
            if polls == 0 {
                state.power = Some(want);
                state.power_history.push(want);
                state.pending_power = None;
            } else {
                state.pending_power = Some((want, polls - 1));
            }
        }
        Ok(SystemInfo {
            power_state: state.power,
            manufacturer: Some("Fake".into()),
            model: Some("fake-bmc".into()),
            serial_number: Some("FAKE-0001".into()),
            uuid: None,
            processor_count: Some(2),
            memory_gib: Some(16),
            boot_once: state.boot_once,
            media_image: state.media_image.clone(),
        })
    }

    async fn reset(&self, reset: ResetType) -> BmcResult<()> {
        let mut state = self.call(format!("reset:{}", reset.as_str()))?;
        if state.misbehaviour == Misbehaviour::PowerNeverApplies {
            return Ok(());
        }
        let want = match reset {
            ResetType::On | ResetType::ForceRestart => PowerState::On,
            ResetType::ForceOff | ResetType::GracefulShutdown => PowerState::Off,
        };
        if reset == ResetType::ForceRestart || state.power != Some(want) {
            // A boot consumes the one-time override.
            if want == PowerState::On {
                state.boot_once = None;
            }
            let lag = state.power_lag_polls;
            state.pending_power = Some((want, lag));
        }
        Ok(())
    }

    async fn set_boot_once(&self, source: BootSource) -> BmcResult<()> {
        let mut state = self.call(format!("boot-once:{}", source.as_str()))?;
        state.boot_once = Some(source);
        state.boot_overrides.push(source);
        Ok(())
    }

    async fn insert_media(&self, image_url: &str) -> BmcResult<()> {
        let mut state = self.call(format!("insert:{image_url}"))?;
        state.media_image = Some(image_url.to_owned());
        Ok(())
    }

    async fn eject_media(&self) -> BmcResult<()> {
        let mut state = self.call("eject".into())?;
        state.media_image = None;
        Ok(())
    }
}

/// Hands out one fake per BMC address, made on first use (powered off); a test or the
/// simulator reaches a machine's fake by its address.
#[derive(Clone, Debug, Default)]
pub struct FakeConnector {
    pub machines: Arc<Mutex<BTreeMap<String, FakeBmc>>>,
}

impl FakeConnector {
    pub fn machine(&self, address: &str) -> FakeBmc {
        let mut machines = self.machines.lock().unwrap_or_else(|p| p.into_inner());
        machines.entry(address.trim_end_matches('/').to_owned()).or_insert_with(|| FakeBmc::new(PowerState::Off)).clone()
    }
}

impl BmcConnector for FakeConnector {
    fn connect(&self, target: &BmcTarget) -> BmcResult<Arc<dyn Bmc>> {
        Ok(Arc::new(self.machine(target.address.as_str())))
    }
}
