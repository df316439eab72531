//! `metal.*` and `workflows.*`: bare-metal machines by their BMCs, through Ironic's lifecycle
//! (`bc_projections::metal`), each verb a workflow of BMC steps the `metal` reconciler runs.
//!
//! A machine is enrolled into a pool with its BMC's address, user, password and how its
//! certificate is checked (a CA bundle, a pin, or, only when asked in so many words, not at
//! all); it gets its node id then, the id its installed system's agent joins as. The password
//! is sealed in the secret store (the data key's AEAD) and is never in an event, a log line or
//! an answer. `metal.deploy` mints a one-use join token bound to that node id in the same
//! append and answers it once; the installed system joins with it (`bcd join --node-id`), and
//! the deploy's workflow ends when it has.

use bc_core::id::{ImageId, JoinTokenId, NodeId, PoolId, TenantId, WorkflowId};
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use bc_projections::decide::{self, VerbInput, WorkflowRetry};
use bc_projections::events::{self as ev, MetalBmc};
use bc_projections::metal::Verb;
use bc_projections::workflow::{KIND_METAL, KIND_WORKFLOW, MetalDoc, Workflow, WorkflowOutcome};
use bc_projections::{ImageDoc, KIND_IMAGE, KIND_NODE, KIND_POOL, NodeDoc, PoolDoc, stream_of};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::call::{doc, stream_id};
use super::paging::{Page, list_rows};
use super::validate::{
    CursorText, ImageIdText, LimitNumber, NameText, NodeIdText, PoolIdText, TenantIdText, VersionNumber, WorkflowIdText,
    string_schema, validate_name, validate_text,
};
use super::views::{MetalView, WorkflowView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:metal:read");
const WRITE: Access = Access::Action("compute:metal:write");

/// Longest BMC address, user name and password taken.
pub const BMC_ADDRESS_CHARS_MAX: usize = 2048;
pub const BMC_USERNAME_CHARS_MAX: usize = 256;
pub const BMC_PASSWORD_CHARS_MAX: usize = 1024;
/// Largest CA bundle taken at enrollment, in characters (PEM is ASCII).
pub const BMC_CA_PEM_CHARS_MAX: usize = 64 * 1024;
/// Longest ComputerSystem path.
pub const BMC_SYSTEM_PATH_CHARS_MAX: usize = 512;
/// Machines one tenant enrolls at most.
pub const MACHINES_PER_TENANT_MAX: usize = decide::NODES_PER_TENANT_MAX;

pub(super) const METHODS: &[Method] = &[
    method!(
        "metal.enroll",
        WRITE,
        "enroll a bare-metal machine by its BMC (Redfish over HTTPS) into a pool",
        MetalEnroll => MetalView,
        metal_enroll,
    ),
    method!("metal.get", READ, "one machine: its lifecycle state, power, BMC and workflow", MachineRef => MetalView, metal_get),
    method!("metal.list", READ, "a tenant's machines, paged by cursor", MetalList => Page<MetalView>, metal_list),
    method!("metal.manage", WRITE, "check the BMC, then manage the machine (enroll → manageable)", MachineVerb => MetalView, metal_manage),
    method!("metal.inspect", WRITE, "read the machine's hardware from its BMC", MachineVerb => MetalView, metal_inspect),
    method!("metal.provide", WRITE, "clean the machine and offer it (manageable → available)", MachineVerb => MetalView, metal_provide),
    method!(
        "metal.deploy",
        WRITE,
        "boot an image through virtual media; active once its agent joins as the node",
        MetalDeploy => MetalDeployView,
        metal_deploy,
    ),
    method!("metal.undeploy", WRITE, "tear down a deployed machine and clean it", MachineVerb => MetalView, metal_undeploy),
    method!("metal.rescue", WRITE, "boot a deployed machine into a rescue image", MetalRescue => MetalView, metal_rescue),
    method!("metal.unrescue", WRITE, "boot a rescued machine back into its system", MachineVerb => MetalView, metal_unrescue),
    method!("metal.retire", WRITE, "retire a machine: never offered or deployed again", MachineVerb => MetalView, metal_retire),
    method!("metal.recover", WRITE, "take a machine out of maintenance", MachineVerb => MetalView, metal_recover),
    method!("metal.abort", WRITE, "abort the machine's running workflow (in a wait state, or a power change)", MachineVerb => MetalView, metal_abort),
    method!("metal.power", WRITE, "power a machine on, off, or reboot it", MetalPower => MetalView, metal_power),
    method!(
        "metal.bulkNow",
        WRITE,
        "one verb (undeploy, retire, powerOff) on several machines in one call, without a batch; with the approvers' quorum on, refused BATCH_REQUIRED beyond one machine",
        MetalBulkNow => MetalBulkNowView,
        metal_bulk_now,
    ),
    method!("workflows.list", READ, "a machine's workflows, newest first", WorkflowsList => Page<WorkflowView>, workflows_list),
    method!("workflows.get", READ, "one workflow: its steps and where it is", WorkflowRef => WorkflowView, workflows_get),
    method!("workflows.abort", WRITE, "abort a running workflow", WorkflowRef => WorkflowView, workflows_abort),
    method!("workflows.pause", WRITE, "stop running a workflow's steps (its deadline runs on)", WorkflowRef => WorkflowView, workflows_pause),
    method!("workflows.resume", WRITE, "run a paused workflow's steps again", WorkflowRef => WorkflowView, workflows_resume),
    method!(
        "workflows.retry",
        WRITE,
        "run a backing-off step now, or run a failed workflow's verb again",
        WorkflowRef => WorkflowView,
        workflows_retry,
    ),
];

/// Methods that refuse an `Idempotency-Key` (the OpenAPI document names none for them):
/// `metal.bulkNow` appends once per machine, and one key would replay the first machine's append
/// for the rest.
pub const IDEMPOTENCY_KEY_REFUSED: &[&str] = &["metal.bulkNow"];

/// Machines one `metal.bulkNow` names at most.
pub const METAL_BULK_NOW_MACHINES_MAX: usize = 100;

string_schema!(/// A destructive verb `metal.bulkNow` takes: `deploy` goes only through a batch (`metal bulk`),
/// which mints each installed system's join token, so it is refused here with that hint.
BulkVerbText, schemars::json_schema!({ "type": "string", "enum": ["undeploy", "retire", "powerOff"] }));

/// A host name's label: letters, digits and single hyphens inside.
const LABEL: &str = "[A-Za-z0-9]+(-[A-Za-z0-9]+)*";
/// An IPv4 address's octet, without leading zeros.
const OCTET: &str = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
/// A port, 1 to 65535.
const PORT: &str = "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])";

/// What `bmcAddress` takes: `https://` and a host name (its last label starting with a letter)
/// or an IPv4 address, an optional port, nothing else.
fn bmc_address_pattern() -> String {
    format!("^https://(({LABEL}\\.)*[A-Za-z]([A-Za-z0-9]*(-[A-Za-z0-9]+)*)?|({OCTET}\\.){{3}}{OCTET})(:{PORT})?/?$")
}

/// What `bmcSystemPath` takes: `/redfish/v1/Systems/` and segments of letters, digits, `_`,
/// `~`, `-` and single inner dots.
const SYSTEM_PATH_PATTERN: &str = "^/redfish/v1/Systems(/[A-Za-z0-9_~-]+(\\.[A-Za-z0-9_~-]+)*)+$";

string_schema!(/// A BMC's Redfish origin.
HttpsUrlText, schemars::json_schema!({
    "type": "string",
    "maxLength": BMC_ADDRESS_CHARS_MAX,
    "pattern": bmc_address_pattern(),
    "description": "https://host[:port]: a host name or an IPv4 address (an IPv6 BMC is not taken yet)",
}));
string_schema!(/// A ComputerSystem's path.
SystemPathText, schemars::json_schema!({
    "type": "string",
    "maxLength": BMC_SYSTEM_PATH_CHARS_MAX,
    "pattern": SYSTEM_PATH_PATTERN,
}));
string_schema!(/// A BMC user name.
BmcUsernameText, schemars::json_schema!({
    "type": "string",
    "minLength": 1,
    "maxLength": BMC_USERNAME_CHARS_MAX,
    "pattern": "^[^\\u0000-\\u0008\\u000B-\\u001F\\u007F-\\u009F]*$",
}));
string_schema!(/// A BMC password: sealed in the secret store, never shown.
BmcPasswordText, schemars::json_schema!({ "type": "string", "minLength": 1, "maxLength": BMC_PASSWORD_CHARS_MAX, "writeOnly": true }));
string_schema!(/// PEM CA certificates.
CaPemText, schemars::json_schema!({
    "type": "string",
    "maxLength": BMC_CA_PEM_CHARS_MAX,
    "pattern": "-----BEGIN CERTIFICATE-----",
    "description": "PEM CA certificates; a bundle that does not parse fails the first workflow (manage) with the reason",
}));
string_schema!(/// A public key pin.
PinText, schemars::json_schema!({
    "type": "string",
    "pattern": "^sha256/[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$",
    "description": "sha256/ and the base64 of the SHA-256 of the certificate's DER SubjectPublicKeyInfo",
}));
string_schema!(/// `on`, `off` or `reboot`.
PowerText, schemars::json_schema!({ "type": "string", "enum": ["on", "off", "reboot"] }));
string_schema!(/// A lifecycle state.
MetalStateText, schemars::json_schema!({
    "type": "string",
    "enum": bc_projections::metal::STATES.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
}));

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalEnroll {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    #[schemars(with = "NameText")]
    name: String,
    /// The BMC's Redfish origin, `https://host[:port]`.
    #[schemars(with = "HttpsUrlText")]
    bmc_address: String,
    /// The ComputerSystem's path (`/redfish/v1/Systems/…`); absent: the BMC's only system.
    #[serde(default)]
    #[schemars(with = "Option<SystemPathText>")]
    bmc_system_path: Option<String>,
    #[schemars(with = "BmcUsernameText")]
    bmc_username: String,
    /// Sealed in the secret store; never in an event, a log or an answer.
    #[schemars(with = "BmcPasswordText")]
    bmc_password: String,
    /// How the BMC's certificate is checked.
    bmc_tls: BmcTlsInput,
    /// The site the machine is at, a site of the tenant (`sites.*`); absent, its pool's, if the
    /// pool names one (a site other than the pool's is `INVALID_STATE`).
    #[schemars(with = "Option<crate::api::validate::SiteIdText>")]
    site_id: Option<String>,
}

/// How the BMC's certificate is checked: against CA certificates, by its key's pin, or (only
/// when asked in so many words) not at all, which `metal get` says.
#[derive(Deserialize, JsonSchema)]
#[serde(tag = "mode", rename_all = "camelCase", rename_all_fields = "camelCase", deny_unknown_fields)]
pub enum BmcTlsInput {
    /// The chain must lead to one of these CA certificates (PEM), for the address's host name.
    Ca {
        #[schemars(with = "CaPemText")]
        ca_pem: String,
    },
    /// The leaf's public key must be this one: `sha256/` + base64 of the SHA-256 of its
    /// SubjectPublicKeyInfo.
    Pin {
        #[schemars(with = "PinText")]
        pin: String,
    },
    /// Not checked: anyone on the path can read the BMC's password.
    Insecure {},
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineVerb {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    /// Act only while the machine is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalDeploy {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    /// A registered image (its URL is what the BMC's virtual CD boots).
    #[schemars(with = "ImageIdText")]
    image_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalRescue {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    /// The rescue system's image.
    #[schemars(with = "ImageIdText")]
    image_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalPower {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "PowerText")]
    power: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

/// One verb on several machines, each decided and appended on its own, in order.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalBulkNow {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// `undeploy`, `retire` or `powerOff`; `deploy` only goes through a batch (`metal bulk`),
    /// which mints each installed system's join token.
    #[schemars(with = "BulkVerbText")]
    verb: String,
    #[schemars(with = "Vec<NodeIdText>", length(min = 1, max = METAL_BULK_NOW_MACHINES_MAX))]
    node_ids: Vec<String>,
}

/// What `metal.bulkNow` did to each machine: the machine, or why it was refused.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalBulkNowView {
    pub items: Vec<MetalBulkNowItem>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalBulkNowItem {
    pub node_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine: Option<MetalView>,
    /// The refusal's code (`INVALID_STATE`, `NOT_FOUND`, …) and message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Only the machines of this pool (a filtered page can come back short).
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    /// Only the machines in this state.
    #[schemars(with = "Option<MetalStateText>")]
    state: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkflowsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkflowRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WorkflowIdText")]
    workflow_id: String,
}

/// A deploy's answer: the machine, and once, the join token its installed system joins with.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalDeployView {
    pub machine: MetalView,
    /// `bcjt_…`: shown once (absent on a replay); give it to the installed system's
    /// `bcd join --node-id`. It joins only as this node, once, until the deploy's deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_token: Option<String>,
    pub replayed: bool,
}

/// Where a machine's BMC password is sealed.
pub fn bmc_secret_id(node_id: &str) -> String {
    format!("bmc_{node_id}")
}

/// The pin format: `sha256/` and the base64 of 32 bytes (`bc_pin::check_pin`, what the Redfish
/// client checks it with).
fn check_pin(pin: &str) -> Result<()> {
    if bc_pin::check_pin(pin).is_err() {
        return Err(Error::InvalidArgument {
            message: "bmcPin must be sha256/ followed by the base64 of a 32-byte SHA-256".into(),
            hint: Some("the SHA-256 of the BMC certificate's DER SubjectPublicKeyInfo, base64".into()),
        });
    }
    Ok(())
}

/// A ComputerSystem path as [`SYSTEM_PATH_PATTERN`] says.
fn system_path_ok(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/redfish/v1/Systems/") else { return false };
    path.chars().count() <= BMC_SYSTEM_PATH_CHARS_MAX
        && rest.split('/').all(|segment| {
            !segment.is_empty()
                && !segment.starts_with('.')
                && !segment.ends_with('.')
                && !segment.contains("..")
                && segment.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '~' | '-' | '.'))
        })
}

