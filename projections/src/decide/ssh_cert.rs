//! Break-glass SSH: the decision of `nodes.issueSshCert`. What a certificate will say (its one
//! principal, its validity, its key id and serial) is decided here from the node as read and
//! the call's input, with the time and the serial drawn by the caller from the `Log`'s clock
//! and ids; the gateway signs exactly what the appended `node.ssh_cert_issued` records.
//!
//! Invariants: a certificate names one principal, `bc-node:<node>:<account>`, which only the
//! principals file `bcd` writes for that account on that node lists; it is valid from one
//! minute before the decision (clock skew) to at most [`SSH_CERT_MINUTES_MAX`] after it; the
//! event holds the subject key's fingerprint, never a key.

use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use serde::{Deserialize, Serialize};

use super::Append;
use crate::{KIND_NODE, NodeDoc, stream_of};

/// A certificate was signed for a node (on the node's stream).
pub const NODE_SSH_CERT_ISSUED: &str = "node.ssh_cert_issued";
/// The longest validity a certificate is given, in minutes.
pub const SSH_CERT_MINUTES_MAX: u32 = 60;
/// The validity when the caller names none, in minutes.
pub const SSH_CERT_MINUTES_DEFAULT: u32 = 15;
/// How long before the decision a certificate is already valid, for the node's clock skew.
pub const SSH_CERT_BACKDATE_S: u64 = 60;
/// The longest Unix account name, as `useradd` allows by default.
pub const UNIX_ACCOUNT_CHARS_MAX: usize = 32;
/// The prefix of a certificate's principal; what follows is the node and the account.
pub const SSH_PRINCIPAL_PREFIX: &str = "bc-node:";

/// `node.ssh_cert_issued`: who was given root-capable access to which node, as what account,
/// when and for how long. Who asked is the event's actor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeSshCertIssued {
    pub account: String,
    pub principal: String,
    pub serial: u64,
    pub key_id: String,
    /// Unix seconds, as the certificate says them.
    pub valid_after_s: u64,
    pub valid_before_s: u64,
    /// The certified key's `SHA256:…` fingerprint and algorithm (`ssh-ed25519`, …).
    pub public_key_fingerprint: String,
    pub public_key_algorithm: String,
    /// The CA that signs it, `SHA256:…`.
    pub ca_fingerprint: String,
    pub request_id: String,
}

/// What the caller read and drew for one certificate.
#[derive(Clone, Debug)]
pub struct SshCertInput<'a> {
    pub account: &'a str,
    pub minutes: u32,
    /// The calling key, as the event's actor names it (`apikey:key_…`).
    pub caller: &'a str,
    pub request_id: &'a str,
    pub public_key_fingerprint: String,
    pub public_key_algorithm: String,
    pub ca_fingerprint: String,
    /// From the `Log`'s ids.
    pub serial: u64,
    /// From the `Log`'s clock.
    pub now_ms: u64,
}

/// The principal a node's principals file lists for `account`, and no other node's does.
pub fn ssh_principal(node_id: &str, account: &str) -> String {
    format!("{SSH_PRINCIPAL_PREFIX}{node_id}:{account}")
}

