//! A tenant's tree as C2SP `tlog-tiles`: paths, widths, tile and bundle bytes, and a bounded
//! cache of full tiles. The addressing is pure; [`TileSource`] reads the stored event hashes.
//!
//! - A tile is `TILE_HEIGHT = 8` levels of the RFC 6962 tree: the tile at level `L`, index `N`
//!   holds the hashes of the tree's level `8·L` with indices `256·N .. 256·N + W`, 32 bytes
//!   each, concatenated; a hash at level `8·L` is the root of a perfect subtree of `256^L`
//!   leaves. `W = 256` is a full tile; `1 ≤ W < 256` a partial one (the right edge).
//! - Level 0 holds leaf hashes `SHA-256(0x00 ‖ event hash)`; the hash `i` of a level-`L` tile
//!   (`L ≥ 1`) is the RFC 6962 root of the full level-`L−1` tile `256·N + i`.
//! - Entry bundle `N` holds the leaf data of leaves `256·N .. 256·N + W`, each as a big-endian
//!   `u16` length and the bytes: here the event's 32-byte hash (`schema/LOG-FORMAT.md`).
//! - Event bundle `N` (this project's, beside the entry bundles, same `N` and `W`) holds each
//!   event as a big-endian `u32` length and a deterministic CBOR map `{event: canonical bytes,
//!   keyId: text, sig: bytes}` (`keyId` and `sig` only for an event that carries a signature of
//!   its own), so a monitor checks the event against its leaf and its signature. `u32`, not `u16`: an event can be longer than 64 KiB (its payload alone may be).
//! - `N` in a path is written in groups of three decimal digits, every group but the last
//!   prefixed with `x`: 1234067 is `x001/x234/067`; a partial tile adds `.p/W`.
//!
//! Cost: a hash of a level-`L` tile covers `256^L` leaves, so a cold level-`L` tile reads
//! `256^(L+1)` stored hashes. [`TileSource`] computes level `L ≥ 1` from full tiles of level
//! `L − 1`, which it keeps in a FIFO cache of at most `TILE_CACHE_TILES_MAX` full tiles (8 KiB
//! each, so at most 32 MiB); a full tile never changes, so the cache is never stale. A partial
//! tile is computed from the same full tiles and its own right edge.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::id::TenantId;
use crate::merkle::{self, Hash};
use crate::store::EventStore;

pub const TILE_HEIGHT: u32 = 8;
/// Hashes in a full tile, entries in a full bundle.
pub const TILE_WIDTH: u64 = 1 << TILE_HEIGHT;
/// Deepest level served: a level-7 hash covers 2^56 leaves; level 8 would overflow `u64`.
pub const TILE_LEVEL_MAX: u8 = 7;
/// Full tiles kept in memory, all tenants together (8 KiB each: 32 MiB at most).
pub const TILE_CACHE_TILES_MAX: usize = 4096;
/// Rows read per query while computing a level-0 tile.
const TILE_READ_ROWS: u32 = TILE_WIDTH as u32;

/// A tile or bundle request, parsed from its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileRef {
    pub index: u64,
    /// `TILE_WIDTH` for a full tile.
    pub width: u64,
}

/// What a path under `tile/` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TilePath {
    Hashes { level: u8, tile: TileRef },
    Entries(TileRef),
    Events(TileRef),
}

/// Encodes `N` as the spec does: `x001/x234/067`.
pub fn encode_index(n: u64) -> String {
    let mut groups = Vec::new();
    let mut rest = n;
    loop {
        groups.push(rest % 1000);
        rest /= 1000;
        if rest == 0 {
            break;
        }
    }
    let last = groups.len() - 1;
    groups
        .iter()
        .rev()
        .enumerate()
        .map(|(i, g)| if i < last { format!("x{g:03}") } else { format!("{g:03}") })
        .collect::<Vec<_>>()
        .join("/")
}

/// The path of a tile, an entry bundle (`level = None`) relative to the log's prefix.
pub fn tile_path(path: TilePath) -> String {
    let (prefix, tile) = match path {
        TilePath::Hashes { level, tile } => (level.to_string(), tile),
        TilePath::Entries(tile) => ("entries".to_owned(), tile),
        TilePath::Events(tile) => ("events".to_owned(), tile),
    };
    let mut out = format!("tile/{prefix}/{}", encode_index(tile.index));
    if tile.width < TILE_WIDTH {
        out.push_str(&format!(".p/{}", tile.width));
    }
    out
}

fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Parses what follows `tile/`: `L/N[.p/W]`, `entries/N[.p/W]` or `events/N[.p/W]`. Only the
/// canonical spelling is accepted (no leading `x000/` group, three digits per group).
pub fn parse_tile_path(rest: &str) -> Option<TilePath> {
    let (kind, rest) = rest.split_once('/')?;
    let (index_part, width) = match rest.split_once(".p/") {
        Some((index, w)) => {
            let w = decimal(w)?;
            if !(1..TILE_WIDTH).contains(&w) {
                return None;
            }
            (index, w)
        }
        None => (rest, TILE_WIDTH),
    };
    let groups: Vec<&str> = index_part.split('/').collect();
    let mut index: u64 = 0;
    for (i, g) in groups.iter().enumerate() {
        let digits = if i + 1 < groups.len() { g.strip_prefix('x')? } else { g };
        if digits.len() != 3 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if i == 0 && groups.len() > 1 && digits == "000" {
            return None;
        }
        index = index.checked_mul(1000)?.checked_add(digits.parse::<u64>().ok()?)?;
    }
    let tile = TileRef { index, width };
    match kind {
        "entries" => Some(TilePath::Entries(tile)),
        "events" => Some(TilePath::Events(tile)),
        level => {
            let level = u8::try_from(decimal(level)?).ok()?;
            (level <= TILE_LEVEL_MAX).then_some(TilePath::Hashes { level, tile })
        }
    }
}

/// Leaves one hash of a level-`level` tile covers: `256^level`.
pub fn leaves_per_hash(level: u8) -> u64 {
    1u64 << (TILE_HEIGHT * level as u32)
}

/// Whether the tree of `size` leaves has the tile `(level, tile)`: its `width` hashes at level
/// `8·level` are all complete subtrees.
pub fn tile_exists(size: u64, level: u8, tile: TileRef) -> bool {
    let complete = size / leaves_per_hash(level);
    tile.index.checked_mul(TILE_WIDTH).and_then(|start| start.checked_add(tile.width)).is_some_and(|end| end <= complete)
}

/// An entry bundle of event hashes: each as `u16` length (32) and the 32 bytes.
pub fn entry_bundle(hashes: &[Hash]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hashes.len() * 34);
    for h in hashes {
        out.extend_from_slice(&(h.len() as u16).to_be_bytes());
        out.extend_from_slice(h);
    }
    out
}

/// Splits an entry bundle back into its entries.
pub fn parse_entry_bundle(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len = bytes.get(at..at + 2).ok_or("truncated entry length")?;
        let len = u16::from_be_bytes([len[0], len[1]]) as usize;
        at += 2;
        out.push(bytes.get(at..at + len).ok_or("truncated entry")?.to_vec());
        at += len;
        if out.len() as u64 > TILE_WIDTH {
            return Err("more than 256 entries in a bundle".into());
        }
    }
    Ok(out)
}

/// One event of an event bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundledEvent {
    pub canonical: Vec<u8>,
    pub key_id: String,
    pub sig: Vec<u8>,
}