/// A BMC as enrolled: its origin, and how its certificate is checked.
struct CheckedBmc {
    address: String,
    tls: &'static str,
    ca_pem: Option<String>,
    pin: Option<String>,
}

fn check_bmc(input: &MetalEnroll, networks: &bc_bmc::BmcNetworks) -> Result<CheckedBmc> {
    if input.bmc_address.chars().count() > BMC_ADDRESS_CHARS_MAX {
        return Err(Error::invalid(format!("bmcAddress is longer than {BMC_ADDRESS_CHARS_MAX} characters")));
    }
    static ADDRESS: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(&bmc_address_pattern()).expect("the address pattern"));
    if !ADDRESS.is_match(&input.bmc_address) {
        return Err(Error::InvalidArgument {
            message: "bmcAddress must be https://host[:port]: a host name or an IPv4 address, and nothing after the port".into(),
            hint: Some("https:// only: the BMC's password never crosses a network in clear text".into()),
        });
    }
    let url = url::Url::parse(&input.bmc_address).map_err(|e| Error::invalid(format!("bmcAddress is not a URL: {e}")))?;
    if url.scheme() != "https" {
        return Err(Error::InvalidArgument {
            message: "bmcAddress must be https://: the BMC's password never crosses a network in clear text".into(),
            hint: None,
        });
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Error::invalid("bmcAddress must not carry a user or password; pass bmcUsername and bmcPassword"));
    }
    if url.host_str().is_none_or(str::is_empty) || url.query().is_some() || url.fragment().is_some() || url.path() != "/" {
        return Err(Error::invalid("bmcAddress must be an origin, https://host[:port], with no path, query or fragment"));
    }
    // An address literal (and `localhost`) outside the deployment's BMC networks is refused
    // here; a name is checked, address by address, each time the reconciler connects. Refused as
    // ACCESS_DENIED (403), not INVALID_ARGUMENT: the address is well formed, and this deployment's
    // policy, not the request, is what stands in the way.
    if let Some(host) = url.host()
        && networks.check_host(&host).is_err()
    {
        return Err(Error::AccessDenied(
            "bmcAddress is not on a network this deployment reaches BMCs on (the operator names the BMC networks with \
             --bmc-allow-network CIDR on dev, serve and reconcile; loopback, link-local and the control plane's own \
             addresses are taken only when named exactly)"
                .into(),
        ));
    }
    if let Some(path) = &input.bmc_system_path
        && !system_path_ok(path)
    {
        return Err(Error::invalid(format!(
            "bmcSystemPath must be /redfish/v1/Systems/ and segments of letters, digits, _ ~ - and single inner dots, at most {BMC_SYSTEM_PATH_CHARS_MAX} characters"
        )));
    }
    validate_text("bmcUsername", &input.bmc_username, BMC_USERNAME_CHARS_MAX)?;
    if input.bmc_username.is_empty() {
        return Err(Error::invalid("bmcUsername must not be empty"));
    }
    let chars = input.bmc_password.chars().count();
    if chars == 0 || chars > BMC_PASSWORD_CHARS_MAX {
        return Err(Error::invalid(format!("bmcPassword must be 1 to {BMC_PASSWORD_CHARS_MAX} characters")));
    }
    let (tls, ca_pem, pin) = match &input.bmc_tls {
        BmcTlsInput::Ca { ca_pem } => {
            if ca_pem.chars().count() > BMC_CA_PEM_CHARS_MAX {
                return Err(Error::invalid(format!("bmcTls.caPem is longer than {BMC_CA_PEM_CHARS_MAX} characters")));
            }
            if !ca_pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::invalid("bmcTls.caPem holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
            }
            ("ca", Some(ca_pem.clone()), None)
        }
        BmcTlsInput::Pin { pin } => {
            check_pin(pin)?;
            ("pin", None, Some(pin.clone()))
        }
        BmcTlsInput::Insecure {} => ("insecure", None, None),
    };
    Ok(CheckedBmc { address: url.origin().ascii_serialization(), tls, ca_pem, pin })
}

