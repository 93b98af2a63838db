"""HTTP clients side by side: client CPU per call and wall time with many calls in flight.

    python bench/http_clients.py [CLIENT...] [--calls 1536] [--in-flight 32 256] [--rounds 3] [--tls]

Each client POSTs an OpenAI-style body to the fake model server
(`tests/support/fakeserver.py`, in a process of its own, answering after
100 ms) from N threads at once until `--calls` calls are made, in a fresh
process of its own; the figure is that process's CPU time (every thread's)
per call, and the wall time against the ideal (calls x 100 ms / N). Rounds
alternate the clients, so the machine's load falls on all alike; the
medians and ranges are printed. Clients:

- `mklang`: the `HttpTransport` of the code first on `PYTHONPATH` (this
  checkout by default), as providers use it;
- `stdlib`: `http.client`, one kept-alive connection per thread (what mklang
  used from ADR 0033 to ADR 0053);
- `urllib3`: one `urllib3.PoolManager` shared by the threads, its pool per
  host as large as the calls in flight;
- `httpx`: one `httpx.Client` shared by the threads, its pool as large as
  the calls in flight;
- `httpcore`: one `httpcore.ConnectionPool` (httpx's transport) alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from measure import print_load

ROOT = Path(__file__).resolve().parent.parent
LATENCY = 0.1
BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "step 1 of topic 17: what is the next word?"},
    ],
    "temperature": 0.4,
}
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench", "User-Agent": "bench"}
SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from support.fakeserver import FakeServer, answer
with FakeServer(tls={tls}) as server:
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=2, delay={latency})
    print(server.openai_url, flush=True)
    sys.stdin.read()
"""


def poster(client: str, url: str, in_flight: int) -> Callable[[], None]:
    """One call of `client` to `url` (built once, shared by the threads)."""
    payload = json.dumps(BODY).encode()
    target = url + "/chat/completions"
    certificate = os.environ.get("SSL_CERT_FILE")
    if client == "mklang":
        from mklang.host.config import ProviderConfig
        from mklang.providers.http import HttpTransport

        transport = HttpTransport(ProviderConfig(name="p", kind="openai", base_url=url, retries=0), HEADERS)
        return lambda: transport.post("/chat/completions", BODY) and None
    if client == "stdlib":
        import http.client
        import ssl
        import urllib.parse

        parts = urllib.parse.urlsplit(target)
        local = threading.local()
        context = ssl.create_default_context(cafile=certificate) if parts.scheme == "https" else None

        def stdlib() -> None:
            if getattr(local, "connection", None) is None:
                local.connection = (
                    http.client.HTTPSConnection(parts.hostname, parts.port, context=context)
                    if context
                    else http.client.HTTPConnection(parts.hostname, parts.port)
                )
            local.connection.request("POST", parts.path, payload, HEADERS)
            response = local.connection.getresponse()
            json.loads(response.read())

        return stdlib
    if client == "urllib3":
        import urllib3

        pools = urllib3.PoolManager(maxsize=in_flight, ca_certs=certificate, retries=False)

        def with_urllib3() -> None:
            response = pools.request("POST", target, body=payload, headers=HEADERS, redirect=False)
            json.loads(response.data)

        return with_urllib3
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        shared = httpx.Client(limits=limits, verify=certificate or True, trust_env=False)

        def with_httpx() -> None:
            json.loads(shared.post(target, content=payload, headers=HEADERS).content)

        return with_httpx
    if client == "httpcore":
        import ssl

        import httpcore

        context = ssl.create_default_context(cafile=certificate)
        pool = httpcore.ConnectionPool(
            max_connections=in_flight, max_keepalive_connections=in_flight, ssl_context=context
        )

        def with_httpcore() -> None:
            json.loads(pool.request("POST", target, content=payload, headers=HEADERS).content)

        return with_httpcore
    raise SystemExit(f"unknown client {client}")


def child(client: str, url: str, in_flight: int, calls: int) -> dict[str, float]:
    """Make `calls` calls from `in_flight` threads; this process's CPU and the wall time, from the first call."""
    call = poster(client, url, in_flight)
    left = [calls]
    lock = threading.Lock()
    start = threading.Barrier(in_flight + 1)

    def work() -> None:
        start.wait()
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            call()

    threads = [threading.Thread(target=work) for _ in range(in_flight)]
    for thread in threads:
        thread.start()
    cpu, wall = time.process_time(), time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        client, url, in_flight, calls = sys.argv[2:6]
        print(json.dumps(child(client, url, int(in_flight), int(calls))))
        return
    clients = ("mklang", "stdlib", "urllib3", "httpx", "httpcore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clients", nargs="*", metavar="CLIENT", help=f"any of {', '.join(clients)} (default all)")
    parser.add_argument("--calls", type=int, default=1536)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tls", action="store_true", help="HTTPS with the tests' self-signed certificate")
    args = parser.parse_args()
    chosen = args.clients or list(clients)
    print_load()
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    if args.tls:
        env["SSL_CERT_FILE"] = str(ROOT / "tests" / "support" / "tls" / "cert.pem")
    script = SERVER.format(tests=str(ROOT / "tests"), tls=args.tls, latency=LATENCY)
    server = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    url = server.stdout.readline().strip()
    figures: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for round_ in range(args.rounds):
            order = chosen if round_ % 2 == 0 else chosen[::-1]
            for in_flight in args.in_flight:
                for client in order:
                    command = [sys.executable, __file__, "--child", client, url, str(in_flight), str(args.calls)]
                    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        raise SystemExit(f"{client} failed: {done.stderr[-2000:]}")
                    figures.setdefault((client, in_flight), []).append(json.loads(done.stdout))
    finally:
        server.stdin.close()
        server.wait()
    scheme = "HTTPS" if args.tls else "HTTP"
    print(f"{args.calls} POSTs over {scheme}, {LATENCY * 1000:.0f} ms a reply, {args.rounds} rounds (median, range)")
    for in_flight in args.in_flight:
        ideal = args.calls * LATENCY / in_flight
        print(f"  {in_flight} in flight (ideal wall {ideal:.2f} s):")
        for client in chosen:
            runs = figures[client, in_flight]
            cpu = [run["cpu"] / args.calls * 1e3 for run in runs]
            wall = [run["wall"] for run in runs]
            print(
                f"    {client:<9} CPU {statistics.median(cpu):5.3f} ms/call ({min(cpu):.3f}-{max(cpu):.3f}), "
                f"wall {statistics.median(wall):5.2f} s ({min(wall):.2f}-{max(wall):.2f})"
            )
    print_load()


if __name__ == "__main__":
    main()