/// An event bundle: each event as `u32` length and its CBOR map.
pub fn event_bundle(events: &[BundledEvent]) -> Vec<u8> {
    use ciborium::Value;
    let mut out = Vec::new();
    for e in events {
        let mut fields = vec![(Value::Text("event".into()), Value::Bytes(e.canonical.clone()))];
        // An event without a signature of its own has neither (a later one, and the
        // checkpoint, cover it).
        if !e.sig.is_empty() {
            fields.push((Value::Text("keyId".into()), Value::Text(e.key_id.clone())));
            fields.push((Value::Text("sig".into()), Value::Bytes(e.sig.clone())));
        }
        let map = Value::Map(fields);
        let bytes = crate::canonical::encode(map).expect("bytes and text encode");
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

pub fn parse_event_bundle(bytes: &[u8]) -> Result<Vec<BundledEvent>, String> {
    use ciborium::Value;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len = bytes.get(at..at + 4).ok_or("truncated event length")?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        at += 4;
        let item = bytes.get(at..at.checked_add(len).ok_or("event length overflows")?).ok_or("truncated event")?;
        at += len;
        let Value::Map(entries) = crate::canonical::decode_canonical(item)? else {
            return Err("a bundled event is not a map".into());
        };
        let (mut canonical, mut key_id, mut sig) = (None, None, None);
        for (k, v) in entries {
            match (k, v) {
                (Value::Text(k), Value::Bytes(b)) if k == "event" => canonical = Some(b),
                (Value::Text(k), Value::Text(t)) if k == "keyId" => key_id = Some(t),
                (Value::Text(k), Value::Bytes(b)) if k == "sig" => sig = Some(b),
                _ => return Err("a bundled event has an unknown field".into()),
            }
        }
        out.push(BundledEvent {
            canonical: canonical.ok_or("a bundled event has no event")?,
            key_id: key_id.unwrap_or_default(),
            sig: sig.unwrap_or_default(),
        });
        if out.len() as u64 > TILE_WIDTH {
            return Err("more than 256 events in a bundle".into());
        }
    }
    Ok(out)
}

/// Concatenates hashes into tile bytes.
pub fn tile_bytes(hashes: &[Hash]) -> Vec<u8> {
    hashes.iter().flat_map(|h| h.iter().copied()).collect()
}

/// Computes tiles from the stored event hashes, keeping full tiles in a bounded cache.
pub struct TileSource {
    /// Full tiles by (tenant, level, index): immutable once full, so never stale.
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    tiles: HashMap<(TenantId, u8, u64), std::sync::Arc<Vec<Hash>>>,
    order: VecDeque<(TenantId, u8, u64)>,
}

impl Default for TileSource {
    fn default() -> Self {
        Self { cache: Mutex::new(Cache::default()) }
    }
}

impl TileSource {
    pub fn new() -> Self {
        Self::default()
    }

    fn cached(&self, key: (TenantId, u8, u64)) -> Option<std::sync::Arc<Vec<Hash>>> {
        self.cache.lock().expect("tile cache").tiles.get(&key).cloned()
    }

    fn remember(&self, key: (TenantId, u8, u64), tile: std::sync::Arc<Vec<Hash>>) {
        let mut cache = self.cache.lock().expect("tile cache");
        if cache.tiles.insert(key, tile).is_none() {
            cache.order.push_back(key);
        }
        while cache.order.len() > TILE_CACHE_TILES_MAX {
            if let Some(old) = cache.order.pop_front() {
                cache.tiles.remove(&old);
            }
        }
    }

    /// The number of full tiles cached (for tests and measurements).
    pub fn cached_tiles(&self) -> usize {
        self.cache.lock().expect("tile cache").tiles.len()
    }

    /// The hashes of tile `(level, tile)` of `tenant`'s tree; the caller has checked that the
    /// tree it serves has it ([`tile_exists`]).
    pub async fn tile(&self, store: &dyn EventStore, tenant: TenantId, level: u8, tile: TileRef) -> Result<Vec<Hash>> {
        let full = tile.width == TILE_WIDTH;
        if full && let Some(t) = self.cached((tenant, level, tile.index)) {
            return Ok(t.to_vec());
        }
        let start = tile.index * TILE_WIDTH;
        let hashes = if level == 0 {
            event_hashes(store, tenant, start + 1, tile.width).await?.iter().map(|h| merkle::leaf_hash(h)).collect()
        } else {
            let mut out = Vec::with_capacity(tile.width as usize);
            for i in 0..tile.width {
                // Boxed: the recursion is at most TILE_LEVEL_MAX deep.
                let below =
                    Box::pin(self.tile(store, tenant, level - 1, TileRef { index: start + i, width: TILE_WIDTH })).await?;
                out.push(merkle::root(&below));
            }
            out
        };
        if full {
            self.remember((tenant, level, tile.index), std::sync::Arc::new(hashes.clone()));
        }
        Ok(hashes)
    }
}

/// The stored hashes of `count` events of `tenant` from `from_seq`, checked to be in order.
pub async fn event_hashes(store: &dyn EventStore, tenant: TenantId, from_seq: u64, count: u64) -> Result<Vec<Hash>> {
    let mut out = Vec::with_capacity(count as usize);
    for row in chain_rows(store, tenant, from_seq, count).await? {
        out.push(<Hash>::try_from(row.hash.as_slice()).map_err(|_| Error::Corrupt {
            tenant: tenant.to_string(),
            seq: row.seq,
            what: "hash is not 32 bytes".into(),
        })?);
    }
    Ok(out)
}

/// `count` stored rows of `tenant` from `from_seq`, every seq present.
pub async fn chain_rows(
    store: &dyn EventStore,
    tenant: TenantId,
    from_seq: u64,
    count: u64,
) -> Result<Vec<crate::event::EventRow>> {
    let mut out = Vec::with_capacity(count as usize);
    while (out.len() as u64) < count {
        let next = from_seq + out.len() as u64;
        let rows = store.read_chain_rows(tenant, next, TILE_READ_ROWS.min((count - out.len() as u64) as u32)).await?;
        if rows.is_empty() {
            break;
        }
        for row in rows {
            if out.len() as u64 == count {
                break;
            }
            let expected = from_seq + out.len() as u64;
            if row.seq != expected {
                return Err(Error::Corrupt { tenant: tenant.to_string(), seq: expected, what: "event missing".into() });
            }
            out.push(row);
        }
    }
    if (out.len() as u64) < count {
        return Err(Error::Corrupt {
            tenant: tenant.to_string(),
            seq: from_seq + out.len() as u64,
            what: "event missing".into(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's example, and round trips.
    #[test]
    fn index_paths_as_the_spec_writes_them() {
        assert_eq!(encode_index(1234067), "x001/x234/067");
        assert_eq!(encode_index(0), "000");
        assert_eq!(encode_index(1000), "x001/000");
        let t = TileRef { index: 1234067, width: 8 };
        assert_eq!(tile_path(TilePath::Hashes { level: 1, tile: t }), "tile/1/x001/x234/067.p/8");
        assert_eq!(tile_path(TilePath::Entries(TileRef { index: 5, width: 256 })), "tile/entries/005");
        for n in [0, 1, 999, 1000, 1001, 123_456_789, u64::MAX] {
            for w in [1, 255, 256] {
                let tile = TileRef { index: n, width: w };
                for p in [TilePath::Hashes { level: 3, tile }, TilePath::Entries(tile), TilePath::Events(tile)] {
                    let path = tile_path(p);
                    assert_eq!(parse_tile_path(path.strip_prefix("tile/").unwrap()), Some(p), "{path}");
                }
            }
        }
        for bad in
            ["0/x000/001", "0/1", "0/0001", "0/001.p/0", "0/001.p/256", "0/001.p/08", "8/000", "0/x1/001", "0/001/", "x/000"]
        {
            assert_eq!(parse_tile_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn which_tiles_a_tree_has() {
        let full = |index| TileRef { index, width: 256 };
        assert!(tile_exists(256, 0, full(0)));
        assert!(!tile_exists(255, 0, full(0)));
        assert!(tile_exists(255, 0, TileRef { index: 0, width: 255 }));
        assert!(tile_exists(70_000, 1, TileRef { index: 1, width: 17 })); // 70000/256 = 273 = 256 + 17
        assert!(!tile_exists(70_000, 1, TileRef { index: 1, width: 18 }));
        assert!(!tile_exists(u64::MAX, 0, full(u64::MAX)));
    }

    #[test]
    fn bundles_round_trip() {
        let hashes = [[1u8; 32], [2u8; 32]];
        let bytes = entry_bundle(&hashes);
        assert_eq!(bytes.len(), 68);
        assert_eq!(&bytes[..2], &[0, 32]);
        assert_eq!(parse_entry_bundle(&bytes).unwrap(), vec![vec![1u8; 32], vec![2u8; 32]]);
        assert!(parse_entry_bundle(&bytes[..67]).is_err());
        let events = vec![
            BundledEvent { canonical: vec![0xa0], key_id: "lk_00".into(), sig: vec![7; 64] },
            // Without a signature of its own: the map holds the event alone.
            BundledEvent { canonical: vec![0xa0], key_id: String::new(), sig: vec![] },
        ];
        let bytes = event_bundle(&events);
        assert_eq!(&bytes[bytes.len() - 13..], b"\0\0\0\x09\xa1\x65event\x41\xa0");
        assert_eq!(parse_event_bundle(&bytes).unwrap(), events);
    }
}
