#!/usr/bin/env python3
"""The served tiles checked with a third-party RFC 6962/9162 implementation: pymerkle (PyPI,
pinned in tests/scripts/tiles-requirements.txt, installed by `make tiles-venv` into
target/tiles-venv/). Nothing of this project computes a hash here.

Why pymerkle: its trees are RFC 9162 section 2 trees (leaf SHA-256(0x00 || d), node
SHA-256(0x01 || l || r), split at the largest power of two below the width, empty root
SHA-256()) with its defaults (sha256, security on), and it builds a tree from leaf data, so it
recomputes roots, leaves and subtree roots rather than only checking a proof someone supplied.
Before the served tree is believed, this script holds pymerkle to the transparency-dev RFC 6962
vectors (VECTORS: their roots, leaf hashes and inclusion paths of the reference tree).

Then, from the live log: the checkpoint's root must be pymerkle's root of the entry bundles'
leaf data at the checkpoint's size; every level-0 tile hash must be pymerkle's leaf hash;
every level-L tile hash (L >= 1) must be pymerkle's root of the 256**L leaves it covers. Which
tiles exist and their paths follow c2sp.org/tlog-tiles, held to the spec's own examples
(index 1234067 is x001/x234/067; a tree of 70,000 has 273 full level-0 tiles, a partial one of
width 112, one full and one partial (17) level-1 tile and a partial (1) level-2 tile; a tree of
256 a full level-0 tile and a partial level-1 tile of width 1); every tile of that layout is
fetched, and the first empty level must not be served.

Prints a JSON summary; exits 1 on the first mismatch, 2 when pymerkle is missing.

usage: tiles_pymerkle.py URL TENANT TOKEN VECTORS
"""
import base64, glob, json, os, sys, urllib.error, urllib.request

PYMERKLE_VERSION = "7.0.0"
TILE_WIDTH = 256


def fail(what, code=1):
    print(json.dumps({"ok": False, "error": what}))
    sys.exit(code)


try:
    import pymerkle
    from pymerkle import InmemoryTree, verify_inclusion
except ImportError as e:
    fail(f"pymerkle is not installed in {sys.executable} ({e}): run `make tiles-venv`", 2)
if pymerkle.__version__ != PYMERKLE_VERSION:
    fail(f"pymerkle {pymerkle.__version__} found, {PYMERKLE_VERSION} pinned: run `make tiles-venv`", 2)


def b64(s):
    return base64.b64decode(s or "")


def tree_of(entries):
    """pymerkle's tree with its defaults: SHA-256, prefixes 0x00 and 0x01 (RFC 6962)."""
    tree = InmemoryTree()
    if (tree.algorithm, tree.security, tree.leaf_prefix, tree.node_prefix) != ("sha256", True, b"\x00", b"\x01"):
        fail("pymerkle's default tree is not SHA-256 with the RFC 6962 prefixes")
    for e in entries:
        tree.append_entry(e)
    return tree


# ---- 1. pymerkle against the RFC 6962 vectors (the reference tree of 8 leaves).
REFERENCE_LEAVES = [bytes.fromhex(h) for h in
                    ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]]


def check_vectors(directory):
    reference = tree_of(REFERENCE_LEAVES)
    checked = 0
    for path in sorted(glob.glob(os.path.join(directory, "inclusion", "*", "happy-path.json"))):
        v = json.load(open(path))
        index, size = v["leafIdx"], v["treeSize"]
        if reference.get_root(size) != b64(v["root"]):
            fail(f"{path}: pymerkle's root of size {size} differs from the vector's")
        if reference.get_leaf(index + 1) != b64(v["leafHash"]):
            fail(f"{path}: pymerkle's leaf hash {index} differs from the vector's")
        proof = reference.prove_inclusion(index + 1, size)
        if proof.path[1:] != [b64(h) for h in v["proof"] or []]:
            fail(f"{path}: pymerkle's inclusion path differs from the vector's")
        verify_inclusion(reference.get_leaf(index + 1), b64(v["root"]), proof)
        checked += 1
    for path in sorted(glob.glob(os.path.join(directory, "consistency", "*", "happy-path.json"))):
        v = json.load(open(path))
        for size, root in ((v["size1"], v["root1"]), (v["size2"], v["root2"])):
            if reference.get_root(size) != b64(root):
                fail(f"{path}: pymerkle's root of size {size} differs from the vector's")
        checked += 1
    if checked < 10:
        fail(f"only {checked} vectors under {directory}")
    return checked


# ---- 2. The layout, as c2sp.org/tlog-tiles writes it.
def index_path(n):
    groups = []
    while True:
        groups.append(n % 1000)
        n //= 1000
        if n == 0:
            break
    groups.reverse()
    return "/".join(("x%03d" if i < len(groups) - 1 else "%03d") % g for i, g in enumerate(groups))


