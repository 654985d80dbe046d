#!/usr/bin/env python3
"""Prefix-cache ideal and capacity curves of a Mooncake trace window, from
its hash_ids alone (issue 17; bench/results/kv_tiers_mooncake.md).

    bench/sim/kv_tiers_ideal.py [--trace FILE] [--skip N] [--num N]
        [--block-tokens 512] [--kv-block 16] [--max-len 131072]
        [--workers 4] [--device-blocks 26674] [--tiers 0,2,8]

- ideal: one unbounded cache. A request's cached tokens are its leading
  hash blocks already seen in the window (each 512 tokens), capped as the
  engine caps them: whole 16-token KV blocks, at most prompt - 1 tokens.
  Ratio = cached tokens / prompt tokens (prompts cut to --max-len, as
  `tandem bench serve` cuts them to the model's context).
- per capacity: --workers prefillers, each an LRU of `device_blocks x (1 + t)`
  KV blocks of 16 tokens (device + a host tier t times the device), routed
  to the worker holding the longest prefix (ties: least recently chosen —
  a stand-in for kv_aware) or round robin. This is an offline estimate,
  not the fleet: it ignores timing, decoders and the in-flight blocks.
"""
import argparse, json, os
from collections import OrderedDict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(path, skip, num):
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip:
                continue
            if num and len(out) >= num:
                break
            out.append(json.loads(line))
    return out


def blocks_of(rec, bt, kb, max_len):
    """(prompt tokens, list of KV-block keys) of one request."""
    n = min(rec["input_length"], max_len)
    keys = []
    per = bt // kb
    for i, h in enumerate(rec["hash_ids"]):
        for j in range(per):
            if (i * per + j + 1) * kb > n:
                return n, keys
            keys.append((h, j))
    return n, keys


def ideal(recs, a):
    seen, tot, hit = set(), 0, 0
    for r in recs:
        n, keys = blocks_of(r, a.block_tokens, a.kv_block, a.max_len)
        usable = (n - 1) // a.kv_block
        k = 0
        while k < min(len(keys), usable) and keys[k] in seen:
            k += 1
        # chained hashes: a block is reusable only after the whole chain before it
        tot += n
        hit += k * a.kv_block
        seen.update(keys)
    return hit / tot, tot


class Lru:
    def __init__(self, cap):
        self.cap, self.d = cap, OrderedDict()

    def prefix(self, keys, limit):
        k = 0
        while k < limit and keys[k] in self.d:
            k += 1
        return k

    def use(self, keys):
        for key in keys:
            if key in self.d:
                self.d.move_to_end(key)
            else:
                self.d[key] = None
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


def fleet(recs, a, cap, policy):
    caches = [Lru(cap) for _ in range(a.workers)]
    last = [0] * a.workers
    tot = hit = 0
    for t, r in enumerate(recs):
        n, keys = blocks_of(r, a.block_tokens, a.kv_block, a.max_len)
        usable = min(len(keys), (n - 1) // a.kv_block)
        if policy == "round_robin":
            w = t % a.workers
        else:
            w = max(range(a.workers), key=lambda i: (caches[i].prefix(keys, usable), -last[i]))
        last[w] = t + 1
        hit += caches[w].prefix(keys, usable) * a.kv_block
        tot += n
        caches[w].use(keys)
    return hit / tot


def main():
    ap = argparse.ArgumentParser()
    default_trace = os.path.join(ROOT, "..", "shared", "workloads", "mooncake_synthetic_trace.jsonl")
    if not os.path.exists(default_trace):  # a worktree under /work/wt/
        default_trace = "/work/shared/workloads/mooncake_synthetic_trace.jsonl"
    ap.add_argument("--trace", default=default_trace)
    ap.add_argument("--skip", "--trace-skip", dest="skip", type=int, default=0)
    ap.add_argument("--num", "--num-requests", dest="num", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--kv-block", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=131072 - 256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--device-blocks", type=int, default=26674)
    ap.add_argument("--tiers", default="0,2,8")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    recs = load(a.trace, a.skip, a.num)
    ratio, tot = ideal(recs, a)
    res = {"requests": len(recs), "prompt_tokens": tot, "ideal_cached_ratio": round(ratio, 4),
           "span_s": (recs[-1]["timestamp"] - recs[0]["timestamp"]) / 1000 if recs else 0, "lru": {}}
    for t in [float(x) for x in a.tiers.split(",")]:
        cap = int(a.device_blocks * (1 + t))
        res["lru"][f"host_{t:g}x"] = {p: round(fleet(recs, a, cap, p), 4) for p in ("prefix_affinity", "round_robin")}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"window: {res['requests']} requests from #{a.skip + 1}, {res['span_s']:.0f} s of trace, "
          f"{tot} prompt tokens")
    print(f"ideal (one unbounded cache): cached-prompt ratio {ratio:.3f}")
    for k, v in res["lru"].items():
        print(f"  {a.workers} x LRU, {k}: prefix-affinity {v['prefix_affinity']:.3f}, round_robin {v['round_robin']:.3f}")


if __name__ == "__main__":
    main()
