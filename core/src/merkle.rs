//! RFC 6962 / RFC 9162 §2.1 Merkle trees over a tenant's event hashes: pure, no IO.
//!
//! Leaf `i` of a tenant's tree is the event with `seq = i + 1`, and its leaf data is that
//! event's 32-byte hash (`schema/LOG-FORMAT.md`). Hashing is domain-separated:
//! `leaf = SHA-256(0x00 ‖ data)`, `node = SHA-256(0x01 ‖ left ‖ right)`, split at the largest
//! power of two below `n`; the empty tree's root is `SHA-256("")`.
//!
//! The verifiers are this project's own, written from RFC 9162 §2.1.3.2 (inclusion) and
//! §2.1.4.2 (consistency). They reject proofs of the wrong length, hashes that are not 32 bytes,
//! and out-of-range indices; `rs_merkle` is not used because it accepts tampered proofs and has
//! no consistency proofs.

use sha2::{Digest, Sha256};

pub type Hash = [u8; 32];

/// Deepest proof accepted: a tree of 2^64 leaves needs 64 hashes (plus one for consistency).
pub const PROOF_HASHES_MAX: usize = 65;

pub fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The largest power of two strictly below `n` (`n >= 2`).
fn split(n: u64) -> u64 {
    debug_assert!(n >= 2);
    1 << (63 - (n - 1).leading_zeros())
}

/// Computes roots incrementally in O(log n) memory: push leaf hashes in order, read the root of
/// everything pushed so far at any time.
#[derive(Clone, Debug, Default)]
pub struct RootBuilder {
    /// Perfect subtrees, left to right, sizes strictly decreasing powers of two.
    stack: Vec<(u64, Hash)>,
    size: u64,
}

impl RootBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The perfect subtrees pushed so far, left to right (a compact range: what a monitor keeps).
    pub fn subtrees(&self) -> &[(u64, Hash)] {
        &self.stack
    }

    /// Rebuilds a builder from [`RootBuilder::subtrees`]; `None` unless the sizes are strictly
    /// decreasing powers of two (the only shape `push_leaf_hash` makes).
    pub fn from_subtrees(stack: Vec<(u64, Hash)>) -> Option<Self> {
        let mut size: u64 = 0;
        for (i, (s, _)) in stack.iter().enumerate() {
            if !s.is_power_of_two() || (i > 0 && *s >= stack[i - 1].0) {
                return None;
            }
            size = size.checked_add(*s)?;
        }
        Some(Self { stack, size })
    }

    /// Appends a leaf given its leaf hash (`leaf_hash(data)`).
    pub fn push_leaf_hash(&mut self, leaf: Hash) {
        self.push_subtree(1, leaf);
    }

    /// Appends the perfect subtree of `size` leaves (a power of two) whose root is `hash`, as
    /// [`range_subtrees`] cuts a run of leaves: the tree so far must end on a multiple of
    /// `size` (false, and nothing is pushed, if it does not).
    pub fn push_subtree(&mut self, size: u64, hash: Hash) -> bool {
        if !size.is_power_of_two() || !self.size.is_multiple_of(size) {
            return false;
        }
        let mut node = (size, hash);
        while let Some(&(size, top)) = self.stack.last() {
            if size != node.0 {
                break;
            }
            self.stack.pop();
            node = (size * 2, node_hash(&top, &node.1));
        }
        self.stack.push(node);
        self.size += size;
        true
    }

    pub fn root(&self) -> Hash {
        let mut iter = self.stack.iter().rev();
        let Some(&(_, mut acc)) = iter.next() else { return empty_root() };
        for (_, left) in iter {
            acc = node_hash(left, &acc);
        }
        acc
    }
}

/// The leaves at indices `start..start + leaves.len()` cut into the fewest perfect subtrees
/// aligned on their size (a compact range), left to right, each with its root: what
/// [`RootBuilder::push_subtree`] takes, in order, from a builder of `start` leaves. The roots
/// of disjoint runs can be computed apart (on other cores) and pushed in order.
pub fn range_subtrees(start: u64, leaves: &[Hash]) -> Vec<(u64, Hash)> {
    let mut out = Vec::new();
    let (mut at, mut i) = (start, 0usize);
    while i < leaves.len() {
        let left = (leaves.len() - i) as u64;
        // The largest power of two that `at` is a multiple of and that fits in what is left.
        let aligned = if at == 0 { u64::MAX } else { 1u64 << at.trailing_zeros() };
        let size = aligned.min(1u64 << (63 - left.leading_zeros()));
        out.push((size, root(&leaves[i..i + size as usize])));
        at += size;
        i += size as usize;
    }
    out
}

