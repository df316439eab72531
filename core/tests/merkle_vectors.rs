//! RFC 6962 known answers and the transparency-dev vectors (honest and tampered), plus a seeded
//! property test: honest proofs over random trees verify, every mutated one fails.

use base64::Engine;
use bc_core::merkle::{self, Hash, RootBuilder};
use proptest::prelude::*;
use serde_json::Value;

use crate::seeded;

fn b64(v: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(v.as_str().unwrap_or("")).unwrap()
}

fn proof(v: &Value) -> Vec<Vec<u8>> {
    v.as_array().map(|a| a.iter().map(b64).collect()).unwrap_or_default()
}

fn vector_files(kind: &str) -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/rfc6962").join(kind);
    let mut out = Vec::new();
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "json") {
                out.push((path.display().to_string(), serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()));
            }
        }
    }
    assert!(out.len() > 50, "vectors missing under {kind}");
    out
}

/// The leaves of RFC 6962's reference tree (the transparency-dev test data).
fn reference_leaves() -> Vec<Vec<u8>> {
    ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]
        .iter()
        .map(|h| hex::decode(h).unwrap())
        .collect()
}

#[test]
fn known_roots_for_sizes_0_to_8() {
    let roots = [
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    ];
    let leaves: Vec<Hash> = reference_leaves().iter().map(|l| merkle::leaf_hash(l)).collect();
    let mut builder = RootBuilder::new();
    assert_eq!(hex::encode(builder.root()), roots[0]);
    for n in 1..=8 {
        builder.push_leaf_hash(leaves[n - 1]);
        assert_eq!(hex::encode(merkle::root(&leaves[..n])), roots[n], "size {n}");
        assert_eq!(hex::encode(builder.root()), roots[n], "incremental size {n}");
    }
}

#[test]
fn inclusion_vectors() {
    let (mut honest, mut tampered) = (0, 0);
    for (file, v) in vector_files("inclusion") {
        let got = merkle::verify_inclusion(
            v["leafIdx"].as_u64().unwrap(),
            v["treeSize"].as_u64().unwrap(),
            &b64(&v["leafHash"]),
            &proof(&v["proof"]),
            &b64(&v["root"]),
        );
        let want_err = v["wantErr"].as_bool().unwrap();
        assert_eq!(got.is_err(), want_err, "{file}: {got:?}");
        if want_err { tampered += 1 } else { honest += 1 }
    }
    assert!(honest >= 5 && tampered >= 50, "{honest} honest, {tampered} tampered");
}

#[test]
fn consistency_vectors() {
    let (mut honest, mut tampered) = (0, 0);
    for (file, v) in vector_files("consistency") {
        let got = merkle::verify_consistency(
            v["size1"].as_u64().unwrap(),
            v["size2"].as_u64().unwrap(),
            &b64(&v["root1"]),
            &b64(&v["root2"]),
            &proof(&v["proof"]),
        );
        let want_err = v["wantErr"].as_bool().unwrap();
        assert_eq!(got.is_err(), want_err, "{file}: {got:?}");
        if want_err { tampered += 1 } else { honest += 1 }
    }
    assert!(honest >= 5 && tampered >= 50, "{honest} honest, {tampered} tampered");
}

fn bigger_root(leaves: &[Hash], more: u64) -> Hash {
    let mut all = leaves.to_vec();
    all.extend((0..more).map(|i| merkle::leaf_hash(&(u64::MAX - i).to_be_bytes())));
    merkle::root(&all)
}

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit { hash: usize, bit: usize },
    Trailing,
    DropLast,
    Index(u64),
    Size(u64),
    SwapRoots,
}

