#!/usr/bin/env python3
"""Independent reference for tandem's block hashes (DESIGN.md section 4).

Prints the values pinned in tests/unit/block_hash_test.cc, computed with the
`xxhash` Python package (pip install xxhash) over the documented layout.
"""
import struct

import xxhash


def root_hash(model_id, revision, block_size, kv_dtype, fleet_salt, tenant_salt):
    buf = b"tandem.kv.v1"
    for field in (model_id, revision):
        enc = field.encode()
        buf += struct.pack("<I", len(enc)) + enc
    buf += struct.pack("<I", block_size)
    for field in (kv_dtype, fleet_salt, tenant_salt):
        enc = field.encode()
        buf += struct.pack("<I", len(enc)) + enc
    return xxhash.xxh3_64_intdigest(buf, 0)


def block_hashes(root, tokens, block_size):
    out, parent = [], root
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        parent = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *chunk), parent)
        out.append(parent)
    return out


def kv_pattern(n, offset):
    """Bytes offset..offset+n-1 of the KV checksum test's pattern."""
    return bytes(((i * 167 + 13) ^ (i >> 7)) & 0xFF for i in range(offset, offset + n))


# (bytes, offset) pairs pinned in tests/unit/kv_checksum_test.cc: every XXH3
# length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, then the striped long
# path with and without a partial stripe and block) and an unaligned start.
KV_CASES = [(0, 0), (3, 0), (8, 0), (16, 0), (100, 0), (240, 0), (241, 0),
            (1023, 1), (8192, 0), (8192, 3), (65541, 0), (2 << 20, 0)]


if __name__ == "__main__":
    r = root_hash("tandem-kjv", "", 16, "f32", "", "")
    print("root", hex(r))
    print("root salted", hex(root_hash("tandem-kjv", "", 16, "f32", "secret", "")))
    print("root bs32", hex(root_hash("tandem-kjv", "", 32, "f32", "", "")))
    print("chain", [hex(h) for h in block_hashes(r, list(range(1, 41)), 16)])
    print("le", hex(xxhash.xxh3_64_intdigest(struct.pack("<4I", 0, 1, 0xFFFFFFFF, 70000), 0)))
    for n, off in KV_CASES:
        print("kv", n, off, hex(xxhash.xxh3_64_intdigest(kv_pattern(n, off), 0)))