/// Whether `account` is a Unix account name: `[a-z_][a-z0-9_-]{0,31}`.
pub fn is_unix_account(account: &str) -> bool {
    let mut chars = account.chars();
    account.len() <= UNIX_ACCOUNT_CHARS_MAX
        && chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// Checks a requested account and validity.
pub fn ssh_cert_check(account: &str, minutes: u32) -> Result<()> {
    if !is_unix_account(account) {
        return Err(Error::InvalidArgument {
            message: format!("account {:?} is not a Unix account name", bc_core::id::truncate(account, 40)),
            hint: Some(format!("1 to {UNIX_ACCOUNT_CHARS_MAX} of a-z 0-9 _ -, starting with a letter or _ (root, ubuntu)")),
        });
    }
    if !(1..=SSH_CERT_MINUTES_MAX).contains(&minutes) {
        return Err(Error::invalid(format!("minutes must be 1 to {SSH_CERT_MINUTES_MAX}, not {minutes}")));
    }
    Ok(())
}

/// Decides one certificate for `node`: the node must have an agent (a certificate works only
/// where `bcd` installed the CA); an unreachable node is served, since break-glass is for when
/// the agent cannot help. Appends at the node's version as read.
pub fn ssh_cert_issue(node: &NodeDoc, input: SshCertInput<'_>) -> Result<(Append, NodeSshCertIssued)> {
    ssh_cert_check(input.account, input.minutes)?;
    if node.agent.is_none() {
        return Err(Error::state(
            format!("node {} has no agent: no sshd there trusts the deployment's SSH CA", node.node_id),
            "break-glass SSH works on nodes that joined with bcd and have [ssh] in its config.toml",
        ));
    }
    let now_s = input.now_ms / 1000;
    let issued = NodeSshCertIssued {
        account: input.account.to_owned(),
        principal: ssh_principal(&node.node_id, input.account),
        serial: input.serial,
        key_id: format!("caller={} node={} request={}", input.caller, node.node_id, input.request_id),
        valid_after_s: now_s.saturating_sub(SSH_CERT_BACKDATE_S),
        valid_before_s: now_s + u64::from(input.minutes) * 60,
        public_key_fingerprint: input.public_key_fingerprint,
        public_key_algorithm: input.public_key_algorithm,
        ca_fingerprint: input.ca_fingerprint,
        request_id: input.request_id.to_owned(),
    };
    let payload = crate::events::to_cbor(&issued)?;
    let append = Append {
        stream: stream_of(KIND_NODE, &node.node_id),
        expected: ExpectedVersion::Exact(node.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(NODE_SSH_CERT_ISSUED, payload)],
    };
    Ok((append, issued))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(agent: bool) -> NodeDoc {
        let mut doc: NodeDoc = serde_json::from_value(serde_json::json!({
            "tenantId": "ten_01", "nodeId": "node_01", "poolId": "pool_01", "name": "n1", "gpus": [],
            "labels": {}, "state": "ready", "version": 4, "createdAtMs": 0, "updatedAtMs": 0,
        }))
        .unwrap();
        if agent {
            doc.agent = Some(
                serde_json::from_value(serde_json::json!({
                    "publicKey": "", "agentVersion": "0", "hostname": "h", "joinTokenId": "jt_01", "joinedAtMs": 0,
                    "reachable": false, "leaseExpiresAtMs": 0, "journalSeq": 0, "journalHash": "",
                }))
                .unwrap(),
            );
        }
        doc
    }

    fn input(account: &str, minutes: u32) -> SshCertInput<'_> {
        SshCertInput {
            account,
            minutes,
            caller: "apikey:key_01",
            request_id: "req_01",
            public_key_fingerprint: "SHA256:abc".into(),
            public_key_algorithm: "ssh-ed25519".into(),
            ca_fingerprint: "SHA256:ca".into(),
            serial: 77,
            now_ms: 1_000_000_500,
        }
    }

    #[test]
    fn a_certificate_is_bound_to_the_node_and_account_for_the_minutes_asked() {
        let (append, issued) = ssh_cert_issue(&node(true), input("root", 15)).unwrap();
        assert_eq!(append.stream, "node/node_01");
        assert_eq!(append.expected, ExpectedVersion::Exact(4));
        assert_eq!(append.event_types(), [NODE_SSH_CERT_ISSUED]);
        assert_eq!(issued.principal, "bc-node:node_01:root");
        assert_eq!(issued.valid_after_s, 1_000_000 - 60);
        assert_eq!(issued.valid_before_s, 1_000_000 + 15 * 60);
        assert_eq!(issued.key_id, "caller=apikey:key_01 node=node_01 request=req_01");
        assert_eq!(issued.serial, 77);
    }

    #[test]
    fn accounts_and_minutes_out_of_bounds_are_refused() {
        for bad in ["", "Root", "9lives", "-x", "a b", "root;", &"a".repeat(33), "ro\u{f6}t"] {
            assert!(ssh_cert_issue(&node(true), input(bad, 15)).is_err(), "{bad:?}");
        }
        for good in ["root", "_svc", "deploy-1", &"a".repeat(32)] {
            assert!(is_unix_account(good), "{good:?}");
        }
        for minutes in [0, 61, u32::MAX] {
            let e = ssh_cert_issue(&node(true), input("root", minutes)).unwrap_err();
            assert!(e.to_string().contains("1 to 60"), "{e}");
        }
        assert!(ssh_cert_issue(&node(true), input("root", 60)).is_ok());
        assert!(ssh_cert_issue(&node(true), input("root", 1)).is_ok());
    }

    #[test]
    fn a_node_without_an_agent_gets_no_certificate() {
        let e = ssh_cert_issue(&node(false), input("root", 15)).unwrap_err();
        assert!(e.to_string().contains("has no agent"), "{e}");
    }
}
