"""Distributed tracing against a real 1P1D CPU fleet (docs/observability.md):
the fleet exports over TLS (observability.otlp_tls) to a test OTLP/gRPC
receiver (otlp_receiver.py) with observability.trace_sample_ratio 0, so only
a client's sampled traceparent is traced.

- An HTTP request with a sampled `traceparent` header and a gRPC request
  with a sampled `traceparent` metadata entry: the receiver gets spans from
  the proxy, the prefiller and the decoder, all in the client's trace,
  linked parent to child (client -> proxy request -> prefill/decode;
  prefill -> decode.reserve), with each process's resource and the
  attributes of docs/observability.md (routing: the chosen pair and the
  predicted hit).
- Requests without a traceparent and with an unsampled one (flags 00): no
  span of theirs reaches the receiver, checked after the fleet has stopped
  (every process flushes its queue as it exits).
Run by ctest through tests/integration/http/venv.sh (label integration)."""
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "http"))
import fleet as fl  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
_serial = [0]


def prompt():
    """A prompt of its own for each request: it shares no KV block with the
    others, so every traced request pushes KV to the decoder."""
    _serial[0] += 1
    return f"Verse {_serial[0]}: {PROMPT}"
SERVER, INTERNAL = 2, 1  # OTLP SpanKind


def traceparent(sampled=True):
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def http_completion(f, header=None):
    body = json.dumps({"model": "tandem-kjv", "prompt": prompt(), "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{f.base_url}/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    if header:
        req.add_header("traceparent", header)
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.load(r)
    assert out["usage"]["completion_tokens"] == 8, out
    return out


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def grpc_generate(f, header=None):
    """tandem.v1.Generation/Generate with a hand-encoded GenerateRequest
    (prompt = 3, max_tokens = 5, ignore_eos = 9: sampled at the default
    temperature, an EOS could otherwise end it before its 8 tokens);
    returns the number of response messages."""
    text = prompt().encode()
    req = b"\x1a" + _varint(len(text)) + text + b"\x28" + _varint(8) + b"\x48\x01"
    with grpc.insecure_channel(f.state["proxy"]["grpc"]) as ch:
        call = ch.unary_stream("/tandem.v1.Generation/Generate")
        md = [("traceparent", header)] if header else None
        responses = list(call(req, metadata=md, timeout=60))
    assert len(responses) >= 2, responses  # tokens, then the finish with usage
    return len(responses)


EXPECTED = {
    "tandem-proxy": {"tandem.request", "tandem.admission", "tandem.route", "tandem.stream"},
    "tandem-prefill": {"tandem.prefill", "tandem.prefill.queue", "tandem.prefill.reserve",
                       "tandem.prefill.compute", "tandem.kv.push"},
    "tandem-decode": {"tandem.decode", "tandem.decode.reserve"},
}


def complete(trace_id):
    def pred(spans):
        seen = {}
        for s in spans:
            if s.trace_id == trace_id:
                seen.setdefault(s.service, set()).add(s.name)
        return all(names <= seen.get(svc, set()) for svc, names in EXPECTED.items())
    return pred


def check_trace(spans, trace_id, client_span, names):
    mine = [s for s in spans if s.trace_id == trace_id]
    by_name = {}
    for s in mine:
        by_name.setdefault(s.name, []).append(s)
    for svc, expected in EXPECTED.items():
        got = {s.name for s in mine if s.service == svc}
        assert expected <= got, (svc, expected - got, mine)
    # Each process reports its own resource.
    (req,) = by_name["tandem.request"]
    assert req.service == "tandem-proxy" and req.instance == names["proxy"], req
    assert req.kind == SERVER and req.parent_span_id == client_span, req
    assert not req.error and req.attributes["tandem.completion_tokens"] == 8, req
    (prefill,) = by_name["tandem.prefill"]
    (decode,) = by_name["tandem.decode"]
    (reserve,) = by_name["tandem.decode.reserve"]
    assert prefill.instance == names["prefill"] and decode.instance == names["decode"], (prefill, decode)
    assert reserve.instance == names["decode"], reserve
    # Propagation: proxy -> prefiller and proxy -> decoder, prefiller -> decoder.
    assert prefill.parent_span_id == req.span_id, (prefill, req)
    assert decode.parent_span_id == req.span_id, (decode, req)
    assert reserve.parent_span_id == prefill.span_id, (reserve, prefill)
    for n in ("tandem.admission", "tandem.route", "tandem.stream"):
        assert all(s.parent_span_id == req.span_id for s in by_name[n]), by_name[n]
    for n in ("tandem.prefill.queue", "tandem.prefill.reserve", "tandem.prefill.compute", "tandem.kv.push"):
        (s,) = by_name[n]
        assert s.parent_span_id == prefill.span_id and s.instance == names["prefill"], s
        assert prefill.start <= s.start <= s.end <= prefill.end, (s, prefill)
    # Routing: the chosen pair and the predicted hit.
    (route,) = by_name["tandem.route"]
    assert route.attributes["tandem.route.prefill"] == names["prefill"], route
    assert route.attributes["tandem.route.decode"] == names["decode"], route
    assert route.attributes["tandem.route.local_prefill"] is False, route
    assert route.attributes["tandem.route.predicted_hit_tokens"] >= 0, route
    # The push moved the prompt's blocks the decoder lacked.
    (push,) = by_name["tandem.kv.push"]
    assert push.attributes["tandem.kv.blocks"] >= 1 and push.attributes["tandem.kv.bytes"] > 0, push
    assert by_name["tandem.stream"][0].attributes["tandem.completion_tokens"] == 8
    assert decode.attributes["tandem.completion_tokens"] == 8, decode
    assert req.start <= prefill.start and decode.end <= req.end + 5_000_000_000, (req, decode)
    return len(mine)


def collector_tls(directory):
    """A CA and the collector's certificate for 127.0.0.1, issued by
    `tandem certs`: returns (ca file, certificate PEM, key PEM)."""
    subprocess.run([fl.BINARY, "certs", "--dir", directory, "--name", "collector", "--host",
                    "127.0.0.1"], check=True, capture_output=True)
    read = lambda name: open(os.path.join(directory, name), "rb").read()  # noqa: E731
    return os.path.join(directory, "ca.pem"), read("collector.pem"), read("collector.key")


def main():
    # The collector serves TLS (observability.otlp_tls); tracing_otlp_test
    # covers plaintext and mutual TLS against a TraceService of its own.
    tls_dir = tempfile.mkdtemp(prefix="tandem-otlp-")
    ca_file, cert, key = collector_tls(tls_dir)
    rx = Receiver(tls=(cert, key))
    f = fl.Fleet(extra=f"observability:\n  otlp_endpoint: {rx.endpoint}\n  trace_sample_ratio: 0\n"
                       f"  otlp_tls:\n    ca_file: {ca_file}\n")
    try:
        workers = {w["role"]: w for w in f.state["workers"]}
        names = {"proxy": "proxy-" + f.state["proxy"]["grpc"].rsplit(":", 1)[1],
                 "prefill": workers["prefill"]["name"], "decode": workers["decode"]["name"]}
        # Not traced: no traceparent (ratio 0), and a client's unsampled one.
        _, _, unsampled = traceparent(sampled=False)
        http_completion(f)
        http_completion(f, unsampled)
        grpc_generate(f)
        grpc_generate(f, unsampled)
        # Traced: the client's sampled traceparent, on both APIs.
        t_http, s_http, h_http = traceparent()
        t_grpc, s_grpc, h_grpc = traceparent()
        http_completion(f, h_http)
        grpc_generate(f, h_grpc)
        for t in (t_http, t_grpc):
            spans = rx.wait_for(complete(t), timeout=30)
            assert complete(t)(spans), ("spans missing", t, spans)
    finally:
        f.stop()
    # The fleet has exited (each process flushed its queue): every span
    # received belongs to one of the two sampled requests.
    spans, exports = rx.snapshot()
    rx.stop()
    n_http = check_trace(spans, t_http, s_http, names)
    n_grpc = check_trace(spans, t_grpc, s_grpc, names)
    others = [s for s in spans if s.trace_id not in (t_http, t_grpc)]
    assert not others, others
    shutil.rmtree(tls_dir, ignore_errors=True)
    print(f"traced: {n_http} spans (HTTP traceparent), {n_grpc} spans (gRPC metadata) in "
          f"{exports} exports; untraced requests: 0 spans")
    print("OK")


if __name__ == "__main__":
    main()
