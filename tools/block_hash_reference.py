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


if __name__ == "__main__":
    r = root_hash("tandem-kjv", "", 16, "f32", "", "")
    print("root", hex(r))
    print("root salted", hex(root_hash("tandem-kjv", "", 16, "f32", "secret", "")))
    print("root bs32", hex(root_hash("tandem-kjv", "", 32, "f32", "", "")))
    print("chain", [hex(h) for h in block_hashes(r, list(range(1, 41)), 16)])
    print("le", hex(xxhash.xxh3_64_intdigest(struct.pack("<4I", 0, 1, 0xFFFFFFFF, 70000), 0)))
