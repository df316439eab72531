//! `nodes.issueSshCert`: break-glass SSH. The caller sends its own OpenSSH public key (never a
//! private one: refused without being echoed); `decide::ssh_cert::ssh_cert_issue` decides the
//! certificate from the node as read, the `Log`'s clock and an id from its id source; the
//! append of `node.ssh_cert_issued` on the node's stream comes first, and the deployment's CA
//! ([`crate::ssh_ca`]; the one current in the log at the call, whichever process rotated it)
//! then signs exactly what the appended event says, so every certificate that exists is in the
//! log (an idempotent retry signs the same certificate again, while its CA is current).

use bc_core::id::NodeId;
use bc_core::{Error, Result};
use bc_projections::decide::ssh_cert::{
    NodeSshCertIssued, SSH_CERT_MINUTES_DEFAULT, SSH_CERT_MINUTES_MAX, SshCertInput, ssh_cert_check, ssh_cert_issue,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::nodes::node_doc;
use super::validate::{NodeIdText, TenantIdText, string_schema};
use super::{Access, Call, Method, method};
use crate::ssh_ca::{CertificateOrder, SSH_PUBLIC_KEY_BYTES_MAX, parse_user_public_key, public_key_fingerprint};

/// Root on a node, through sshd: apart from `compute:nodes:write`, which changes only what the
/// control plane places there.
const SSH_ROOT: Access = Access::Action("compute:nodes:ssh-root");

pub(super) const METHODS: &[Method] = &[method!(
    "nodes.issueSshCert",
    SSH_ROOT,
    "an OpenSSH user certificate for your public key that only this node's sshd accepts, for one account, 1 to 60 minutes",
    NodesIssueSshCert => SshCertView,
    nodes_issue_ssh_cert
)];

string_schema!(
    /// One OpenSSH Ed25519 or ECDSA public key line (`ssh-ed25519 AAAA… comment`); never a
    /// private key.
    SshPublicKeyText,
    schemars::json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": SSH_PUBLIC_KEY_BYTES_MAX,
        "pattern": "^(ssh-ed25519|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521) [A-Za-z0-9+/]+={0,2}( [^\\n]*)?$"
    })
);

string_schema!(
    /// A Unix account name: `[a-z_][a-z0-9_-]{0,31}`.
    UnixAccountText,
    schemars::json_schema!({ "type": "string", "pattern": "^[a-z_][a-z0-9_-]{0,31}$" })
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodesIssueSshCert {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "SshPublicKeyText")]
    public_key: String,
    /// The account to log in as; default `root`.
    #[schemars(with = "Option<UnixAccountText>")]
    account: Option<String>,
    /// How long the certificate is valid; default 15.
    #[schemars(range(min = 1, max = SSH_CERT_MINUTES_MAX))]
    minutes: Option<u32>,
}

/// A signed certificate and what it says.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SshCertView {
    /// The certificate, one OpenSSH line: write it as `KEY-cert.pub` beside the key.
    pub certificate: String,
    /// Its one principal, `bc-node:<node>:<account>`.
    pub principal: String,
    pub account: String,
    /// Unix seconds.
    pub valid_after: u64,
    pub valid_before: u64,
    pub key_id: String,
    pub serial: u64,
    /// The deployment CA's `SHA256:…` fingerprint.
    pub ca_fingerprint: String,
}

async fn nodes_issue_ssh_cert(call: &Call<'_>, input: NodesIssueSshCert) -> Result<SshCertView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let node_id: NodeId = parse_id("nodeId", &input.node_id)?;
    let account = input.account.as_deref().unwrap_or("root");
    let minutes = input.minutes.unwrap_or(SSH_CERT_MINUTES_DEFAULT);
    ssh_cert_check(account, minutes)?;
    let ring = call
        .state
        .ssh_user_ca
        .clone()
        .ok_or_else(|| Error::Unavailable("this server has no SSH user CA (dev and serve make one at start)".into()))?;
    // The CA current in the log now: a rotation by any process is taken at once.
    let ca = ring.current().await?;
    let node = node_doc(call, tenant, &node_id.to_string()).await?;
    // The key's own checks (it parses, its type, never a private key) after the node is found,
    // as what its schema cannot say.
    let subject = parse_user_public_key("publicKey", &input.public_key)?;
    // The serial is the random half of an id from the log's id source.
    let serial = (call.ulid().0 & u128::from(u64::MAX)) as u64;
    let decided = SshCertInput {
        account,
        minutes,
        caller: &call.actor(),
        request_id: &call.request_id,
        public_key_fingerprint: public_key_fingerprint(&subject),
        public_key_algorithm: subject.algorithm().as_str().to_owned(),
        ca_fingerprint: ca.fingerprint(),
        serial,
        now_ms: call.now_ms(),
    };
    let (append, _) = ssh_cert_issue(&node, decided)?;
    let appended = call.submit(call.decided(tenant, append)).await?;
    // Signed from what the log holds: on an idempotent replay, the first call's event.
    let event = appended.events.first().ok_or_else(|| Error::Internal("the append returned no event".into()))?;
    let issued: NodeSshCertIssued = serde_json::from_value(bc_core::canonical::to_json(&event.envelope.payload))
        .map_err(|e| Error::Internal(format!("node.ssh_cert_issued does not parse: {e}")))?;
    if issued.public_key_fingerprint != public_key_fingerprint(&subject) {
        return Err(Error::Internal("the appended certificate names another key".into()));
    }
    if issued.ca_fingerprint != ca.fingerprint() {
        // A replay of a call answered before a rotation: only the CA it names could sign it.
        return Err(Error::state(
            format!("this request's certificate was signed by the SSH CA {}, rotated since", issued.ca_fingerprint),
            "ask again with a new Idempotency-Key for a certificate from the current CA",
        ));
    }
    let event_id = event.envelope.id.to_string();
    let order = CertificateOrder {
        principal: &issued.principal,
        key_id: &issued.key_id,
        serial: issued.serial,
        valid_after_s: issued.valid_after_s,
        valid_before_s: issued.valid_before_s,
        event_id: &event_id,
    };
    let certificate = ca.sign(&subject, &order)?;
    let certificate = certificate.to_openssh().map_err(|e| Error::Internal(format!("encoding the certificate: {e}")))?;
    Ok(SshCertView {
        certificate,
        principal: issued.principal,
        account: issued.account,
        valid_after: issued.valid_after_s,
        valid_before: issued.valid_before_s,
        key_id: issued.key_id,
        serial: issued.serial,
        ca_fingerprint: issued.ca_fingerprint,
    })
}
