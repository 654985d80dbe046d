"""Sums the rows chaos_test appends to TANDEM_CHAOS_REPORT per kind of
fault (the SIGSTOP durations dropped from the name) into the table of
bench/results/chaos.md.  Usage: python3 summarize.py REPORT.md"""
import re
import sys

order, acc = [], {}
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 8 or cells[0].startswith("**"):
        continue
    kind = re.sub(r" \d+\.\d s, SIGCONT", " 1-5 s, SIGCONT", cells[0])
    if kind not in acc:
        order.append(kind)
        acc[kind] = {"n": 0, "sent": 0, "ok": 0, "failed": 0, "hung": 0, "mism": 0, "rec": [], "notes": set()}
    a = acc[kind]
    a["n"] += 1
    for key, i in (("sent", 1), ("ok", 2), ("failed", 3), ("hung", 4), ("mism", 5)):
        a[key] += int(cells[i])
    if cells[6].endswith(" ms"):
        a["rec"].append(int(cells[6][:-3]))
    if cells[7]:
        a["notes"].add(re.sub(r"\d+ (leases expired|stale notices|faults injected|caught)", r"N \1", cells[7]))

print("| fault | times | requests | completed (= reference) | failed with status | hung | mismatches | recovery (min-max) |")
print("|---|---|---|---|---|---|---|---|")
total = ok = 0
for kind in order:
    a = acc[kind]
    total += a["sent"]
    ok += a["ok"]
    rec = f"{min(a['rec'])}-{max(a['rec'])} ms" if a["rec"] else "—"
    print(f"| {kind} | {a['n']} | {a['sent']} | {a['ok']} | {a['failed']} | {a['hung']} | {a['mism']} | {rec} |")
print(f"| **all** | | {total} | {ok} ({100.0 * ok / max(total, 1):.3f} %) | | | | |")
