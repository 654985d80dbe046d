"""security.public_tls: auto against a real 1P1D fleet (docs/security.md):
plaintext HTTP and gRPC fail; HTTPS with the state file's public_ca_file
works with curl and the official `openai` client, gRPC with
`tandem client --tls-ca`; a certificate renewed with `tandem certs` and
SIGHUP reaches new connections while an open stream runs to its end.
Run by ctest through venv.sh (label integration)."""
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import openai

sys.path.insert(0, os.path.dirname(__file__))
import fleet as fl  # noqa: E402

PROMPT = "In the beginning God created"


def peer_cert(address, ca):
    """The DER certificate the server presents to a new TLS connection (verified)."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            return s.getpeercert(binary_form=True)


def main():
    f = fl.Fleet(extra="security:\n  public_tls: auto\n")
    try:
        ca = f.state["public_ca_file"]
        http, grpc = f.state["proxy"]["http"], f.state["proxy"]["grpc"]
        assert os.stat(ca).st_mode & 0o777 == 0o600, oct(os.stat(ca).st_mode)

        # Plaintext HTTP: the TLS listener closes the connection without an HTTP answer.
        try:
            urllib.request.urlopen(f"http://{http}/health", timeout=10)
        except (OSError, ConnectionError) as e:
            print(f"plaintext HTTP refused: {type(e).__name__}")
        else:
            raise AssertionError("plaintext HTTP was answered")

        # curl: without the CA the certificate is not trusted; with it, /health answers.
        bad = subprocess.run(["curl", "-sS", f"https://{http}/health"], capture_output=True, text=True)
        assert bad.returncode == 60, (bad.returncode, bad.stderr)  # peer certificate not trusted
        ok = subprocess.run(["curl", "-sS", "--fail", "--cacert", ca, f"https://{http}/health"],
                            capture_output=True, text=True)
        assert ok.returncode == 0, (ok.returncode, ok.stderr)
        print("curl --cacert: /health", ok.stdout.strip()[:60])

        # The official client over HTTPS (certificate verified against the CA, host 127.0.0.1).
        client = openai.OpenAI(base_url=f"https://{http}/v1", api_key="x", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)))
        r = client.completions.create(model="tandem-kjv", prompt=PROMPT, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5, r.usage
        print("openai over https:", repr(r.choices[0].text))

        # gRPC: plaintext fails, TLS with the CA works.
        plain = subprocess.run([fl.BINARY, "client", "--proxy", grpc, "--prompt", PROMPT, "--max-tokens", "3"],
                               capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1 and "error 14" in plain.stderr, (plain.returncode, plain.stderr)
        tls = subprocess.run([fl.BINARY, "client", "--proxy", grpc, "--tls-ca", ca, "--prompt", PROMPT,
                              "--max-tokens", "3"], capture_output=True, text=True, timeout=60)
        assert tls.returncode == 0 and "3 completion tokens" in tls.stderr, (tls.returncode, tls.stderr)
        print("tandem client --tls-ca:", tls.stderr.strip())

        # Renewal: a stream opened before SIGHUP finishes; new connections get the new certificate.
        before = peer_cert(http, ca)
        stream = client.completions.create(model="tandem-kjv", prompt=PROMPT, max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)  # the stream is open
        sec_dir = os.path.join(f.state["security_dir"], "public")
        issued = subprocess.run([fl.BINARY, "certs", "--dir", sec_dir, "--name", "proxy", "--host", "127.0.0.1"],
                                capture_output=True, text=True)
        assert issued.returncode == 0, issued.stderr
        os.kill(f.state["proxy"]["pid"], signal.SIGHUP)
        deadline = time.time() + 20
        while peer_cert(http, ca) == before:
            assert time.time() < deadline, "the renewed certificate was not served after SIGHUP"
            time.sleep(0.1)
        text = (first.choices[0].text if first.choices else "")
        finish = None
        for ch in it:
            for c in ch.choices:
                text += c.text or ""
                finish = c.finish_reason or finish
        assert finish == "length", finish
        print(f"stream across SIGHUP: {len(text)} characters, finish_reason {finish}")
        # gRPC re-reads the files on its own (RpcCredentials::kReloadSeconds).
        tls = subprocess.run([fl.BINARY, "client", "--proxy", grpc, "--tls-ca", ca, "--prompt", PROMPT,
                              "--max-tokens", "2"], capture_output=True, text=True, timeout=60)
        assert tls.returncode == 0, tls.stderr
        print("public_tls: all checks passed")
    finally:
        f.stop()


if __name__ == "__main__":
    main()