/// MTH over leaf hashes.
pub fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n as u64) as usize;
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// The audit path of leaf `index` in the tree of `leaves` (RFC 6962 §2.1.1 PATH).
pub fn inclusion_proof(index: u64, leaves: &[Hash]) -> Option<Vec<Hash>> {
    if index >= leaves.len() as u64 {
        return None;
    }
    let mut proof = Vec::new();
    path(index as usize, leaves, &mut proof);
    Some(proof)
}

fn path(m: usize, leaves: &[Hash], out: &mut Vec<Hash>) {
    let n = leaves.len();
    if n <= 1 {
        return;
    }
    let k = split(n as u64) as usize;
    if m < k {
        path(m, &leaves[..k], out);
        out.push(root(&leaves[k..]));
    } else {
        path(m - k, &leaves[k..], out);
        out.push(root(&leaves[..k]));
    }
}

/// The consistency proof from the first `old_size` leaves to all of `leaves` (RFC 6962 §2.1.2).
pub fn consistency_proof(old_size: u64, leaves: &[Hash]) -> Option<Vec<Hash>> {
    let n = leaves.len() as u64;
    if old_size == 0 || old_size > n {
        return None;
    }
    let mut proof = Vec::new();
    if old_size < n {
        subproof(old_size as usize, leaves, true, &mut proof);
    }
    Some(proof)
}

fn subproof(m: usize, leaves: &[Hash], complete: bool, out: &mut Vec<Hash>) {
    let n = leaves.len();
    if m == n {
        if !complete {
            out.push(root(leaves));
        }
        return;
    }
    let k = split(n as u64) as usize;
    if m <= k {
        subproof(m, &leaves[..k], complete, out);
        out.push(root(&leaves[k..]));
    } else {
        subproof(m - k, &leaves[k..], false, out);
        out.push(root(&leaves[..k]));
    }
}

/// The consistency proof from the tree `old` (given by its compact range,
/// [`RootBuilder::subtrees`]) to that tree with `added` leaves after it: what
/// [`consistency_proof`] gives over all the leaves, from the old tree's compact range and the
/// added leaves alone. Every hash such a proof holds is one of the old tree's compact-range
/// subtrees or lies wholly among the added leaves, so a caller that kept the compact range reads
/// only what the tree grew by. `None` for an empty old tree (no proof is needed from size 0).
pub fn consistency_proof_extending(old: &RootBuilder, added: &[Hash]) -> Option<Vec<Hash>> {
    let m = old.size();
    if m == 0 {
        return None;
    }
    let mut pieces = std::collections::HashMap::new();
    let mut start = 0u64;
    for (size, hash) in old.subtrees() {
        pieces.insert((start, start + size), *hash);
        start += size;
    }
    let hash = |lo: u64, hi: u64| -> Option<Hash> {
        if lo >= m { Some(root(&added[(lo - m) as usize..(hi - m) as usize])) } else { pieces.get(&(lo, hi)).copied() }
    };
    let mut proof = Vec::new();
    let n = m + added.len() as u64;
    if m < n {
        subproof_ranged(m, (0, n), true, &hash, &mut proof)?;
    }
    Some(proof)
}

/// [`subproof`] over the leaves `lo..hi` of a tree, `m` of them in the old tree, taking each
/// hash from `hash(lo, hi)`.
fn subproof_ranged(
    m: u64,
    (lo, hi): (u64, u64),
    complete: bool,
    hash: &dyn Fn(u64, u64) -> Option<Hash>,
    out: &mut Vec<Hash>,
) -> Option<()> {
    let n = hi - lo;
    if m == n {
        if !complete {
            out.push(hash(lo, hi)?);
        }
        return Some(());
    }
    let k = split(n);
    if m <= k {
        subproof_ranged(m, (lo, lo + k), complete, hash, out)?;
        out.push(hash(lo + k, hi)?);
    } else {
        subproof_ranged(m - k, (lo + k, hi), false, hash, out)?;
        out.push(hash(lo, lo + k)?);
    }
    Some(())
}

