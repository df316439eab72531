//! Break-glass SSH: the decisions of `nodes.issueSshCert` and of the CA's rotation
//! (`pki rotate-ssh-ca`). What a certificate will say (its one principal, its validity, its key
//! id and serial) is decided here from the node as read and the call's input, with the time and
//! the serial drawn by the caller from the `Log`'s clock and ids; the gateway signs exactly what
//! the appended `node.ssh_cert_issued` records. Which CA keys a node trusts is [`SshCaState`],
//! folded from the `ssh_ca.rotated` events of the root tenant's `ssh_ca/…` stream alone.
//!
//! Invariants: a certificate names one principal, `bc-node:<node>:<account>`, which only the
//! principals file `bcd` writes for that account on that node lists; its window
//! (`validBefore - validAfter`) is exactly the minutes asked, at most [`SSH_CERT_MINUTES_MAX`],
//! and starts at most [`SSH_CERT_BACKDATE_S`] (and at most a quarter of the window) before the
//! decision, for clock skew; the event holds the subject key's fingerprint, never a key. A
//! rotation makes the new CA current at once and keeps the one it replaces trusted until its
//! grace ends (at most [`SSH_CA_GRACE_MS_MAX`]); never more than [`SSH_CA_TRUSTED_MAX`] keys are
//! trusted at once.

use bc_core::id::TenantId;
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
/// How long before the decision a certificate is already valid, at most, for the node's clock
/// skew.
pub const SSH_CERT_BACKDATE_S: u64 = 60;
/// The backdate is at most this fraction (1/N) of the window, so a one-minute certificate is
/// still mostly ahead of the decision (45 s of it).
pub const SSH_CERT_BACKDATE_WINDOW_DIVISOR: u64 = 4;
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

/// A certificate's validity for `minutes` decided at `now_s` (Unix seconds): `(validAfter,
/// validBefore)`, a window of exactly `minutes` (so never more than asked, nor more than
/// [`SSH_CERT_MINUTES_MAX`] once [`ssh_cert_check`] passed) that starts a little before `now_s`
/// for clock skew: [`SSH_CERT_BACKDATE_S`], or a quarter of the window if that is less.
pub fn ssh_cert_validity(now_s: u64, minutes: u32) -> (u64, u64) {
    let window_s = u64::from(minutes) * 60;
    let backdate_s = SSH_CERT_BACKDATE_S.min(window_s / SSH_CERT_BACKDATE_WINDOW_DIVISOR);
    let valid_after_s = now_s.saturating_sub(backdate_s);
    (valid_after_s, valid_after_s + window_s)
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
    let (valid_after_s, valid_before_s) = ssh_cert_validity(input.now_ms / 1000, input.minutes);
    let issued = NodeSshCertIssued {
        account: input.account.to_owned(),
        principal: ssh_principal(&node.node_id, input.account),
        serial: input.serial,
        key_id: format!("caller={} node={} request={}", input.caller, node.node_id, input.request_id),
        valid_after_s,
        valid_before_s,
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

/// The deployment's SSH user CA was replaced (root tenant, stream [`ssh_ca_stream`]).
pub const SSH_CA_ROTATED: &str = "ssh_ca.rotated";
/// The kind of the CA's stream, `ssh_ca/<root tenant>`: events only, no document.
pub const KIND_SSH_CA: &str = "ssh_ca";
/// How long a replaced CA stays trusted when the operator names no grace: a day, so every
/// certificate it signed (an hour at most) ends long before, and a node that was away for a
/// night still learns the new key before the old one goes.
pub const SSH_CA_GRACE_MS_DEFAULT: u64 = 24 * 3600 * 1000;
/// The longest grace a rotation gives.
pub const SSH_CA_GRACE_MS_MAX: u64 = 7 * 24 * 3600 * 1000;
/// The most CA keys trusted at once, the current one and those in their grace (the agent's
/// `SSH_CA_KEYS_MAX`, which refuses more).
pub const SSH_CA_TRUSTED_MAX: usize = 4;
const _: () = assert!(SSH_CA_GRACE_MS_DEFAULT <= SSH_CA_GRACE_MS_MAX);
const _: () = assert!(SSH_CA_GRACE_MS_DEFAULT > SSH_CERT_MINUTES_MAX as u64 * 60_000);

/// The stream of the deployment's CA: `ssh_ca/<root tenant>`.
pub fn ssh_ca_stream() -> String {
    stream_of(KIND_SSH_CA, &TenantId::ROOT)
}

/// `ssh_ca.rotated`: a new CA signs every certificate from now on; the one it replaces is still
/// trusted until `graceEndsAtMs`. Public keys only: the private half of each is a sealed secret.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SshCaRotated {
    /// The new CA's generation; the CA made at the first start is 1. It names the sealed secret
    /// that holds the new CA's key.
    pub generation: u32,
    /// The new CA's OpenSSH public key line, and its `SHA256:…` fingerprint.
    pub public_key: String,
    pub fingerprint: String,
    /// The CA it replaces.
    pub previous_public_key: String,
    pub previous_fingerprint: String,
    /// Unix ms until which the previous CA is still trusted (`rotatedAtMs`: not at all).
    pub grace_ends_at_ms: u64,
    pub rotated_at_ms: u64,
}

/// A CA that is no longer current and still trusted until its grace ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshCaInGrace {
    pub public_key: String,
    pub fingerprint: String,
    pub grace_ends_at_ms: u64,
}

