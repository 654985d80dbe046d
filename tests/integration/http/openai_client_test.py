"""The OpenAI-compatible HTTP API against a real 1P1D fleet of the bundled
model, with the official `openai` Python client: completions and chat,
streaming and not, usage, stop strings, seeds, greedy output equal to
`tandem generate`, every error status, client disconnects, /health, /metrics.
Run by ctest through venv.sh (label integration)."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import jinja2
import openai
import tokenizers

sys.path.insert(0, os.path.dirname(__file__))
import fleet as fl  # noqa: E402

KEY = "sk-tandem-test"
PROMPT = "In the beginning God created"
MAX_INFLIGHT = 6

checks = []


def check(fn):
    checks.append(fn)
    return fn


def client(key=KEY, base=None):
    return openai.OpenAI(base_url=base or F.base_url, api_key=key, max_retries=0, timeout=60)


def http_get(path, key=None):
    req = urllib.request.Request(f"http://{F.http}{path}")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def collect_stream(stream):
    text, finish, usage, chunks = "", None, None, 0
    for ch in stream:
        chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text += piece or ""
            if c.finish_reason:
                finish = c.finish_reason
    return text, finish, usage, chunks


@check
def models_and_health():
    models = client().models.list()
    assert [m.id for m in models.data] == ["tandem-kjv"], models
    status, body = http_get("/health")
    assert status == 200, (status, body)


@check
def completion_greedy_equals_tandem_generate():
    ref = fl.reference(prompt=PROMPT, max_tokens=24)
    r = client().completions.create(model="tandem-kjv", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"], (r.choices[0].text, ref["text"])
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    assert r.model == "tandem-kjv"
    assert r.usage.completion_tokens == len(ref["token_ids"]), r.usage
    assert r.usage.prompt_tokens == 6, r.usage  # BOS + 5 tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if len(ref["token_ids"]) == 24 else "stop")
    # A 54-token prompt sent twice: the second time the decoder already holds
    # its 3 full blocks (48 tokens), and usage says so.
    long = ("And it came to pass in those days, that there went out a decree from Caesar "
            "Augustus, that all the world should be taxed. And this taxing was first made "
            "when Cyrenius was governor of Syria.")
    first = client().completions.create(model="tandem-kjv", prompt=long, max_tokens=2, temperature=0)
    again = client().completions.create(model="tandem-kjv", prompt=long, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == 54, first.usage
    assert again.usage.prompt_tokens_details.cached_tokens == 48, again.usage
    # Prompt given as token ids: the same tokens.
    ids = client().completions.create(model="tandem-kjv", prompt=[1] + [262, 625], max_tokens=8,
                                      temperature=0)
    ref_ids = fl.reference(prompt_ids=[1, 262, 625], max_tokens=8)
    assert ids.choices[0].text == ref_ids["text"], (ids.choices[0].text, ref_ids)


@check
def completion_stream_with_usage():
    full = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=30,
                                       temperature=0, extra_body={"ignore_eos": True})
    stream = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=30,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    text, finish, usage, chunks = collect_stream(stream)
    assert text == full.choices[0].text, (text, full.choices[0].text)
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == 30 and usage.prompt_tokens == 6, usage
    assert chunks >= 10, chunks  # streamed, not one blob
    # Without include_usage no usage chunk arrives.
    _, _, usage2, _ = collect_stream(client().completions.create(
        prompt=PROMPT, model="tandem-kjv", max_tokens=5, temperature=0, stream=True))
    assert usage2 is None


def chat_reference_ids(messages):
    """The bundled model's own Jinja template rendered by jinja2 and encoded
    by Hugging Face tokenizers: an independent reference for tandem's
    renderer."""
    with open(os.path.join(fl.MODEL, "tokenizer_config.json")) as f:
        tmpl = json.load(f)["chat_template"]
    text = jinja2.Environment().from_string(tmpl).render(messages=messages, add_generation_prompt=True)
    tok = tokenizers.Tokenizer.from_file(os.path.join(fl.MODEL, "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


@check
def chat_greedy_equals_tandem_generate_on_the_jinja_rendering():
    messages = [{"role": "system", "content": "Speak as the scripture."},
                {"role": "user", "content": "Who made the heaven and the earth?"}]
    ids = chat_reference_ids(messages)
    ref = fl.reference(prompt_ids=ids, max_tokens=20)
    r = client().chat.completions.create(model="tandem-kjv", messages=messages, max_tokens=20,
                                         temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"], (r.choices[0].message.content, ref["text"])
    assert r.usage.prompt_tokens == len(ids), (r.usage, len(ids))
    stream = client().chat.completions.create(model="tandem-kjv", messages=messages,
                                              max_completion_tokens=20, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    text, finish, usage, _ = collect_stream(stream)
    assert text == ref["text"], (text, ref["text"])
    assert finish == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == len(ids)


@check
def stop_strings():
    base = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=30,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    # A stop string from the middle of the greedy text: the output ends just before it.
    words = base.split()
    stop = words[len(words) // 2]
    cut = base[:base.index(stop)]
    for stream in (False, True):
        r = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=30,
                                        temperature=0, stop=[stop], stream=stream,
                                        extra_body={"ignore_eos": True})
        text, finish = (collect_stream(r)[:2] if stream
                        else (r.choices[0].text, r.choices[0].finish_reason))
        assert text == cut, (stream, stop, text, cut)
        assert finish == "stop", (stream, finish)
    chat = client().chat.completions.create(model="tandem-kjv", max_tokens=30, temperature=0,
                                            messages=[{"role": "user", "content": "And God said"}],
                                            stop="\n")
    assert "\n" not in chat.choices[0].message.content


@check
def seeds_reproducible():
    def sample(seed):
        return client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=20,
                                           temperature=1.0, seed=seed,
                                           extra_body={"ignore_eos": True}).choices[0].text
    a, b = sample(1234), sample(1234)
    assert a == b, (a, b)
    others = {sample(s) for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds gave the same text every time"
    # Streamed with the same seed: the same text.
    s = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=20, temperature=1.0,
                                    seed=1234, stream=True, extra_body={"ignore_eos": True})
    assert collect_stream(s)[0] == a


@check
def status_400_names_the_field():
    cases = [
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=5000), "max_tokens"),
        (dict(n=2), "n"),
        (dict(top_p=1.5), "top_p"),
        (dict(extra_body={"logprobs": 3}), "logprobs"),
    ]
    for kwargs, field in cases:
        try:
            client().completions.create(prompt=PROMPT, model="tandem-kjv", **kwargs)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            assert field in e.message, (field, e.message)
            assert e.body["param"] == field, (field, e.body)
        else:
            raise AssertionError(f"{kwargs} was accepted")
    try:
        client().chat.completions.create(model="tandem-kjv", messages=[{"role": "wizard", "content": "x"}])
    except openai.BadRequestError as e:
        assert "messages[0].role" in e.message, e.message
    else:
        raise AssertionError("a bad role was accepted")
    # A prompt longer than the context names both numbers.
    try:
        client().completions.create(model="tandem-kjv", prompt=[5] * 1100, max_tokens=1)
    except openai.BadRequestError as e:
        assert "1100" in e.message and "1024" in e.message, e.message
    else:
        raise AssertionError("an over-long prompt was accepted")
    # Raw: not JSON at all.
    req = urllib.request.Request(f"{F.base_url}/completions", data=b"{nope",
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("invalid JSON accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "not valid JSON" in e.read().decode()


@check
def status_401_without_the_key():
    for key in ("wrong-key", ""):
        try:
            client(key=key or "none").models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401
            assert e.body["code"] == "invalid_api_key", e.body
        else:
            raise AssertionError(f"key {key!r} accepted")
    status, _ = http_get("/v1/models")  # no header at all
    assert status == 401
    # /health and /metrics are not behind the key (probes and Prometheus).
    assert http_get("/health")[0] == 200 and http_get("/metrics")[0] == 200
    # The gRPC API takes the same key as `authorization` metadata.
    grpc = F.state["proxy"]["grpc"]
    ok = subprocess.run([fl.BINARY, "client", "--proxy", grpc, "--prompt", PROMPT, "--max-tokens", "3",
                         "--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([fl.BINARY, "client", "--proxy", grpc, "--prompt", PROMPT, "--max-tokens", "3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "API key" in (bad.stderr + bad.stdout), (bad.returncode, bad.stderr)


@check
def status_404_unknown_model_and_route():
    try:
        client().completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    except openai.NotFoundError as e:
        assert e.status_code == 404 and "gpt-4o" in e.message and "tandem-kjv" in e.message, e.message
    else:
        raise AssertionError("unknown model accepted")
    assert http_get("/v1/nothing", key=KEY)[0] == 404


def open_streams(n, max_tokens=1000):
    """n streaming requests that each got their first chunk (admitted)."""
    streams = []
    for _ in range(n):
        s = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=max_tokens,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(s))
        streams.append(s)
    return streams


def metric(name):
    return fl.metric_value(fl.scrape(F.state["proxy"]["metrics"]), name)


@check
def status_429_when_full_and_disconnects_free_everything():
    deadline = time.time() + 10  # earlier checks' requests are released (gRPC's OnDone lags)
    while metric("tandem_requests_inflight") > 0 and time.time() < deadline:
        time.sleep(0.05)
    streams = open_streams(MAX_INFLIGHT)
    try:
        client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=2)
    except openai.RateLimitError as e:
        assert e.status_code == 429 and "max_inflight" in e.message, e.message
    else:
        raise AssertionError("request past proxy.max_inflight accepted")
    # Clients disconnect mid-stream: every request is cancelled, every block freed.
    for s in streams:
        s.close()
    deadline = time.time() + 20
    while metric("tandem_requests_inflight") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metric("tandem_requests_inflight") == 0
    held = fl.wait_workers_idle(F)
    assert not held, f"after disconnects the workers still hold: {held}"
    # ... and the proxy admits again.
    r = client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


@check
def disconnect_of_a_non_streaming_request_cancels_it():
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}).encode()
    host, port = F.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() +
              f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.time() + 10
    while metric("tandem_requests_inflight") < 1 and time.time() < deadline:
        time.sleep(0.02)
    assert metric("tandem_requests_inflight") == 1
    s.close()
    deadline = time.time() + 10
    while metric("tandem_requests_inflight") > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert metric("tandem_requests_inflight") == 0
    assert not fl.wait_workers_idle(F)


@check
def metrics_same_as_the_metrics_port():
    status, text = http_get("/metrics")
    assert status == 200
    # The same registry's families; the metrics port adds prometheus-cpp's own exposer_* ones.
    names = lambda t: {l.split(" ")[2] for l in t.splitlines()  # noqa: E731
                       if l.startswith("# TYPE tandem_")}
    port = fl.scrape(F.state["proxy"]["metrics"])
    assert names(text) == names(port), names(text) ^ names(port)
    for n in ("tandem_time_to_first_token_seconds", "tandem_requests_total", "tandem_requests_inflight"):
        assert n in names(text), n
    # HEAD (probes use it) answers like GET without a body, so the next
    # response on the same keep-alive connection is not corrupted.
    import http.client
    conn = http.client.HTTPConnection(*F.http.rsplit(":", 1), timeout=10)
    for method in ("HEAD", "GET"):
        conn.request(method, "/metrics")
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, (method, r.status)
        assert (body == b"") == (method == "HEAD"), (method, len(body))
    conn.close()


@check
def clients_that_hang_up_early_do_not_hurt_the_server():
    # Regression: a client closing right after its request (response still
    # being written) once made the proxy free a write buffer twice.
    host, port = F.http.rsplit(":", 1)

    def hammer(k):
        for j in range(40):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                method = ("HEAD", "GET")[(k + j) % 2]
                path = ("/metrics", "/health")[j % 2]
                s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                if j % 3 == 0:
                    s.recv(64)
    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert http_get("/health")[0] == 200
    assert client().models.list().data[0].id == "tandem-kjv"


@check
def status_503_while_starting():
    # A proxy with no workers: /health says starting, requests get 503.
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    cfg = os.path.join(F.dir, "alone.yaml")
    with open(cfg, "w") as f:
        f.write(fl.config_text(proxy_extra="  http_idle_timeout_seconds: 1"))
    log_path = os.path.join(F.dir, "alone-proxy.log")

    def start():
        # The port was free a moment ago; another test's connection may take
        # it before the proxy binds it (then the proxy exits, and the check
        # starts it again on another port, at most three times).
        http = f"127.0.0.1:{free_port()}"
        # Started by hand, the proxy needs an internal-plane identity (mutual TLS by default).
        with open(log_path, "w") as log:
            p = subprocess.Popen([fl.BINARY, "proxy", "--config", cfg, "--http", http, "--grpc",
                                  "127.0.0.1:0", "--metrics", "127.0.0.1:0", *fl.tls_args(F.state)],
                                 stdout=subprocess.DEVNULL, stderr=log)
        fl.reap_on_exit(p.pid)
        return http, p

    http, p = start()
    starts = 1
    try:
        deadline = time.time() + 30
        status, body = None, ""
        while time.time() < deadline:
            if p.poll() is not None:
                fl.forget(p.pid)
                with open(log_path) as log:
                    why = log.read()[-2000:]
                assert starts < 3, f"the proxy exited ({p.returncode}) {starts} times; last log:\n{why}"
                print(f"proxy on {http} exited ({p.returncode}), started again:\n{why}")
                http, p = start()
                starts += 1
                continue
            try:
                with urllib.request.urlopen(f"http://{http}/health", timeout=2) as r:
                    status, body = r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                status, body = e.code, e.read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            break
        if status is None:
            with open(log_path) as log:
                raise AssertionError(f"the proxy on {http} did not answer /health within 30 s; its "
                                     f"log:\n{log.read()[-2000:]}")
        assert status == 503 and "starting" in body, (status, body)
        try:
            openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0).completions.create(
                model="tandem-kjv", prompt=PROMPT, max_tokens=2)
        except openai.APIStatusError as e:
            assert e.status_code == 503, (e.status_code, e.message)
        else:
            raise AssertionError("a proxy without workers served a request")
        # proxy.http_idle_timeout_seconds: an idle keep-alive connection and a
        # client that never finishes its request are both closed.
        host, port = http.rsplit(":", 1)
        t0 = time.time()
        idle = socket.create_connection((host, int(port)), timeout=10)
        slow = socket.create_connection((host, int(port)), timeout=10)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never end
        assert idle.recv(1) == b"" and slow.recv(1) == b""
        waited = time.time() - t0
        assert 0.9 < waited < 8, waited
        idle.close()
        slow.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        fl.forget(p.pid)


@check
def status_503_while_draining():
    # Last check: it stops the fleet. A long stream keeps the proxy draining.
    stream = open_streams(1, max_tokens=1000)[0]
    os.kill(F.state["proxy"]["pid"], signal.SIGTERM)
    deadline = time.time() + 5
    status = None
    while time.time() < deadline:
        status, body = http_get("/health")
        if status == 503:
            break
        time.sleep(0.02)
    assert status == 503 and "draining" in body, (status, body)
    try:
        client().completions.create(prompt=PROMPT, model="tandem-kjv", max_tokens=2)
    except openai.APIStatusError as e:
        assert e.status_code == 503 and "draining" in e.message, (e.status_code, e.message)
    else:
        raise AssertionError("a draining proxy accepted a request")
    stream.close()


def main():
    global F
    F = fl.Fleet(proxy_extra=f"  api_key: {KEY}\n  max_inflight: {MAX_INFLIGHT}")
    failed = []
    try:
        for fn in checks:
            t0 = time.time()
            try:
                fn()
                print(f"PASS {fn.__name__} ({time.time() - t0:.1f} s)", flush=True)
            except Exception:  # noqa: BLE001
                failed.append(fn.__name__)
                print(f"FAIL {fn.__name__}\n{traceback.format_exc()}", flush=True)
    finally:
        F.stop()
    if failed:
        print(f"{len(failed)} of {len(checks)} checks failed: {failed}; fleet log: {F.log.name}")
        return 1
    print(f"all {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
