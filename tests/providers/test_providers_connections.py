"""The HTTP transport's connections (ADR 0053): one pool per provider, its kept-alive connections shared by
the threads, opened again when the server closes one or breaks off a response; TLS against the certificates
trusted; proxies (`http://` and `https://`, CONNECT tunnels); connect and read timeouts.

Every test talks to a real server on 127.0.0.1 (`support.fakeserver`, `support.proxy`) and counts the
connections it accepted.
"""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from support.commands import cli, cli_env, refused
from support.fakeserver import CERTIFICATE, FakeServer, InFlight, Reply, answer, raw
from support.proxy import FakeProxy

from mklang.errors import ProviderError, UsageError
from mklang.host.config import ProviderConfig
from mklang.providers.base import deadline
from mklang.providers.http import IDLE_POOLS, POOLS, HttpTransport

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the proxy variables it is about, and only those."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def _transport(server: FakeServer | str, slept: list[float] | None = None, **options: Any) -> HttpTransport:
    """A transport to the server (or base URL), with no retry unless `retries` says otherwise."""
    base_url = server if isinstance(server, str) else server.openai_url
    settings: dict[str, Any] = {"retries": 0, "backoff": 0.001, "max_backoff": 0.01, "timeout": 5, **options}
    config = ProviderConfig(name="p", kind="openai", base_url=base_url, **settings)
    return HttpTransport(config, {}, sleep=slept.append if slept is not None else lambda seconds: None)


def _ask(transport: HttpTransport) -> str:
    return str(transport.post("/chat/completions", {"model": "m"})["choices"][0]["message"]["content"])


def _fails(transport: HttpTransport) -> str:
    with pytest.raises(ProviderError) as caught:
        transport.post("/chat/completions", {"model": "m"})
    return str(caught.value)


def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    ends = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < ends, "the condition did not come true in time"
        time.sleep(0.01)


# --- kept-alive connections shared by the threads -----------------------------------


def test_a_connection_serves_the_calls_of_every_thread_one_after_another(server):
    server.fallback = answer("ok")
    transport = _transport(server)
    assert [_ask(transport) for _ in range(3)] == ["ok"] * 3
    for _ in range(3):  # each thread ends before the next starts: the connection outlives them
        thread = threading.Thread(target=_ask, args=(transport,))
        thread.start()
        thread.join()
    assert (server.count, server.connections, server.closed) == (6, 1, 0)