/// Why a proof does not verify.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    #[error("index {index} is outside a tree of size {size}")]
    IndexOutOfRange { index: u64, size: u64 },
    #[error("the proof has the wrong number of hashes")]
    WrongLength,
    #[error("a hash is not 32 bytes")]
    BadHash,
    #[error("the computed root does not match")]
    RootMismatch,
    #[error("old size {old} and new size {new} admit no consistency proof")]
    BadSizes { old: u64, new: u64 },
}

fn to_hash(bytes: &[u8]) -> Result<Hash, ProofError> {
    <Hash>::try_from(bytes).map_err(|_| ProofError::BadHash)
}

/// Checks that `leaf` (a leaf hash) is at `index` in the tree of `size` leaves with `root`
/// (RFC 9162 §2.1.3.2).
pub fn verify_inclusion(index: u64, size: u64, leaf: &[u8], proof: &[Vec<u8>], root: &[u8]) -> Result<(), ProofError> {
    if index >= size {
        return Err(ProofError::IndexOutOfRange { index, size });
    }
    let (leaf, root) = (to_hash(leaf)?, to_hash(root)?);
    if proof.len() > PROOF_HASHES_MAX {
        return Err(ProofError::WrongLength);
    }
    let mut f_n = index;
    let mut s_n = size - 1;
    let mut r = leaf;
    for p in proof {
        let p = to_hash(p)?;
        if s_n == 0 {
            return Err(ProofError::WrongLength);
        }
        if f_n & 1 == 1 || f_n == s_n {
            r = node_hash(&p, &r);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            r = node_hash(&r, &p);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    if s_n != 0 {
        return Err(ProofError::WrongLength);
    }
    if r != root {
        return Err(ProofError::RootMismatch);
    }
    Ok(())
}

/// Checks that the tree of `new_size` with `new_root` extends the tree of `old_size` with
/// `old_root` (RFC 9162 §2.1.4.2). A proof from the empty tree is refused as meaningless.
pub fn verify_consistency(
    old_size: u64,
    new_size: u64,
    old_root: &[u8],
    new_root: &[u8],
    proof: &[Vec<u8>],
) -> Result<(), ProofError> {
    if old_size == 0 || old_size > new_size {
        return Err(ProofError::BadSizes { old: old_size, new: new_size });
    }
    if proof.len() > PROOF_HASHES_MAX {
        return Err(ProofError::WrongLength);
    }
    if old_size == new_size {
        // The same tree: the proof is empty and the roots are the same bytes.
        if !proof.is_empty() {
            return Err(ProofError::WrongLength);
        }
        return if old_root == new_root { Ok(()) } else { Err(ProofError::RootMismatch) };
    }
    let (old_root, new_root) = (to_hash(old_root)?, to_hash(new_root)?);
    if proof.is_empty() {
        return Err(ProofError::WrongLength);
    }
    let mut path: Vec<Hash> = Vec::with_capacity(proof.len() + 1);
    if old_size.is_power_of_two() {
        path.push(old_root);
    }
    for p in proof {
        path.push(to_hash(p)?);
    }
    let mut f_n = old_size - 1;
    let mut s_n = new_size - 1;
    while f_n & 1 == 1 {
        f_n >>= 1;
        s_n >>= 1;
    }
    let mut f_r = path[0];
    let mut s_r = path[0];
    for c in &path[1..] {
        if s_n == 0 {
            return Err(ProofError::WrongLength);
        }
        if f_n & 1 == 1 || f_n == s_n {
            f_r = node_hash(c, &f_r);
            s_r = node_hash(c, &s_r);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            s_r = node_hash(&s_r, c);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    if s_n != 0 {
        return Err(ProofError::WrongLength);
    }
    if f_r != old_root || s_r != new_root {
        return Err(ProofError::RootMismatch);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair of sizes up to 130 leaves: the proof from a kept compact range and the added
    /// leaves is RFC 6962's proof over all the leaves.
    #[test]
    fn a_proof_from_a_compact_range_is_the_proof_over_all_the_leaves() {
        let leaves: Vec<Hash> = (0u32..130).map(|i| leaf_hash(&i.to_be_bytes())).collect();
        for n in 1..=leaves.len() {
            for m in 1..=n {
                let mut old = RootBuilder::new();
                leaves[..m].iter().for_each(|l| old.push_leaf_hash(*l));
                let expected = consistency_proof(m as u64, &leaves[..n]).unwrap();
                assert_eq!(consistency_proof_extending(&old, &leaves[m..n]), Some(expected), "{m} -> {n}");
            }
        }
        assert_eq!(consistency_proof_extending(&RootBuilder::new(), &leaves), None);
    }
}