/// The current CA as the log names it (after a rotation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshCaCurrent {
    pub generation: u32,
    pub public_key: String,
    pub fingerprint: String,
}

/// One key a node trusts now: its OpenSSH line, and the Unix ms its trust ends (`None`: the
/// current CA, no end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustedCaKey {
    pub public_key: String,
    pub until_ms: Option<u64>,
}

/// The deployment's CA as the `ssh_ca/…` stream says, folded from its `ssh_ca.rotated` events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SshCaState {
    /// The stream's version: what a rotation appends at.
    pub version: u64,
    /// `None` before the first rotation: the CA made at the first start (generation 1), whose
    /// public key only its sealed secret holds.
    pub current: Option<SshCaCurrent>,
    /// The CAs replaced whose grace had not ended at the last rotation, oldest first.
    pub in_grace: Vec<SshCaInGrace>,
}

impl SshCaState {
    /// The current CA's generation (1 before any rotation).
    pub fn generation(&self) -> u32 {
        self.current.as_ref().map_or(1, |c| c.generation)
    }

    /// Folds the stream's event at `version`, an `ssh_ca.rotated`. A rotation that does not
    /// follow the current CA (its generation, the key it replaces) is a broken log.
    pub fn apply(&mut self, version: u64, rotated: SshCaRotated) -> std::result::Result<(), String> {
        if rotated.generation != self.generation() + 1 {
            return Err(format!("{SSH_CA_ROTATED} to generation {} after {}", rotated.generation, self.generation()));
        }
        if let Some(current) = &self.current
            && current.fingerprint != rotated.previous_fingerprint
        {
            return Err(format!(
                "{SSH_CA_ROTATED} replaces {}, not the current {}",
                rotated.previous_fingerprint, current.fingerprint
            ));
        }
        self.in_grace.retain(|k| k.grace_ends_at_ms > rotated.rotated_at_ms);
        if rotated.grace_ends_at_ms > rotated.rotated_at_ms {
            self.in_grace.push(SshCaInGrace {
                public_key: rotated.previous_public_key,
                fingerprint: rotated.previous_fingerprint,
                grace_ends_at_ms: rotated.grace_ends_at_ms,
            });
        }
        self.current = Some(SshCaCurrent {
            generation: rotated.generation,
            public_key: rotated.public_key,
            fingerprint: rotated.fingerprint,
        });
        self.version = version;
        Ok(())
    }

    /// The CAs still in their grace at `now_ms`, oldest first.
    pub fn in_grace_at(&self, now_ms: u64) -> impl Iterator<Item = &SshCaInGrace> {
        self.in_grace.iter().filter(move |k| k.grace_ends_at_ms > now_ms)
    }

    /// Every key a node trusts at `now_ms`: the current CA (`current_public_key`, the line of
    /// the key that signs) first, then those still in their grace, each with its end.
    pub fn trusted_at(&self, current_public_key: &str, now_ms: u64) -> Vec<TrustedCaKey> {
        let mut keys = vec![TrustedCaKey { public_key: current_public_key.to_owned(), until_ms: None }];
        keys.extend(
            self.in_grace_at(now_ms)
                .map(|k| TrustedCaKey { public_key: k.public_key.clone(), until_ms: Some(k.grace_ends_at_ms) }),
        );
        keys
    }

    /// When the set [`Self::trusted_at`] gives next changes after `now_ms` without a new
    /// rotation: the earliest grace end still ahead.
    pub fn next_change_after(&self, now_ms: u64) -> Option<u64> {
        self.in_grace_at(now_ms).map(|k| k.grace_ends_at_ms).min()
    }
}

/// What a rotation read and made.
#[derive(Clone, Debug)]
pub struct SshCaRotateInput<'a> {
    /// The current CA as the caller loaded it (its secret), which the rotation replaces.
    pub current_public_key: &'a str,
    pub current_fingerprint: &'a str,
    /// The new CA, already stored sealed as the next generation's secret.
    pub new_public_key: &'a str,
    pub new_fingerprint: &'a str,
    pub grace_ms: u64,
    /// From the `Log`'s clock.
    pub now_ms: u64,
}

