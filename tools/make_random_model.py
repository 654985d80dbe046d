#!/usr/bin/env python3
"""Writes a Hugging Face model directory with random bf16 weights and the
Llama-3-8B shape (config.json + sharded model.safetensors + index), for
throughput runs on a GPU (tests/gpu/device_check.sh). Nothing it writes is
meant to be committed; the output is ~16 GB for the full shape.

Standard library only (the device machine has no PyTorch/numpy). Speed:
one block of 1 Mi random bf16 values is made once and every tensor is that
block rotated by a per-tensor offset, so writing is disk-bound. Values are
uniform in [-0.02, 0.02) for matrices (finite, small: the logits stay
finite through 32 layers) and 1.0 for norms. The tokens such a model
produces are meaningless; only its shape and dtype matter.

    tools/make_random_model.py OUT_DIR [--layers 32] [--hidden 4096]
        [--intermediate 14336] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--vocab 128256] [--layers-per-shard 8]
"""
import argparse
import json
import os
import random
import struct
import sys

BLOCK = 1 << 20  # values in the random block


def bf16_block(amp: float, seed: int) -> bytes:
    rnd = random.Random(seed)
    out = bytearray(2 * BLOCK)
    for i in range(BLOCK):
        f = (rnd.random() * 2.0 - 1.0) * amp
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
        bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest even
        struct.pack_into("<H", out, 2 * i, (bits >> 16) & 0xFFFF)
    return bytes(out)


def write_tensor(f, numel: int, block: bytes, offset: int) -> None:
    """numel bf16 values: the block rotated by `offset` values, repeated."""
    rot = block[2 * offset:] + block[:2 * offset]
    left = 2 * numel
    while left > 0:
        n = min(left, len(rot))
        f.write(rot[:n])
        left -= n


def ones(numel: int) -> bytes:
    return struct.pack("<H", 0x3F80) * numel  # bf16 1.0


def tensors_of_shard(cfg, layers, first, last):
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = []
    if first:
        out.append(("model.embed_tokens.weight", [cfg["vocab_size"], h], "rand"))
    for i in layers:
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [h], "ones"),
            (p + "post_attention_layernorm.weight", [h], "ones"),
            (p + "self_attn.q_proj.weight", [q, h], "rand"),
            (p + "self_attn.k_proj.weight", [kv, h], "rand"),
            (p + "self_attn.v_proj.weight", [kv, h], "rand"),
            (p + "self_attn.o_proj.weight", [h, q], "rand"),
            (p + "mlp.gate_proj.weight", [inter, h], "rand"),
            (p + "mlp.up_proj.weight", [inter, h], "rand"),
            (p + "mlp.down_proj.weight", [h, inter], "rand"),
        ]
    if last:
        out.append(("model.norm.weight", [h], "ones"))
        out.append(("lm_head.weight", [cfg["vocab_size"], h], "rand"))
    return out


def write_shard(path, tensors, block, salt):
    header, offset = {}, 0
    for name, shape, _ in tensors:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * n]}
        offset += 2 * n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k, (name, shape, kind) in enumerate(tensors):
            n = header[name]["data_offsets"][1] // 2 - header[name]["data_offsets"][0] // 2
            if kind == "ones":
                f.write(ones(n))
            else:
                write_tensor(f, n, block, (salt * 7919 + k * 104729) % BLOCK)
    return offset


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--layers-per-shard", type=int, default=8)
    a = ap.parse_args()
    if min(a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.head_dim, a.vocab,
           a.layers_per_shard) <= 0 or a.heads % a.kv_heads:
        print("make_random_model.py: sizes must be > 0 and heads a multiple of kv-heads",
              file=sys.stderr)
        return 2
    os.makedirs(a.out_dir, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "_tandem_note": "random weights from tools/make_random_model.py: shape only, no meaning",
    }
    with open(os.path.join(a.out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    block = bf16_block(0.02, seed=1)
    layer_ids = list(range(a.layers))
    groups = [layer_ids[i:i + a.layers_per_shard] for i in range(0, a.layers, a.layers_per_shard)]
    weight_map, total = {}, 0
    for s, group in enumerate(groups):
        name = f"model-{s + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = tensors_of_shard(cfg, group, s == 0, s == len(groups) - 1)
        total += write_shard(os.path.join(a.out_dir, name), tensors, block, s)
        for t in tensors:
            weight_map[t[0]] = name
    with open(os.path.join(a.out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print(json.dumps({"out_dir": a.out_dir, "shards": len(groups), "bytes": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