def tile_path(level, n, width):
    return f"tile/{level}/{index_path(n)}" + (f".p/{width}" if width < TILE_WIDTH else "")


def layout(size):
    """Every (level, index, width) a tree of `size` has: level L has floor(size / 256**L) hashes,
    in full tiles and at most one partial tile of the rest; a level with none has no tiles."""
    tiles, level = [], 0
    while size // TILE_WIDTH ** level:
        hashes = size // TILE_WIDTH ** level
        tiles += [(level, n, TILE_WIDTH) for n in range(hashes // TILE_WIDTH)]
        if hashes % TILE_WIDTH:
            tiles.append((level, hashes // TILE_WIDTH, hashes % TILE_WIDTH))
        level += 1
    return tiles


def check_layout_examples():
    if index_path(1234067) != "x001/x234/067":
        fail("index 1234067 is not x001/x234/067")
    if tile_path(1, 1234067, 8) != "tile/1/x001/x234/067.p/8" or tile_path(0, 5, 256) != "tile/0/005":
        fail("tile paths differ from tile/<L>/<N>[.p/<W>]")
    t = layout(70000)
    full0 = [x for x in t if x[0] == 0 and x[2] == TILE_WIDTH]
    if (len(full0), [x for x in t if x[0] == 0 and x[2] < TILE_WIDTH]) != (273, [(0, 273, 112)]):
        fail("a tree of 70,000 has 273 full level-0 tiles and a partial one of width 112")
    if [x for x in t if x[0] >= 1] != [(1, 0, 256), (1, 1, 17), (2, 0, 1)]:
        fail("a tree of 70,000 has one full and one partial (17) level-1 tile and a partial level-2 tile (1)")
    if layout(256) != [(0, 0, 256), (1, 0, 1)]:
        fail("a tree of 256 has a full level-0 tile and a partial level-1 tile of width 1")


# ---- 3. The live log.
url, tenant, token, vectors = sys.argv[1:5]


def get(path, missing_ok=False):
    req = urllib.request.Request(f"{url}/audit/{tenant}/{path}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.read(), resp.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        if missing_ok and e.code == 404:
            return None, None
        fail(f"GET {path}: {e.code}")


vectors_checked = check_vectors(vectors)
check_layout_examples()

note, content_type = get("checkpoint")
if content_type != "text/plain; charset=utf-8":
    fail(f"the checkpoint's Content-Type is {content_type}")
lines = note.decode().split("\n")
size, root = int(lines[1]), b64(lines[2])
if size == 0:
    fail("the checkpoint is of the empty tree: nothing to check")

entries = []
for n in range((size + TILE_WIDTH - 1) // TILE_WIDTH):
    width = min(TILE_WIDTH, size - n * TILE_WIDTH)
    path = f"tile/entries/{index_path(n)}" + (f".p/{width}" if width < TILE_WIDTH else "")
    body, content_type = get(path)
    if content_type != "application/octet-stream":
        fail(f"{path}: Content-Type {content_type}")
    i, bundle = 0, []
    while i < len(body):
        length = int.from_bytes(body[i:i + 2], "big")
        bundle.append(body[i + 2:i + 2 + length])
        i += 2 + length
    if len(bundle) != width or i != len(body):
        fail(f"{path}: {len(bundle)} entries, wanted {width}")
    entries += bundle

tree = tree_of(entries)
if tree.get_root(size) != root:
    fail(f"pymerkle's root of the {size} entries differs from the checkpoint's")
for index in (1, size // 2 + 1, size):
    verify_inclusion(tree.get_leaf(index), root, tree.prove_inclusion(index, size))

checked = {}
for level, n, width in layout(size):
    path = tile_path(level, n, width)
    body, content_type = get(path)
    if content_type != "application/octet-stream":
        fail(f"{path}: Content-Type {content_type}")
    span = TILE_WIDTH ** level
    if level == 0:
        want = b"".join(tree.get_leaf(n * TILE_WIDTH + i + 1) for i in range(width))
    else:
        # Hash i is MTH(D[(n*256 + i) * 256**L : (n*256 + i + 1) * 256**L]): a tree of its own.
        want = b"".join(tree_of(entries[(n * TILE_WIDTH + i) * span:(n * TILE_WIDTH + i + 1) * span]).get_root()
                        for i in range(width))
    if body != want:
        fail(f"{path} differs from pymerkle's hashes")
    checked[path] = width
empty_level = max(level for level, _, _ in layout(size)) + 1
if get(tile_path(empty_level, 0, 1), missing_ok=True)[0] is not None:
    fail(f"level {empty_level} has no hashes in a tree of {size}, yet a tile of it is served")
print(json.dumps({"ok": True, "library": f"pymerkle {pymerkle.__version__}", "vectors": vectors_checked, "size": size,
                  "root": base64.b64encode(root).decode(), "tiles": checked}))
