"""A real fleet for the HTTP API's Python tests: `tandem launch` on a
generated config (ports picked by the kernel, loopback only), its state file,
metric scraping and `tandem generate --json` as the reference.

Every process started here is registered with this test process's reaper
(as tests/integration/fleet/reaper.h does for the C++ tests): a small Python
process reading a pipe whose only write end is here. When the test process
dies, however, the pipe ends and the reaper SIGKILLs what is still
registered (and its process group), stopped processes included."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SOURCE_DIR = os.environ.get("TANDEM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "../../.."))
BINARY = os.environ.get("TANDEM_BIN", os.path.join(SOURCE_DIR, "build", "tandem"))
MODEL = os.path.abspath(os.path.join(SOURCE_DIR, "models", "tandem-kjv"))


_REAPER = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
pids = set()
for line in sys.stdin:  # until end of file: the test process is gone
    line = line.strip()
    if line[:1] == "+":
        pids.add(int(line[1:]))
    elif line[:1] == "-":
        pids.discard(int(line[1:]))
for pid in pids:
    for kill, target in ((os.killpg, pid), (os.kill, pid)):  # its group when it leads one
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            pass
"""
_reaper = None
_reaper_lock = threading.Lock()


def _tell_reaper(line):
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            # Its own session: a ^C to the test's process group does not reach it.
            _reaper = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True, text=True)
        _reaper.stdin.write(line + "\n")
        _reaper.stdin.flush()


def reap_on_exit(pid):
    """SIGKILL `pid` (and its process group) if this test process dies first."""
    _tell_reaper(f"+{pid}")


def forget(pid):
    """`pid` was stopped and reaped normally: its number may be reused."""
    _tell_reaper(f"-{pid}")


def config_text(proxy_extra="", num_blocks=512, max_num_seqs=64, http="127.0.0.1:0", extra=""):
    return f"""model:
  path: {MODEL}
  backend: cpu
cache:
  block_size: 16
  num_blocks: {num_blocks}
scheduler:
  max_num_seqs: {max_num_seqs}
  max_batched_tokens: 256
  max_waiting: 1024
proxy:
  grpc: 127.0.0.1:0
  http: {http}
  metrics: 127.0.0.1:0
{proxy_extra}
router:
  policy: round_robin
logging:
  level: warn
prefill:
  replicas: 1
decode:
  replicas: 1
{extra}"""


def tls_args(state):
    """--tls-ca/--tls-cert/--tls-key from a state file's `tls` entry (the
    internal plane's mutual TLS; none when security.internal_tls is off)."""
    t = state.get("tls")
    if not t:
        return []
    return ["--tls-ca", t["ca_file"], "--tls-cert", t["cert_file"], "--tls-key", t["key_file"]]


class Fleet:
    def __init__(self, proxy_extra="", num_blocks=512, max_num_seqs=64, timeout=90, extra=""):
        self.dir = tempfile.mkdtemp(prefix="tandem_http_")
        self.config = os.path.join(self.dir, "fleet.yaml")
        with open(self.config, "w") as f:
            f.write(config_text(proxy_extra, num_blocks, max_num_seqs, extra=extra))
        self.state_path = os.path.join(self.dir, "state.json")
        self.log = open(os.path.join(self.dir, "launch.log"), "w")
        self.proc = subprocess.Popen([BINARY, "launch", self.config, "--state-file", self.state_path],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.pids = [self.proc.pid]
        reap_on_exit(self.proc.pid)
        deadline = time.time() + timeout
        while not os.path.exists(self.state_path):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"tandem launch did not become ready; log: {self.log.name}")
            time.sleep(0.1)
        # No settle time: the launcher renames the state file into place complete.
        with open(self.state_path) as f:
            self.state = json.load(f)
        for p in [self.state["proxy"].get("pid")] + [w.get("pid") for w in self.state["workers"]]:
            if p and p > 0:
                self.pids.append(p)
                reap_on_exit(p)
        self.http = self.state["proxy"]["http"]
        self.base_url = f"http://{self.http}/v1"

    def worker_metrics(self):
        return [w["metrics"] for w in self.state["workers"]]

    def stop(self, grace=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                for p in self.pids[1:]:  # what is left (a stopped worker ignores SIGTERM)
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.kill()
                self.proc.wait()
        # The launcher is gone and has stopped its proxy and workers.
        for p in self.pids:
            forget(p)
        self.pids = []
        self.log.close()


def scrape(address):
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text, name):
    """Sum of the samples of `name` (any labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            total += float(value)
    return total


def wait_workers_idle(fleet, timeout=20):
    """Waits until no worker holds KV blocks, reservations or requests; returns what is held."""
    names = ["tandem_kv_cache_usage_ratio", "tandem_num_requests_running",
             "tandem_num_requests_waiting", "tandem_kv_reservations", "tandem_kv_parked_prefills"]
    deadline = time.time() + timeout
    while True:
        held = {}
        for addr in fleet.worker_metrics():
            text = scrape(addr)
            for n in names:
                v = metric_value(text, n)
                if v:
                    held[f"{addr} {n}"] = v
        if not held or time.time() > deadline:
            return held
        time.sleep(0.1)


def reference(prompt=None, prompt_ids=None, max_tokens=16):
    args = [BINARY, "generate", "--model", MODEL, "--max-tokens", str(max_tokens),
            "--temperature", "0", "--json"]
    if prompt is not None:
        args += ["--prompt", prompt]
    else:
        args += ["--prompt-ids", ",".join(map(str, prompt_ids))]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])
