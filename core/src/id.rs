//! Typed, prefixed identifiers: `evt_` + a lowercase ULID, `pool_` + a ULID, and so on.
//!
//! An id of the wrong kind never type-checks, and a malformed one is rejected at the edge with
//! the kind it should have been, so `pool_…` where a `node_…` belongs is a clear error.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// Length of a ULID in Crockford base 32.
pub const ULID_CHARS: usize = 26;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(ulid::Ulid);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// A fresh id from the wall clock and the thread's RNG; ULIDs sort by creation time.
            /// For tests and the composition root: in the crates the simulator runs this is
            /// itself disallowed (clippy.toml), and a new id is `from_ulid(ids.ulid())`.
            #[allow(clippy::disallowed_methods)]
            pub fn generate() -> Self {
                Self(ulid::Ulid::generate())
            }

            pub fn from_ulid(ulid: ulid::Ulid) -> Self {
                Self(ulid)
            }

            pub fn ulid(&self) -> ulid::Ulid {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}_{}", $prefix, self.0.to_string().to_ascii_lowercase())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(text: &str) -> Result<Self, Error> {
                parse_prefixed(text, $prefix).map(Self)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

typed_id!(/// One event in a tenant's chain.
    EventId, "evt");
typed_id!(/// A tenant: the owner of one hash chain.
    TenantId, "ten");

impl TenantId {
    /// The root tenant, whose administrators act across tenants: the all-zero ULID, so every
    /// deployment can find it without a lookup.
    pub const ROOT: TenantId = TenantId(ulid::Ulid::nil());
}
typed_id!(/// A pool of capacity inside a tenant.
    PoolId, "pool");
typed_id!(/// A host with GPUs.
    NodeId, "node");
typed_id!(/// A GPU reservation.
    ReservationId, "rsv");
typed_id!(/// An API key; the token carries it so the server can find the key's hash.
    ApiKeyId, "key");
typed_id!(/// A webhook subscription.
    WebhookId, "wh");
typed_id!(/// A join token: its secret is shown once and stored hashed.
    JoinTokenId, "jt");
typed_id!(/// A machine's request to join without a token (`bcd join --request`), derived from its key.
    JoinRequestId, "jreq");
typed_id!(/// A command to one node (`ping`, `gpu.hold`, …).
    CommandId, "cmd");
typed_id!(/// A flavor: the shape of an instance (vCPUs, memory, disk, GPUs) offered in one pool.
    FlavorId, "flv");
typed_id!(/// A registered disk image an instance boots from (its URL and SHA-256).
    ImageId, "img");
typed_id!(/// An instance: a virtual machine on a reservation's node, with its GPUs passed through.
    InstanceId, "inst");
typed_id!(/// A sandbox: an isolated, short-lived machine made from a sandbox template.
    SandboxId, "sbx");
typed_id!(/// A sandbox template: the pool, flavor, image, environment and bounds sandboxes are made from.
    SandboxTemplateId, "sbxt");
typed_id!(/// A sandbox volume: an ext4 disk image of its size on one node, mounted into one sandbox at a time.
    SandboxVolumeId, "vol");
typed_id!(/// A sandbox snapshot: a sandbox's memory and disk saved on its node, content-addressed by SHA-256.
    SandboxSnapshotId, "snap");
typed_id!(/// A bare-metal workflow: the steps one verb runs on one machine's BMC.
    WorkflowId, "wf");
typed_id!(/// A registered, signed `bcd` release.
    ReleaseId, "rel");
typed_id!(/// A rollout of a release to nodes, in waves.
    RolloutId, "ro");
typed_id!(/// A destructive batch: commands held until a quorum of approver keys signs their scope.
    CommandBatchId, "batch");
typed_id!(/// A write-only secret: a name and versions of a value sealed in the secret store.
    SecretId, "sec");
typed_id!(/// A site: where machines are (a region and labels); pools and metal machines may name one.
    SiteId, "site");
typed_id!(/// A project: a tenant's subdivision that reservations and instances may carry.
    ProjectId, "proj");
typed_id!(/// A request, for correlation.
    RequestId, "req");

/// The bytes of Crockford's base 32 as ids spell it: the digits and the lowercase letters but
/// i, l, o and u (a table: one load a byte).
static CROCKFORD_LOWER: [bool; 256] = {
    let mut table = [false; 256];
    let alphabet = b"0123456789abcdefghjkmnpqrstvwxyz";
    let mut i = 0;
    while i < alphabet.len() {
        table[alphabet[i] as usize] = true;
        i += 1;
    }
    table
};

/// Whether `text` is `prefix` + `_` + a ULID in the spelling ids display (lowercase Crockford
/// base 32, at most 128 bits): exactly the texts that parse as that kind of id and display as
/// themselves, checked without parsing or allocating (every event's check reads two).
pub fn is_canonical(text: &str, prefix: &str) -> bool {
    let Some(body) = text.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('_')) else { return false };
    body.len() == ULID_CHARS && body.as_bytes()[0] <= b'7' && body.bytes().all(|b| CROCKFORD_LOWER[usize::from(b)])
}

fn parse_prefixed(text: &str, prefix: &str) -> Result<ulid::Ulid, Error> {
    let invalid = |why: &str| Error::InvalidArgument {
        message: format!("malformed id {:?}: {why}", truncate(text, 64)),
        hint: Some(format!("expected {prefix}_ followed by a {ULID_CHARS}-character ULID")),
    };
    let Some((got_prefix, body)) = text.split_once('_') else {
        return Err(invalid("no prefix"));
    };
    if got_prefix != prefix {
        return Err(invalid(&format!("this is a {got_prefix}_ id, not a {prefix}_ id")));
    }
    if body.len() != ULID_CHARS {
        return Err(invalid("wrong length"));
    }
    // 26 characters of 5 bits hold 130 bits: a first character past 7 overflows the 128 bits
    // of a ULID, and the ulid crate would silently drop the top bits (two spellings, one id).
    if !body.starts_with(|c: char| ('0'..='7').contains(&c)) {
        return Err(invalid("not a ULID (too large)"));
    }
    ulid::Ulid::from_string(body).map_err(|_| invalid("not a ULID"))
}

/// Shortens user-provided text before it is echoed in an error message.
pub fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        text.to_owned()
    } else {
        let mut short: String = text.chars().take(max_chars).collect();
        short.push('…');
        short
    }
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids and the real clock (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_other_kinds() {
        let id = PoolId::generate();
        let text = id.to_string();
        assert!(text.starts_with("pool_"));
        assert_eq!(text.len(), 5 + ULID_CHARS);
        assert_eq!(text.parse::<PoolId>().unwrap(), id);
        assert_eq!(text.to_uppercase().replace("POOL_", "pool_").parse::<PoolId>().unwrap(), id);
        let err = text.parse::<NodeId>().unwrap_err();
        assert!(err.to_string().contains("not a node_ id"), "{err}");
        // Regression: `pool_8…` parsed (the top bits dropped), so one id had two spellings.
        for bad in [
            "",
            "pool_",
            "pool",
            "pool_123",
            "pool_01k5w!!!!!!!!!!!!!!!!!!!!!",
            "_01J0000000000000000000000",
            "pool_88888888888888888888888888",
            "pool_zzzzzzzzzzzzzzzzzzzzzzzzzz",
        ] {
            assert!(bad.parse::<PoolId>().is_err(), "{bad:?} accepted");
        }
    }
}