#[test]
fn honest_proofs_verify_and_mutated_ones_fail() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 256);
    let mutation = prop_oneof![
        (any::<usize>(), 0usize..256).prop_map(|(hash, bit)| Mutation::FlipBit { hash, bit }),
        Just(Mutation::Trailing),
        Just(Mutation::DropLast),
        (1u64..5).prop_map(Mutation::Index),
        (1u64..5).prop_map(Mutation::Size),
        Just(Mutation::SwapRoots),
    ];
    let result = runner.run(&(1u64..300, any::<u64>(), any::<u64>(), mutation), |(n, a, b, mutation)| {
        let leaves: Vec<Hash> = (0..n).map(|i| merkle::leaf_hash(&i.to_be_bytes())).collect();
        let root = merkle::root(&leaves);
        // Inclusion.
        let index = a % n;
        let p: Vec<Vec<u8>> = merkle::inclusion_proof(index, &leaves).unwrap().iter().map(|h| h.to_vec()).collect();
        prop_assert_eq!(merkle::verify_inclusion(index, n, &leaves[index as usize], &p, &root), Ok(()));
        let (mut i2, mut n2, mut p2, mut r2) = (index, n, p.clone(), root.to_vec());
        let mut leaf2 = leaves[index as usize].to_vec();
        let changed = match &mutation {
            Mutation::FlipBit { hash, bit } if !p2.is_empty() => {
                let h = hash % p2.len();
                p2[h][bit / 8] ^= 1 << (bit % 8);
                true
            }
            Mutation::FlipBit { bit, .. } => {
                leaf2[bit / 8] ^= 1 << (bit % 8);
                true
            }
            Mutation::Trailing => {
                p2.push(vec![0; 32]);
                true
            }
            Mutation::DropLast => p2.pop().is_some(),
            Mutation::Index(d) => {
                i2 = (index + d) % n;
                i2 != index && leaves[i2 as usize] != leaves[index as usize]
            }
            Mutation::Size(d) => {
                // A wrong size comes with that size's root (a checkpoint binds the two).
                n2 = n + d;
                r2 = bigger_root(&leaves, *d).to_vec();
                true
            }
            Mutation::SwapRoots => {
                std::mem::swap(&mut r2, &mut leaf2);
                leaf2 != r2
            }
        };
        if changed {
            prop_assert!(
                merkle::verify_inclusion(i2, n2, &leaf2, &p2, &r2).is_err(),
                "mutated inclusion proof verified: {:?}",
                mutation
            );
        }
        // Consistency.
        let old = 1 + b % n;
        let old_root = merkle::root(&leaves[..old as usize]);
        let c: Vec<Vec<u8>> = merkle::consistency_proof(old, &leaves).unwrap().iter().map(|h| h.to_vec()).collect();
        prop_assert_eq!(merkle::verify_consistency(old, n, &old_root, &root, &c), Ok(()));
        let (mut o2, mut n3, mut c2, mut ro, mut rn) = (old, n, c.clone(), old_root.to_vec(), root.to_vec());
        let changed = match &mutation {
            Mutation::FlipBit { hash, bit } if !c2.is_empty() => {
                let h = hash % c2.len();
                c2[h][bit / 8] ^= 1 << (bit % 8);
                true
            }
            Mutation::FlipBit { bit, .. } => {
                ro[bit / 8] ^= 1 << (bit % 8);
                true
            }
            Mutation::Trailing => {
                c2.push(vec![0; 32]);
                true
            }
            Mutation::DropLast => c2.pop().is_some(),
            Mutation::Index(d) => {
                o2 = old + d;
                o2 <= n && merkle::root(&leaves[..o2 as usize]) != old_root
            }
            Mutation::Size(d) => {
                n3 = n + d;
                rn = bigger_root(&leaves, *d).to_vec();
                true
            }
            Mutation::SwapRoots => {
                std::mem::swap(&mut ro, &mut rn);
                ro != rn
            }
        };
        if changed {
            prop_assert!(
                merkle::verify_consistency(o2, n3, &ro, &rn, &c2).is_err(),
                "mutated consistency proof verified: {:?}",
                mutation
            );
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}
