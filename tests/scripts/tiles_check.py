#!/usr/bin/env python3
"""An independent C2SP tlog-tiles client, written from RFC 6962 and c2sp.org/tlog-tiles with
nothing but the standard library (no code of this project): fetches a tenant's checkpoint, every
entry bundle and level-0 and level-1 tile it covers, recomputes every hash and the root, and
prints a JSON summary. Exits 1 on the first mismatch.

usage: tiles_check.py URL TENANT TOKEN
"""
import base64, hashlib, json, sys, urllib.request

url, tenant, token = sys.argv[1:4]


def get(path):
    req = urllib.request.Request(f"{url}/audit/{tenant}/{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req) as resp:
        return resp.read(), resp.headers.get("Cache-Control")


def index_path(n):
    groups = []
    while True:
        groups.append(n % 1000)
        n //= 1000
        if n == 0:
            break
    groups.reverse()
    return "/".join(("x%03d" if i < len(groups) - 1 else "%03d") % g for i, g in enumerate(groups))


def tile_path(kind, n, w):
    return f"tile/{kind}/{index_path(n)}" + (f".p/{w}" if w < 256 else "")


def leaf(d):
    return hashlib.sha256(b"\x00" + d).digest()


def node(l, r):
    return hashlib.sha256(b"\x01" + l + r).digest()


def mth(hs):
    if not hs:
        return hashlib.sha256(b"").digest()
    if len(hs) == 1:
        return hs[0]
    k = 1
    while k * 2 < len(hs):
        k *= 2
    return node(mth(hs[:k]), mth(hs[k:]))


def fail(what):
    print(json.dumps({"ok": False, "error": what}))
    sys.exit(1)


note, cache = get("checkpoint")
lines = note.decode().split("\n")
size, root = int(lines[1]), base64.b64decode(lines[2])
leaves, caches = [], {}
for n in range((size + 255) // 256):
    w = min(256, size - n * 256)
    body, cache = get(tile_path("entries", n, w))
    caches[tile_path("entries", n, w)] = cache
    entries, i = [], 0
    while i < len(body):
        ln = int.from_bytes(body[i:i + 2], "big")
        entries.append(body[i + 2:i + 2 + ln])
        i += 2 + ln
    if len(entries) != w or any(len(e) != 32 for e in entries):
        fail(f"entry bundle {n}: {len(entries)} entries, wanted {w} of 32 bytes")
    hashes = [leaf(e) for e in entries]
    tile, cache = get(tile_path("0", n, w))
    caches[tile_path("0", n, w)] = cache
    if tile != b"".join(hashes):
        fail(f"tile 0/{n} differs from the leaf hashes of its entries")
    leaves += hashes
level1 = size // 256
for n in range((level1 + 255) // 256):
    w = min(256, level1 - n * 256)
    want = b"".join(mth(leaves[(n * 256 + i) * 256:(n * 256 + i + 1) * 256]) for i in range(w))
    tile, cache = get(tile_path("1", n, w))
    caches[tile_path("1", n, w)] = cache
    if tile != want:
        fail(f"tile 1/{n} differs from the roots of its subtrees")
if mth(leaves) != root:
    fail("the root of the leaves differs from the checkpoint's")
print(json.dumps({"ok": True, "size": size, "root": base64.b64encode(root).decode(), "cacheControl": caches}))