/// How many machines the tenant has (enrollment is rare; this reads their keys page by page).
async fn machines_count(call: &Call<'_>, tenant: TenantId) -> Result<usize> {
    const PAGE: u32 = 500;
    let (mut count, mut after) = (0usize, None::<String>);
    loop {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_METAL, after.as_deref(), PAGE).await?;
        count += rows.len();
        if rows.len() < PAGE as usize || count >= MACHINES_PER_TENANT_MAX {
            return Ok(count);
        }
        after = rows.last().map(|r| r.key.id.clone());
    }
}

async fn machine_doc(call: &Call<'_>, tenant: TenantId, node_id: &str) -> Result<MetalDoc> {
    let id: NodeId = parse_id("nodeId", node_id)?;
    call.row(tenant, KIND_METAL, &id.to_string(), "machine").await
}

async fn metal_enroll(call: &Call<'_>, input: MetalEnroll) -> Result<MetalView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    let checked = check_bmc(&input, &call.state.bmc_networks)?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    let pool: PoolDoc = call.row(tenant, KIND_POOL, &pool_id.to_string(), "pool").await?;
    if pool.archived {
        return Err(Error::state(
            format!("pool {pool_id} is archived: no machine is enrolled into it"),
            decide::ARCHIVED_POOL_HINT,
        ));
    }
    let asked_site: Option<bc_core::id::SiteId> = input.site_id.as_deref().map(|s| parse_id("siteId", s)).transpose()?;
    let asked_site = asked_site.map(|s| s.to_string());
    let site_id = decide::site::machine_site(&pool.pool_id, pool.site_id.as_deref(), asked_site.as_deref())?;
    // A machine at a site guards the site's version (a site deleted meanwhile is a CONFLICT),
    // under the names' lock `sites.delete` takes while it looks for referrers.
    let _names = match site_id {
        Some(_) => Some(call.state.name_locks.lock(tenant).await),
        None => None,
    };
    let mut guards = vec![(stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version))];
    if let Some(site_id) = &site_id {
        let site = super::sites::site_doc(call, tenant, &parse_id("siteId", site_id)?).await?;
        guards.push((stream_of(bc_projections::site::KIND_SITE, site_id), ExpectedVersion::Exact(site.version)));
    }
    let retry = call.is_retry(tenant).await?;
    if !retry && machines_count(call, tenant).await? >= MACHINES_PER_TENANT_MAX {
        return Err(Error::state(
            format!("the tenant has {MACHINES_PER_TENANT_MAX} machines, its limit"),
            "retired machines count too: enroll more machines under another tenant",
        ));
    }
    let node = NodeId::from_ulid(call.ulid()).to_string();
    let secret_id = bmc_secret_id(&node);
    let enrolled = ev::MetalEnrolled {
        pool_id: pool_id.to_string(),
        name: input.name,
        bmc: MetalBmc {
            address: checked.address,
            system_path: input.bmc_system_path,
            username: input.bmc_username,
            tls: checked.tls.to_owned(),
            ca_pem: checked.ca_pem,
            pin: checked.pin,
            secret_id: secret_id.clone(),
        },
        site_id,
    };
    // The password is sealed first, under the new machine's id: an append that fails leaves a
    // sealed secret no machine names, never a machine without its password. A retry stores
    // nothing (its machine has its password).
    if !retry {
        call.state.store.secret_put(tenant, &secret_id, &input.bmc_password, call.now_ms()).await?;
    }
    let result = call
        .append_guarded(
            tenant,
            stream_of(KIND_METAL, &node),
            ExpectedVersion::NoStream,
            ev::METAL_ENROLLED,
            ev::to_cbor(&enrolled)?,
            guards,
        )
        .await?;
    let node = stream_id(&result.events[0].envelope.stream).to_owned();
    tracing::info!(%tenant, node = %node, "a machine was enrolled");
    Ok(machine_doc(call, tenant, &node).await?.into())
}