/// Decides a rotation of the deployment's CA: the new one is current at once, the one it
/// replaces is trusted for `grace_ms` more (0: not at all, for a key that leaked). Refused when
/// the grace is past [`SSH_CA_GRACE_MS_MAX`], when the caller's current CA is not the log's,
/// when the new key was ever the deployment's, or when more than [`SSH_CA_TRUSTED_MAX`] keys
/// would be trusted at once. Appends at the stream's version as read, so of two rotations at
/// once, one is refused `CONFLICT`.
pub fn ssh_ca_rotate(state: &SshCaState, input: SshCaRotateInput<'_>) -> Result<(Append, SshCaRotated)> {
    if input.grace_ms > SSH_CA_GRACE_MS_MAX {
        return Err(Error::invalid(format!(
            "the grace of the replaced SSH CA must be at most {} h, not {} ms",
            SSH_CA_GRACE_MS_MAX / 3_600_000,
            input.grace_ms
        )));
    }
    if let Some(current) = &state.current
        && current.fingerprint != input.current_fingerprint
    {
        return Err(Error::Internal(format!(
            "the SSH CA loaded ({}) is not the log's current one ({})",
            input.current_fingerprint, current.fingerprint
        )));
    }
    let ever = |fingerprint: &str| {
        fingerprint == input.current_fingerprint || state.in_grace.iter().any(|k| k.fingerprint == fingerprint)
    };
    if ever(input.new_fingerprint) {
        return Err(Error::Internal(format!("the new SSH CA {} was the deployment's before", input.new_fingerprint)));
    }
    let in_grace = state.in_grace_at(input.now_ms).count();
    let trusted = 1 + in_grace + usize::from(input.grace_ms > 0);
    if trusted > SSH_CA_TRUSTED_MAX {
        let first_end = state.next_change_after(input.now_ms).unwrap_or(input.now_ms);
        return Err(Error::state(
            format!(
                "{in_grace} replaced SSH CAs are still in their grace: a rotation now would have nodes trust {trusted} keys, more than {SSH_CA_TRUSTED_MAX}"
            ),
            format!("rotate after the first grace ends (at {first_end} ms, Unix), or with --grace 0s"),
        ));
    }
    let rotated = SshCaRotated {
        generation: state.generation() + 1,
        public_key: input.new_public_key.to_owned(),
        fingerprint: input.new_fingerprint.to_owned(),
        previous_public_key: input.current_public_key.to_owned(),
        previous_fingerprint: input.current_fingerprint.to_owned(),
        grace_ends_at_ms: input.now_ms + input.grace_ms,
        rotated_at_ms: input.now_ms,
    };
    let append = Append {
        stream: ssh_ca_stream(),
        expected: ExpectedVersion::Exact(state.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(SSH_CA_ROTATED, crate::events::to_cbor(&rotated)?)],
    };
    Ok((append, rotated))
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
        assert_eq!(issued.valid_before_s - issued.valid_after_s, 15 * 60, "the window is the minutes asked, backdate included");
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

    #[test]
    fn the_window_is_the_minutes_asked_and_never_more_than_an_hour() {
        let now_s = 1_700_000_000;
        for minutes in 1..=SSH_CERT_MINUTES_MAX {
            let (after, before) = ssh_cert_validity(now_s, minutes);
            assert_eq!(before - after, u64::from(minutes) * 60, "{minutes} min");
            assert!(before - after <= u64::from(SSH_CERT_MINUTES_MAX) * 60);
            assert!(after <= now_s && now_s - after <= SSH_CERT_BACKDATE_S, "{minutes} min: backdated at most a minute");
            assert!((before - now_s) * 4 >= (before - after) * 3, "{minutes} min: three quarters ahead");
        }
        assert_eq!(ssh_cert_validity(now_s, 60), (now_s - 60, now_s - 60 + 3600));
        assert_eq!(ssh_cert_validity(now_s, 1), (now_s - 15, now_s + 45));
        assert_eq!(ssh_cert_validity(10, 15), (0, 900), "no underflow near the epoch");
    }

    const A: &str = "ssh-ed25519 AAAAa a";
    const B: &str = "ssh-ed25519 AAAAb b";
    const C: &str = "ssh-ed25519 AAAAc c";

    fn rotate(state: &SshCaState, current: &str, new: &str, grace_ms: u64, now_ms: u64) -> Result<(Append, SshCaRotated)> {
        let fingerprint = |line: &str| format!("SHA256:{}", &line[12..17]);
        let (current_fingerprint, new_fingerprint) = (fingerprint(current), fingerprint(new));
        ssh_ca_rotate(
            state,
            SshCaRotateInput {
                current_public_key: current,
                current_fingerprint: &current_fingerprint,
                new_public_key: new,
                new_fingerprint: &new_fingerprint,
                grace_ms,
                now_ms,
            },
        )
    }

    fn lines(keys: &[TrustedCaKey]) -> Vec<(&str, Option<u64>)> {
        keys.iter().map(|k| (k.public_key.as_str(), k.until_ms)).collect()
    }

    #[test]
    fn a_rotation_makes_the_new_ca_current_and_trusts_the_old_one_until_its_grace_ends() {
        let mut state = SshCaState::default();
        assert_eq!((state.generation(), lines(&state.trusted_at(A, 0))), (1, vec![(A, None)]));
        let (append, rotated) = rotate(&state, A, B, 10_000, 1_000).unwrap();
        assert_eq!(append.stream, format!("ssh_ca/{}", TenantId::ROOT));
        assert_eq!(append.expected, ExpectedVersion::Exact(0));
        assert_eq!(append.event_types(), [SSH_CA_ROTATED]);
        assert_eq!((rotated.generation, rotated.grace_ends_at_ms, rotated.previous_public_key.as_str()), (2, 11_000, A));
        state.apply(1, rotated).unwrap();
        assert_eq!(state.generation(), 2);
        // The signing key is the new one; the old one is trusted beside it until the grace ends.
        assert_eq!(lines(&state.trusted_at(B, 1_000)), vec![(B, None), (A, Some(11_000))]);
        assert_eq!(lines(&state.trusted_at(B, 10_999)), vec![(B, None), (A, Some(11_000))]);
        assert_eq!(state.next_change_after(1_000), Some(11_000));
        assert_eq!(lines(&state.trusted_at(B, 11_000)), vec![(B, None)], "not a millisecond past its end");
        assert_eq!(state.next_change_after(11_000), None);
        // The next rotation appends after the first, and the first's grace ended: only B now.
        let (append, rotated) = rotate(&state, B, C, 0, 20_000).unwrap();
        assert_eq!(append.expected, ExpectedVersion::Exact(1));
        state.apply(2, rotated).unwrap();
        assert_eq!((state.generation(), lines(&state.trusted_at(C, 20_000))), (3, vec![(C, None)]), "no grace: B goes at once");
        assert!(state.in_grace.is_empty(), "the fold keeps no key whose grace ended");
    }

    #[test]
    fn a_rotation_is_refused_past_the_grace_maximum_or_the_keys_nodes_take() {
        let state = SshCaState::default();
        let e = rotate(&state, A, B, SSH_CA_GRACE_MS_MAX + 1, 0).unwrap_err();
        assert_eq!(e.code(), bc_core::error::ErrorCode::InvalidArgument, "{e}");
        rotate(&state, A, B, SSH_CA_GRACE_MS_MAX, 0).unwrap();
        assert!(rotate(&state, A, A, 1_000, 0).is_err(), "the current key again");
        // Three rotations in a row, each in the grace of the last: four keys, then no more.
        let keys = ["ssh-ed25519 AAAA1 1", "ssh-ed25519 AAAA2 2", "ssh-ed25519 AAAA3 3", "ssh-ed25519 AAAA4 4"];
        let mut state = SshCaState::default();
        for (i, pair) in keys.windows(2).enumerate() {
            let (_, rotated) = rotate(&state, pair[0], pair[1], 100_000, i as u64).unwrap();
            state.apply(i as u64 + 1, rotated).unwrap();
        }
        assert_eq!(state.trusted_at(keys[3], 10).len(), SSH_CA_TRUSTED_MAX);
        let e = rotate(&state, keys[3], A, 1_000, 10).unwrap_err();
        assert_eq!(e.code(), bc_core::error::ErrorCode::InvalidState, "{e}");
        assert!(e.to_string().contains("more than 4"), "{e}");
        // With no grace the replaced key is not kept, so a fifth key fits; as does waiting.
        rotate(&state, keys[3], A, 0, 10).unwrap();
        rotate(&state, keys[3], A, 1_000, 100_000).unwrap();
    }

    #[test]
    fn a_rotation_that_does_not_follow_the_current_ca_is_a_broken_log() {
        let mut state = SshCaState::default();
        let (_, rotated) = rotate(&state, A, B, 1_000, 0).unwrap();
        state.apply(1, rotated.clone()).unwrap();
        assert!(state.clone().apply(2, rotated.clone()).unwrap_err().contains("generation 2 after 2"));
        let (_, from_a) = rotate(&SshCaState::default(), A, C, 1_000, 0).unwrap();
        let skipped = SshCaRotated { generation: 3, ..from_a };
        assert!(state.apply(2, skipped).unwrap_err().contains("not the current"));
        // The caller's current CA must be the log's.
        assert_eq!(rotate(&state, C, A, 1_000, 0).unwrap_err().code(), bc_core::error::ErrorCode::Internal);
    }
}
