"""Load test: N concurrent SSE streams held open on the proxy's HTTP API
(default 1,000), over loopback against a launched 1P1D fleet of the bundled
model. Bounded in count and time. Every stream must end with a usage event
and `data: [DONE]` and carry exactly max_tokens tokens; reports the proxy's
RSS before, at the peak of open streams, and per open stream.

  python3 tests/integration/http/sse_streams_load.py [--streams 1000] [--max-tokens 32]
     (TANDEM_BIN=build/tandem by default)
Stdlib only (asyncio), so it runs without a virtual environment."""
import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import fleet as fl  # noqa: E402


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Stats:
    def __init__(self):
        self.connected = 0   # request sent
        self.open = 0        # request sent, stream not finished: held open by the proxy
        self.peak_open = 0
        self.streaming = 0   # headers (first token) seen, not finished
        self.peak_streaming = 0
        self.done = 0
        self.errors = []


async def one_stream(i, host, port, max_tokens, stats, deadline):
    body = json.dumps({"model": "tandem-kjv", "prompt": f"And the {i} sons of", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    counted = streaming = False
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        stats.connected += 1
        stats.open += 1
        counted = True
        stats.peak_open = max(stats.peak_open, stats.open)
        status = await asyncio.wait_for(reader.readline(), deadline - time.time())
        if b" 200 " not in status:
            rest = await asyncio.wait_for(reader.read(4096), 5)
            stats.errors.append(f"stream {i}: {status!r} {rest[-300:]!r}")
            return
        stats.streaming += 1
        streaming = True
        stats.peak_streaming = max(stats.peak_streaming, stats.streaming)
        # Headers, then chunked SSE: read lines until [DONE].
        usage, saw_done = None, False
        while time.time() < deadline:
            line = await asyncio.wait_for(reader.readline(), deadline - time.time())
            if not line:
                break
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    saw_done = True
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    stats.errors.append(f"stream {i}: {ev['error']}")
                if ev.get("usage"):
                    usage = ev["usage"]
        if not saw_done or not usage or usage["completion_tokens"] != max_tokens:
            stats.errors.append(f"stream {i}: done={saw_done} usage={usage}")
        else:
            stats.done += 1
    except Exception as e:  # noqa: BLE001
        stats.errors.append(f"stream {i}: {type(e).__name__} {e}")
    finally:
        if counted:
            stats.open -= 1
        if streaming:
            stats.streaming -= 1
        writer.close()


async def run(args):
    f = fl.Fleet(proxy_extra="  max_inflight: 2048", num_blocks=args.streams * 4 + 512,
                 max_num_seqs=min(4096, args.streams + 64))
    try:
        host, port = f.http.rsplit(":", 1)
        pid = f.state["proxy"]["pid"]
        # Warm up (first request allocates lazily initialised state).
        await asyncio.wait_for(one_stream(-1, host, int(port), 4, Stats(), time.time() + 60), 60)
        before = rss_kib(pid)
        stats = Stats()
        deadline = time.time() + args.timeout
        t0 = time.time()
        tasks = [asyncio.create_task(one_stream(i, host, int(port), args.max_tokens, stats, deadline))
                 for i in range(args.streams)]
        peak_rss, rss_at_peak_open, samples = 0, 0, []
        while not all(t.done() for t in tasks) and time.time() < deadline + 5:
            await asyncio.sleep(0.2)
            r = rss_kib(pid)
            samples.append((round(time.time() - t0, 1), stats.open, r))
            peak_rss = max(peak_rss, r)
            if stats.open >= stats.peak_open:
                rss_at_peak_open = max(rss_at_peak_open, r)
        await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.time() - t0
        after = rss_kib(pid)
        per_stream = (peak_rss - before) / max(1, stats.peak_open)  # conservative: the peak RSS
        print(json.dumps({
            "streams": args.streams, "max_tokens": args.max_tokens, "completed": stats.done,
            "errors": len(stats.errors), "peak_open_streams": stats.peak_open,
            "peak_streams_past_first_token": stats.peak_streaming,
            "proxy_rss_kib_before": before, "proxy_rss_kib_at_peak_open": rss_at_peak_open,
            "proxy_rss_kib_peak": peak_rss, "proxy_rss_kib_after": after,
            "kib_per_open_stream": round(per_stream, 1), "elapsed_s": round(elapsed, 1),
        }, indent=1))
        print("samples (t s, open streams, proxy RSS KiB):", samples[:: max(1, len(samples) // 15)])
        for e in stats.errors[:10]:
            print("error:", e)
        held = fl.wait_workers_idle(f)
        if held:
            print("workers still hold:", held)
        return 0 if (not stats.errors and stats.done == args.streams and
                     stats.peak_open >= args.streams * args.min_open_fraction and not held) else 1
    finally:
        f.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--min-open-fraction", type=float, default=0.95,
                    help="fail unless this fraction of the streams were open at once")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
