//! The Redfish client (issue 12, part 3): being written; until it lands every call says so.

use crate::{Bmc, BmcError, BmcResult, BmcTarget, BootSource, ResetType, SystemInfo};

pub struct RedfishBmc;

impl RedfishBmc {
    pub fn new(_target: &BmcTarget) -> BmcResult<Self> {
        Err(BmcError::Unreachable("the Redfish client is not built yet".into()))
    }
}

#[async_trait::async_trait]
impl Bmc for RedfishBmc {
    async fn system(&self) -> BmcResult<SystemInfo> {
        unreachable!()
    }
    async fn reset(&self, _reset: ResetType) -> BmcResult<()> {
        unreachable!()
    }
    async fn set_boot_once(&self, _source: BootSource) -> BmcResult<()> {
        unreachable!()
    }
    async fn insert_media(&self, _image_url: &str) -> BmcResult<()> {
        unreachable!()
    }
    async fn eject_media(&self) -> BmcResult<()> {
        unreachable!()
    }
}