def test_calls_in_flight_at_once_each_have_a_connection_and_keep_them_for_the_next(server):
    held = InFlight(lambda request: answer("ok"))
    server.handler = held
    transport = _transport(server)
    together = threading.Barrier(6)

    def two_calls() -> None:
        together.wait()
        _ask(transport)
        together.wait()
        _ask(transport)

    threads = [threading.Thread(target=two_calls) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert held.peak == 6  # none waited for another's connection
    assert (server.count, server.connections) == (12, 6)  # the second round reused the first round's


def test_a_closed_transport_refuses_calls_and_leaves_its_connections_to_the_next_one_to_the_server(server):
    server.fallback = answer("ok")
    transport = _transport(server)
    _ask(transport)
    transport.close()
    with pytest.raises(RuntimeError, match=r"^p: the HTTP client is closed$"):
        _ask(transport)
    assert server.count == 1
    later = _transport(server)
    assert _ask(later) == "ok"
    assert (server.connections, server.closed) == (1, 0)  # the first transport's connection served the second
    later.close()


def test_a_pool_nobody_uses_is_closed_once_as_many_as_are_kept_were_used_after_it(server):
    server.fallback = answer("ok")
    transport = _transport(server)
    _ask(transport)
    transport.close()
    for port in range(1, IDLE_POOLS):  # as many other pools given back as are kept, less one: it stays open
        _transport(f"http://127.0.9.{port}:9/v1").close()
    assert server.closed == 0
    _transport("http://127.0.9.255:9/v1").close()
    _until(lambda: server.closed == 1)


def test_a_pool_in_use_is_never_closed_however_many_others_are_given_back(server):
    server.fallback = answer("ok")
    transport = _transport(server)
    _ask(transport)
    for port in range(1, 2 * IDLE_POOLS):
        _transport(f"http://127.0.10.{port}:9/v1").close()
    assert _ask(transport) == "ok"
    assert (server.connections, server.closed) == (1, 0)
    transport.close()


# --- one pool per endpoint, shared by the providers of the process --------------------


def _keyed(server: FakeServer, variable: str) -> HttpTransport:
    """A provider's transport whose key is in `variable`, as providers build it (its header, its secret)."""
    config = ProviderConfig(name="p", kind="openai", base_url=server.openai_url, api_key_env=variable, retries=0)
    key = config.api_key()
    return HttpTransport(config, {"Authorization": f"Bearer {key}"}, secret=key)


def test_providers_of_two_keys_share_connections_and_each_request_carries_only_its_own_key(server, monkeypatch):
    monkeypatch.setenv("ALPHA_KEY", "sk-alpha-secret")
    monkeypatch.setenv("BRAVO_KEY", "sk-bravo-secret")
    server.handler = lambda request: answer(request.headers["authorization"], delay=0.02)
    first, second = _keyed(server, "ALPHA_KEY"), _keyed(server, "BRAVO_KEY")
    together = threading.Barrier(8)
    seen: list[tuple[str, str]] = []

    def calls(transport: HttpTransport, key: str) -> None:
        together.wait()
        for _ in range(5):
            seen.append((key, _ask(transport)))

    threads = [
        threading.Thread(target=calls, args=pair)
        for pair in [(first, "sk-alpha-secret"), (second, "sk-bravo-secret")] * 4
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == sorted([(key, f"Bearer {key}") for key in ("sk-alpha-secret", "sk-bravo-secret")] * 20)
    assert server.count == 40 and server.connections <= 8  # one pool: a connection served either key's calls
    assert [request.headers["authorization"].count("sk-") for request in server.requests] == [1] * 40
    shown = " ".join(map(repr, (POOLS, first, second, first._endpoint, first._endpoint.key)))
    assert "secret" not in shown
    first.close()
    second.close()


def test_a_proxys_credentials_are_never_used_for_another_providers_tunnel(tls_server, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    tls_server.fallback = answer("tunnelled")
    with FakeProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://alice:one@"))
        alice = _transport(tls_server)
        _ask(alice)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://bob:two@"))
        bob = _transport(tls_server)
        _ask(bob)
        _ask(alice)
        assert "one" not in repr(alice._endpoint) and "one" not in repr(alice._endpoint.key)
        alice.close()
        bob.close()
    basic = {name: "Basic " + base64.b64encode(name.encode()).decode() for name in ("alice:one", "bob:two")}
    target = tls_server.url.removeprefix("https://")
    assert proxy.requests == [("CONNECT", target, basic["alice:one"]), ("CONNECT", target, basic["bob:two"])]
    assert tls_server.connections == 2


def test_a_provider_trusting_other_certificates_gets_a_pool_of_its_own(tls_server, monkeypatch):
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    tls_server.fallback = answer("secure")
    trusting = _transport(tls_server)
    assert _ask(trusting) == "secure"
    monkeypatch.delenv("SSL_CERT_FILE")  # certifi's bundle, which does not trust the server's certificate
    message = _fails(_transport(tls_server))
    assert "is not trusted" in message
    assert (tls_server.count, tls_server.connections) == (1, 1)  # the trusted connection was not lent to it
    trusting.close()


def test_an_idle_connection_the_server_closed_is_replaced_before_the_next_call(server):
    slept: list[float] = []
    server.add(replace(answer("first"), close=True), answer("second"))
    transport = _transport(server, slept)  # no retries: a request lost on the closed connection would fail the call
    assert _ask(transport) == "first"
    _until(lambda: server.closed == 1)  # the server closed it after answering, without a word
    assert _ask(transport) == "second"
    assert (server.count, server.connections, slept) == (2, 2, [])  # each call reached the server once


def test_a_connection_close_answer_is_followed_by_a_new_connection(server):
    slept: list[float] = []
    server.add(Reply(text="first", headers={"Connection": "close"}), answer("second"))
    transport = _transport(server, slept)
    assert [_ask(transport), _ask(transport)] == ["first", "second"]
    assert (server.count, server.connections, slept) == (2, 2, [])


def test_a_response_broken_off_is_retried_on_a_new_connection(server):
    slept: list[float] = []
    server.add(replace(answer("cut short"), cut=20), answer("whole"))
    assert _ask(_transport(server, slept, retries=1)) == "whole"
    assert (server.count, server.connections, len(slept)) == (2, 2, 1)


def test_a_response_broken_off_on_the_last_attempt_is_a_one_line_connection_error(server):
    server.add(replace(answer("cut short"), cut=20))
    message = _fails(_transport(server))
    assert re.fullmatch(
        r"p connection-error: IncompleteRead\(20 bytes read, \d+ more expected\) \(after 1 attempt\)", message
    )


def test_a_redirect_is_not_followed(server):
    server.add(raw("", status=307, headers={"Location": f"{server.openai_url}/elsewhere"}), answer("never asked"))
    assert _fails(_transport(server, retries=2)) == "p 307: Temporary Redirect"
    assert [request.path for request in server.requests] == ["/v1/chat/completions"]


# --- timeouts ---------------------------------------------------------------------


def test_an_answer_too_late_is_not_read_as_the_answer_to_the_retry(server):
    server.add(answer("late", delay=0.6), answer("on time"))
    assert _ask(_transport(server, retries=1, timeout=0.2)) == "on time"
    assert server.connections == 2  # the connection the late answer would arrive on was dropped


@pytest.fixture
def unaccepting() -> Iterator[str]:
    """The base URL of a listener whose queue of connections is full: a connection to it is never made."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        address = listener.getsockname()
        waiting = []
        for _ in range(4):  # fill the queue; later connections' SYNs are dropped
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            waiting.append(filler)
        time.sleep(0.05)
        yield f"http://127.0.0.1:{address[1]}/v1"
        for filler in waiting:
            filler.close()


def test_a_server_that_does_not_accept_is_a_connect_timeout(unaccepting):
    started = time.monotonic()
    message = _fails(_transport(unaccepting, connect_timeout=0.3, timeout=30))
    assert message == "p timeout: no connection within 0.3s (after 1 attempt)"
    assert time.monotonic() - started < 2


def test_the_connect_timeout_is_shortened_to_the_time_left(unaccepting):
    transport = _transport(unaccepting, connect_timeout=10, retries=1)
    started = time.monotonic()
    with deadline(started + 0.3):
        message = _fails(transport)
    found = re.fullmatch(
        r"p timeout: no connection within (0\.\d+)s \(no time left for a retry before the --max-time deadline\)",
        message,
    )
    assert found, message
    assert 0 < float(found.group(1)) <= 0.3
    assert time.monotonic() - started < 2


@pytest.fixture
def silent() -> Iterator[str]:
    """The address of a listener whose connections are made (by the kernel) and never answered."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("through", ["a TLS handshake", "a proxy's CONNECT"])
def test_a_connection_made_but_not_answered_is_a_connect_timeout(silent, through, monkeypatch):
    if through == "a TLS handshake":
        transport = _transport(f"https://{silent}/v1", connect_timeout=0.3, timeout=30)
    else:
        monkeypatch.setenv("HTTPS_PROXY", f"http://{silent}")
        transport = _transport("https://api.example.com/v1", connect_timeout=0.3, timeout=30)
    started = time.monotonic()
    assert _fails(transport) == "p timeout: no connection within 0.3s (after 1 attempt)"
    assert time.monotonic() - started < 2


# --- TLS --------------------------------------------------------------------------


@pytest.fixture
def tls_server() -> Iterator[FakeServer]:
    with FakeServer(tls=True) as server:
        yield server


def test_https_to_a_server_whose_certificate_ssl_cert_file_trusts(tls_server, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    tls_server.fallback = answer("secure")
    transport = _transport(tls_server)
    assert [_ask(transport) for _ in range(3)] == ["secure"] * 3
    assert tls_server.connections == 1
    assert tls_server.requests[0].headers["host"] == tls_server.url.removeprefix("https://")


@pytest.mark.parametrize("trusted", ["certifi", "the system's bundle"])
def test_a_certificate_not_trusted_fails_at_once_and_sends_nothing(tls_server, monkeypatch, trusted):
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    if trusted == "certifi":
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    else:
        monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
    slept: list[float] = []
    message = _fails(_transport(tls_server, slept, retries=3))
    assert re.fullmatch(
        r"p connection-error: the certificate of 127\.0\.0\.1 is not trusted \(self.signed certificate\); "
        r"SSL_CERT_FILE names the certificates to trust",
        message,
    ), message
    assert (tls_server.count, slept) == (0, [])


def test_an_unreadable_ssl_cert_file_is_refused_when_an_https_provider_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(UsageError) as caught:
        _transport("https://127.0.0.1:1/v1")
    assert (
        str(caught.value)
        == f"SSL_CERT_FILE={tmp_path / 'missing.pem'}: no certificates could be read from it (No such file or directory)"
    )
    _transport("http://127.0.0.1:1/v1")  # plain HTTP reads no certificates


# --- proxies ------------------------------------------------------------------------


def test_https_goes_through_one_connect_tunnel_with_the_proxys_credentials(tls_server, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    tls_server.fallback = answer("tunnelled")
    with FakeProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://us%40er:p%3Ass@"))
        transport = _transport(tls_server)
        assert [_ask(transport), _ask(transport)] == ["tunnelled"] * 2
    credentials = "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert proxy.requests == [("CONNECT", tls_server.url.removeprefix("https://"), credentials)]
    assert tls_server.connections == 1


def test_https_goes_through_a_tunnel_inside_tls_to_an_https_proxy(tls_server, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))  # trusts the proxy and the server alike
    tls_server.fallback = answer("tunnelled twice")
    with FakeProxy(tls=True) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        transport = _transport(tls_server)
        assert [_ask(transport), _ask(transport)] == ["tunnelled twice"] * 2
    assert proxy.url.startswith("https://")
    assert proxy.requests == [("CONNECT", tls_server.url.removeprefix("https://"), None)]
    assert tls_server.connections == 1


def test_an_https_proxy_whose_certificate_is_not_trusted_is_refused_at_once(monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    slept: list[float] = []
    with FakeProxy(tls=True) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        message = _fails(_transport("http://api.example.com/v1", slept, retries=2))
    assert message == (
        "p connection-error: the certificate of api.example.com is not trusted (self-signed certificate); "
        "SSL_CERT_FILE names the certificates to trust"
    )
    assert (proxy.requests, slept) == ([], [])


@pytest.mark.parametrize("tls", [False, True], ids=["http-proxy", "https-proxy"])
def test_plain_http_is_sent_to_the_proxy_as_an_absolute_url_with_its_credentials(server, monkeypatch, tls):
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    server.fallback = answer("forwarded")
    with FakeProxy(tls=tls) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("://", "://user:pa%20ss@"))
        transport = _transport(server)
        assert [_ask(transport), _ask(transport)] == ["forwarded"] * 2
    credentials = "Basic " + base64.b64encode(b"user:pa ss").decode()
    assert proxy.requests == [("POST", f"{server.openai_url}/chat/completions", credentials)] * 2
    assert server.requests[0].body == {"model": "m"}
    assert "proxy-authorization" not in server.requests[0].headers


def test_no_proxy_lists_the_hosts_reached_directly(server, monkeypatch):
    server.fallback = answer("direct")
    with FakeProxy() as proxy:
        monkeypatch.setenv("ALL_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "example.com, 127.0.0.1")
        assert _ask(_transport(server)) == "direct"
    assert proxy.requests == []


def test_a_proxy_that_cannot_be_reached_is_a_connection_error_without_its_password(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]  # free once closed: connections to it are refused
    monkeypatch.setenv("HTTPS_PROXY", f"http://user:hunter2@127.0.0.1:{port}")
    message = _fails(_transport("https://api.example.com/v1", retries=1))
    assert re.fullmatch(r"p connection-error: \[Errno \d+\] Connection refused \(after 2 attempts\)", message), message


@pytest.mark.parametrize("scheme", ["socks5", "socks5h", "ftp"])
def test_a_proxy_that_cannot_be_used_is_refused_not_bypassed(monkeypatch, scheme):
    monkeypatch.setenv("HTTPS_PROXY", f"{scheme}://user:secret@proxy.example:3128")
    with pytest.raises(UsageError) as caught:
        _transport("https://api.example.com/v1")
    assert str(caught.value) == (
        f"the proxy {scheme}://proxy.example:3128 for https://api.example.com cannot be used: mklang reaches "
        "proxies at http:// and https:// addresses only (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY lists the "
        "hosts to reach directly)"
    )


def test_a_run_refuses_a_proxy_it_cannot_use_with_one_line_and_exit_2(tmp_path):
    machine = tmp_path / "m.mk"
    machine.write_text(
        'mklang 0.4\nmachine m\nentry a\nbudget 5\n\nstate a {\n  structure "A word."\n  prompt "hi"\n'
        "  output x\n  otherwise -> END\n}\n"
    )
    env = cli_env(
        OPENAI_API_KEY="sk-x", OPENAI_BASE_URL="https://api.example.com/v1", HTTPS_PROXY="socks5://proxy.example:1080"
    )
    done = cli("run", str(machine), "--provider", "openai", "--model", "m", env=env)
    assert refused(done) == (
        "mklang: error: the proxy socks5://proxy.example:1080 for https://api.example.com cannot be used: mklang "
        "reaches proxies at http:// and https:// addresses only (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY "
        "lists the hosts to reach directly)"
    )
