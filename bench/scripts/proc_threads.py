#!/usr/bin/env python3
"""Per-thread CPU time and context switches of processes, from /proc.

  proc_threads.py snap OUT.json PID...            record every thread of each PID
  proc_threads.py diff A.json B.json N [LABELS]   what each process (and each
      thread name) did between the snapshots, per unit (N units: prompts,
      seconds); LABELS names the PIDs in order, comma-separated.

CPU is /proc/PID/task/TID/schedstat (ns); wake-ups are voluntary context
switches (a thread that slept and was woken). Used for
bench/results/proxy_cost.md (issue 23).
"""
import collections
import json
import os
import sys


def snap(pid):
    d = {}
    for t in os.listdir(f'/proc/{pid}/task'):
        try:
            st = open(f'/proc/{pid}/task/{t}/stat').read()
            name = st[st.index('(') + 1:st.rindex(')')]
            ns = int(open(f'/proc/{pid}/task/{t}/schedstat').read().split()[0])
            v = nv = 0
            for line in open(f'/proc/{pid}/task/{t}/status'):
                if line.startswith('voluntary_ctxt_switches'):
                    v = int(line.split()[1])
                elif line.startswith('nonvoluntary_ctxt_switches'):
                    nv = int(line.split()[1])
            d[t] = (name, v, nv, ns)
        except (OSError, ValueError):
            pass  # the thread ended
    return d


def diff(a, b, n, labels):
    for i, p in enumerate(b):
        agg = collections.defaultdict(lambda: [0, 0, 0])
        for t, (name, v, nv, c) in b[p].items():
            v0, nv0, c0 = a[p][t][1:] if t in a.get(p, {}) else (0, 0, 0)
            agg[name][0] += v - v0
            agg[name][1] += nv - nv0
            agg[name][2] += c - c0
        tot = [sum(x[k] for x in agg.values()) for k in range(3)]
        label = labels[i] if i < len(labels) else p
        print(f'{label} {p}: wake-ups/unit {tot[0] / n:.1f} involuntary/unit {tot[1] / n:.1f} '
              f'cpu {tot[2] / 1e6:.1f} ms ({tot[2] / 1e6 / n:.3f} ms/unit)')
        for name, x in sorted(agg.items(), key=lambda kv: -kv[1][2]):
            if x[0] or x[2]:
                print(f'   {name:24s} wake-ups {x[0]:7d} ({x[0] / n:6.2f}/unit) '
                      f'involuntary {x[1]:5d} cpu {x[2] / 1e6:8.2f} ms ({x[2] / 1e3 / n:8.1f} us/unit)')


if __name__ == '__main__':
    if len(sys.argv) >= 3 and sys.argv[1] == 'snap':
        json.dump({p: snap(p) for p in sys.argv[3:]}, open(sys.argv[2], 'w'))
    elif len(sys.argv) >= 5 and sys.argv[1] == 'diff':
        diff(json.load(open(sys.argv[2])), json.load(open(sys.argv[3])), float(sys.argv[4]),
             sys.argv[5].split(',') if len(sys.argv) > 5 else [])
    else:
        sys.exit(__doc__)