async fn metal_get(call: &Call<'_>, input: MachineRef) -> Result<MetalView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(machine_doc(call, tenant, &input.node_id).await?.into())
}

async fn metal_list(call: &Call<'_>, input: MetalList) -> Result<Page<MetalView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
    let state = match input.state.as_deref() {
        None => None,
        Some(text) => Some(bc_projections::metal::STATES.iter().copied().find(|s| s.as_str() == text).ok_or_else(|| {
            Error::invalid(format!(
                "state {:?} is not a machine state ({})",
                bc_core::id::truncate(text, 32),
                bc_projections::metal::STATES.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?),
    };
    list_rows(call, tenant, KIND_METAL, input.limit, input.cursor.as_deref(), |row| {
        let machine: MetalDoc = doc(row)?;
        let keep = pool.as_ref().is_none_or(|p| *p == machine.pool_id) && state.is_none_or(|s| s == machine.state);
        Ok(keep.then(|| machine.into()))
    })
    .await
}

/// A verb on a machine: decided on its document, appended at its version.
async fn verb(call: &Call<'_>, tenant: TenantId, doc: &MetalDoc, verb: Verb, input: VerbInput<'_>) -> Result<MetalView> {
    let decided = decide::metal_verb(doc, verb, &input)?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(machine_doc(call, tenant, &doc.node_id).await?.into())
}

fn workflow_id(call: &Call<'_>) -> String {
    WorkflowId::from_ulid(call.ulid()).to_string()
}

async fn simple(call: &Call<'_>, input: MachineVerb, v: Verb) -> Result<MetalView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc = machine_doc(call, tenant, &input.node_id).await?;
    let wf = workflow_id(call);
    verb(
        call,
        tenant,
        &doc,
        v,
        VerbInput { now_ms: call.now_ms(), workflow_id: &wf, if_version: input.if_version, ..Default::default() },
    )
    .await
}

/// The handlers of the verbs that name a machine and nothing else, each over [`simple`].
macro_rules! simple_verbs {
    ($($handler:ident => $verb:ident),* $(,)?) => {
        $(
            async fn $handler(call: &Call<'_>, input: MachineVerb) -> Result<MetalView> {
                simple(call, input, Verb::$verb).await
            }
        )*
    };
}

simple_verbs!(
    metal_manage => Manage,
    metal_inspect => Inspect,
    metal_provide => Provide,
    metal_unrescue => Unrescue,
    metal_retire => Retire,
    metal_recover => Recover,
    metal_abort => Abort,
);

/// Undeploy: refused while the node holds reservations (drain it first); the node is cordoned
/// in the same append, so nothing is placed on a machine being torn down.
async fn metal_undeploy(call: &Call<'_>, input: MachineVerb) -> Result<MetalView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc = machine_doc(call, tenant, &input.node_id).await?;
    let wf = workflow_id(call);
    let mut decided = decide::metal_verb(
        &doc,
        Verb::Undeploy,
        &VerbInput { now_ms: call.now_ms(), workflow_id: &wf, if_version: input.if_version, ..Default::default() },
    )?;
    if let Some(row) = call.state.store.row_get(&tenant.to_string(), KIND_NODE, &doc.node_id).await? {
        let node: NodeDoc = super::call::doc(row)?;
        if !node.allocations.is_empty() && !call.is_retry(tenant).await? {
            return Err(Error::InvalidState {
                message: format!(
                    "node {} holds {} GPUs of live reservations: drain it (nodes drain) and let them end before undeploying",
                    doc.node_id,
                    node.allocations.len()
                ),
                allowed: vec![],
                hint: None,
            });
        }
        let stream = stream_of(KIND_NODE, &doc.node_id);
        if !node.cordoned {
            let mut cordon = NewEvent::new(ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {})?);
            cordon.stream = Some(stream.clone());
            decided.events.push(cordon);
        }
        decided.guards.push((stream, ExpectedVersion::Exact(node.version)));
    }
    call.submit(call.decided(tenant, decided)).await?;
    Ok(machine_doc(call, tenant, &doc.node_id).await?.into())
}

/// A registered image a BMC's virtual CD can boot: an ISO.
async fn image_of(call: &Call<'_>, tenant: TenantId, image_id: &str) -> Result<ImageDoc> {
    let id: ImageId = parse_id("imageId", image_id)?;
    let image: ImageDoc = call.row(tenant, KIND_IMAGE, &id.to_string(), "image").await?;
    if image.disk_format != ev::DiskFormat::Iso {
        return Err(Error::InvalidArgument {
            message: format!("image {id} is not an ISO: a machine boots its deploy or rescue image through the BMC's virtual CD"),
            hint: Some("register the image with --disk-format iso".into()),
        });
    }
    Ok(image)
}

async fn metal_deploy(call: &Call<'_>, input: MetalDeploy) -> Result<MetalDeployView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc = machine_doc(call, tenant, &input.node_id).await?;
    let image = image_of(call, tenant, &input.image_id).await?;
    let (answer, replayed) = deploy(call, tenant, &doc, &image, input.if_version).await?;
    Ok(MetalDeployView { machine: machine_doc(call, tenant, &doc.node_id).await?.into(), join_token: answer, replayed })
}

/// A deploy (or its retry): the transition and a join token bound to the node, in one append;
/// the token's hash is stored once the append committed (a crash in between leaves a token
/// no one can use, and the deploy times out with that reason).
async fn deploy(
    call: &Call<'_>,
    tenant: TenantId,
    doc: &MetalDoc,
    image: &ImageDoc,
    if_version: Option<u64>,
) -> Result<(Option<String>, bool)> {
    let wf = workflow_id(call);
    let token_id = JoinTokenId::from_ulid(call.ulid());
    let token_text = token_id.to_string();
    let (token, secret_sha256) = bc_core::agent::join_token_new(token_id);
    let input = VerbInput {
        now_ms: call.now_ms(),
        workflow_id: &wf,
        image: Some((&image.image_id, &image.url)),
        join_token_id: Some(&token_text),
        if_version,
        ..Default::default()
    };
    let decided = decide::metal_verb(doc, Verb::Deploy, &input)?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    if result.replayed {
        return Ok((None, true));
    }
    call.state.store.secret_put(tenant, &token_text, &secret_sha256, call.now_ms()).await?;
    Ok((Some(token), false))
}

async fn metal_rescue(call: &Call<'_>, input: MetalRescue) -> Result<MetalView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc = machine_doc(call, tenant, &input.node_id).await?;
    let image = image_of(call, tenant, &input.image_id).await?;
    let wf = workflow_id(call);
    let verb_input = VerbInput {
        now_ms: call.now_ms(),
        workflow_id: &wf,
        image: Some((&image.image_id, &image.url)),
        if_version: input.if_version,
        ..Default::default()
    };
    verb(call, tenant, &doc, Verb::Rescue, verb_input).await
}

async fn metal_power(call: &Call<'_>, input: MetalPower) -> Result<MetalView> {
    if !matches!(input.power.as_str(), "on" | "off" | "reboot") {
        return Err(Error::invalid(format!(
            "power must be on, off or reboot, not {:?}",
            bc_core::id::truncate(&input.power, 16)
        )));
    }
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc = machine_doc(call, tenant, &input.node_id).await?;
    let wf = workflow_id(call);
    let verb_input = VerbInput {
        now_ms: call.now_ms(),
        workflow_id: &wf,
        power: Some(&input.power),
        if_version: input.if_version,
        ..Default::default()
    };
    verb(call, tenant, &doc, Verb::Power, verb_input).await
}

/// `metal.bulkNow`: with the approvers' quorum on, more than one machine is refused
/// `BATCH_REQUIRED` before anything is read (`decide::batch::batch_required`); else each machine
/// in turn, as its own `metal.*` call would, each answer its machine or its refusal.
async fn metal_bulk_now(call: &Call<'_>, input: MetalBulkNow) -> Result<MetalBulkNowView> {
    // The tenant is checked once, at the edge: a malformed one is the request's fault, not each
    // machine's.
    call.tenant(&input.tenant_id).await?;
    let verb: &'static str = match input.verb.as_str() {
        "undeploy" => "undeploy",
        "deploy" => "deploy",
        "retire" => "retire",
        "powerOff" => "power off",
        other => {
            return Err(Error::invalid(format!(
                "verb must be undeploy, deploy, retire or powerOff, not {:?}",
                bc_core::id::truncate(other, 16)
            )));
        }
    };
    if input.node_ids.is_empty() || input.node_ids.len() > METAL_BULK_NOW_MACHINES_MAX {
        return Err(Error::invalid(format!("nodeIds names 1 to {METAL_BULK_NOW_MACHINES_MAX} machines")));
    }
    let mut nodes: Vec<String> = Vec::with_capacity(input.node_ids.len());
    for (i, node) in input.node_ids.iter().enumerate() {
        let node: NodeId = parse_id(&format!("nodeIds[{i}]"), node)?;
        if !nodes.contains(&node.to_string()) {
            nodes.push(node.to_string());
        }
    }
    decide::batch::batch_required(
        call.state.batch_quorum,
        decide::batch::DestructiveScope::Metal { verb, machines: nodes.len() },
    )?;
    if call.idempotency_key.is_some() {
        // One key would stand for every machine's append, and replay the first for the rest.
        return Err(Error::InvalidArgument {
            message: "metal.bulkNow takes no Idempotency-Key: each machine's verb is an append of its own".into(),
            hint: Some("send it again without one: a machine the first call moved is refused INVALID_STATE".into()),
        });
    }
    if verb == "deploy" {
        return Err(Error::InvalidArgument {
            message: "a deploy mints its installed system's join token, answered once: deploy machines one by one, or in a batch"
                .into(),
            hint: Some(
                "metal deploy NODE --image IMG --token-out FILE, or metal bulk --verb deploy --image IMG --token-dir DIR".into(),
            ),
        });
    }
    let mut items = Vec::with_capacity(nodes.len());
    for node_id in nodes {
        let one = MachineVerb { tenant_id: input.tenant_id.clone(), node_id: node_id.clone(), if_version: None };
        let done = match verb {
            "undeploy" => metal_undeploy(call, one).await,
            "retire" => metal_retire(call, one).await,
            _ => {
                let power = MetalPower { tenant_id: one.tenant_id, node_id: one.node_id, power: "off".into(), if_version: None };
                metal_power(call, power).await
            }
        };
        items.push(match done {
            Ok(machine) => MetalBulkNowItem { node_id, machine: Some(machine), code: None, message: None },
            Err(e @ (Error::Internal(_) | Error::Storage(_))) => return Err(e),
            Err(e) => MetalBulkNowItem {
                node_id,
                machine: None,
                code: Some(e.code().as_str().to_owned()),
                message: Some(e.public_message()),
            },
        });
    }
    Ok(MetalBulkNowView { items })
}

async fn workflow_doc(call: &Call<'_>, tenant: TenantId, workflow_id: &str) -> Result<Workflow> {
    let id: WorkflowId = parse_id("workflowId", workflow_id)?;
    call.row(tenant, KIND_WORKFLOW, &id.to_string(), "workflow").await
}

async fn workflows_list(call: &Call<'_>, input: WorkflowsList) -> Result<Page<WorkflowView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let node: NodeId = parse_id("nodeId", &input.node_id)?;
    let node = node.to_string();
    // The machine must exist: an unknown node is NOT_FOUND, not an empty list.
    machine_doc(call, tenant, &node).await?;
    list_rows(call, tenant, KIND_WORKFLOW, input.limit, input.cursor.as_deref(), |row| {
        let workflow: Workflow = doc(row)?;
        Ok((workflow.node_id == node).then(|| workflow.into()))
    })
    .await
}

async fn workflows_get(call: &Call<'_>, input: WorkflowRef) -> Result<WorkflowView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(workflow_doc(call, tenant, &input.workflow_id).await?.into())
}

/// A workflow and its machine, the workflow required to be the machine's running one.
async fn running(call: &Call<'_>, input: &WorkflowRef) -> Result<(TenantId, Workflow, MetalDoc)> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let workflow = workflow_doc(call, tenant, &input.workflow_id).await?;
    let machine = machine_doc(call, tenant, &workflow.node_id).await?;
    Ok((tenant, workflow, machine))
}

fn not_running(workflow: &Workflow) -> Error {
    Error::InvalidState {
        message: format!("workflow {} is {}, not running", workflow.workflow_id, workflow.outcome.as_str()),
        allowed: if workflow.outcome == WorkflowOutcome::Failed { vec!["retry".into()] } else { vec![] },
        hint: None,
    }
}

async fn workflows_abort(call: &Call<'_>, input: WorkflowRef) -> Result<WorkflowView> {
    let (tenant, workflow, machine) = running(call, &input).await?;
    if machine.running().is_none_or(|w| w.workflow_id != workflow.workflow_id) {
        return Err(not_running(&workflow));
    }
    let decided = decide::metal_verb(&machine, Verb::Abort, &VerbInput { now_ms: call.now_ms(), ..Default::default() })?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(workflow_doc(call, tenant, &input.workflow_id).await?.into())
}

async fn pause(call: &Call<'_>, input: WorkflowRef, paused: bool) -> Result<WorkflowView> {
    let (tenant, workflow, machine) = running(call, &input).await?;
    if machine.running().is_none_or(|w| w.workflow_id != workflow.workflow_id) {
        return Err(not_running(&workflow));
    }
    if let Some(decided) = decide::metal_pause(&machine, &workflow.workflow_id, paused)? {
        call.submit(call.decided(tenant, decided)).await?;
    }
    Ok(workflow_doc(call, tenant, &input.workflow_id).await?.into())
}

async fn workflows_pause(call: &Call<'_>, input: WorkflowRef) -> Result<WorkflowView> {
    pause(call, input, true).await
}

async fn workflows_resume(call: &Call<'_>, input: WorkflowRef) -> Result<WorkflowView> {
    pause(call, input, false).await
}

/// Retry: a running workflow's backing-off step runs now (as a resume does); a failed
/// workflow's verb runs again from where the failure left the machine, with the same image.
/// The answer is the workflow that now runs.
async fn workflows_retry(call: &Call<'_>, input: WorkflowRef) -> Result<WorkflowView> {
    let (tenant, workflow, machine) = running(call, &input).await?;
    match decide::workflow_retry(&machine, &workflow, call.now_ms(), &mut || workflow_id(call))? {
        WorkflowRetry::RunNow(decided) => {
            call.submit(call.decided(tenant, decided)).await?;
            Ok(workflow_doc(call, tenant, &input.workflow_id).await?.into())
        }
        WorkflowRetry::Again(decided) => {
            call.submit(call.decided(tenant, decided)).await?;
            // The machine's workflow now (a replayed retry names the one its first call started).
            let machine = machine_doc(call, tenant, &machine.node_id).await?;
            let now = machine.workflow.ok_or_else(|| Error::Internal("a retried workflow is not on its machine".into()))?;
            Ok(now.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enroll(address: &str) -> MetalEnroll {
        serde_json::from_value(serde_json::json!({
            "poolId": "pool_x", "name": "m1", "bmcAddress": address, "bmcUsername": "admin", "bmcPassword": "p",
            "bmcTls": { "mode": "insecure" },
        }))
        .unwrap()
    }

    /// A BMC address on loopback (or the control plane's own, or link-local) is
    /// refused at enrollment unless the operator named it exactly; a name is taken here and
    /// checked, address by address, when the reconciler connects.
    #[test]
    fn a_bmc_address_outside_the_bmc_networks_is_refused_at_enrollment() {
        let none = bc_bmc::BmcNetworks::default();
        for address in ["https://127.0.0.1:8443", "https://localhost", "https://169.254.169.254", "https://10.0.0.7"] {
            let refused = check_bmc(&enroll(address), &none).err().unwrap_or_else(|| panic!("{address} taken"));
            assert!(refused.to_string().contains("not on a network this deployment reaches BMCs on"), "{address}: {refused}");
        }
        assert!(check_bmc(&enroll("https://bmc-1.mgmt.example"), &none).is_ok(), "a name is checked at connect time");
        let named = bc_bmc::BmcNetworks::parse(&["10.0.0.0/8", "127.0.0.1/32"]).unwrap();
        for address in ["https://127.0.0.1:8443", "https://10.0.0.7"] {
            assert!(check_bmc(&enroll(address), &named).is_ok(), "{address}");
        }
        assert!(check_bmc(&enroll("https://169.254.169.254"), &named).is_err());
    }

    /// The schema's patterns say what the checks do: an address the pattern takes is an origin
    /// the URL parser takes, and a system path the pattern takes is one `system_path_ok` takes.
    #[test]
    fn the_patterns_agree_with_the_checks() {
        let address = regex::Regex::new(&bmc_address_pattern()).unwrap();
        for text in [
            "https://bmc",
            "https://bmc-1.rack.example:8443",
            "https://10.0.0.7",
            "https://10.0.0.7:443/",
            "https://a1.b",
            "https://x.0a",
            "http://bmc",
            "https://bmc:0",
            "https://bmc:65536",
            "https://1.2.3.4.5",
            "https://256.1.1.1",
            "https://xn--abc.example",
            "https://a_b",
            "https://bmc/redfish",
            "https://user@bmc",
            "https://[::1]",
        ] {
            let taken = address.is_match(text);
            let parsed =
                url::Url::parse(text).ok().filter(|u| u.scheme() == "https" && u.path() == "/" && u.username().is_empty());
            if taken {
                assert!(parsed.is_some(), "{text}: the pattern takes what the parser refuses");
            }
        }
        let path = regex::Regex::new(SYSTEM_PATH_PATTERN).unwrap();
        for text in [
            "/redfish/v1/Systems/1",
            "/redfish/v1/Systems/System.Embedded.1",
            "/redfish/v1/Systems/a/b",
            "/redfish/v1/Systems/",
            "/redfish/v1/Systems/../x",
            "/redfish/v1/Systems/.a",
            "/redfish/v1/Systems/a..b",
            "/redfish/v1/Systems/a b",
            "/redfish/v1/Managers/1",
        ] {
            assert_eq!(path.is_match(text), system_path_ok(text), "{text}");
        }
    }
}
