"""The HTTP plumbing both wire formats share: a pool of kept-alive connections, a request limit, retries.

Requests go through urllib3 (ADR 0053): one connection pool per endpoint,
shared by every provider of the process that reaches it and every thread
that calls them, so a connection one call used serves the next call of any
thread or run (ADR 0065). TLS is verified against `SSL_CERT_FILE` (or
`SSL_CERT_DIR`), else certifi's bundle; `HTTPS_PROXY`, `HTTP_PROXY`,
`ALL_PROXY` and `NO_PROXY` are honoured (an `http://` or `https://` proxy: a
CONNECT tunnel for HTTPS, the absolute URL for HTTP), and a proxy that cannot
be used is refused rather than bypassed. Redirects are not followed.

Retries follow one rule: 429, 408, 5xx, timeouts and connection errors are
tried again after an exponential, jittered delay (or the server's
`Retry-After`, capped at `max_backoff`); any other status fails at once, and
so does a certificate that is not trusted. After the last attempt a
`ProviderError("<provider> <status>: <reason>")` is raised. The API key is
scrubbed from every message this module builds.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import json
import os
import queue
import random
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import urllib3

from mklang.errors import ProviderError, UsageError
from mklang.host.config import ProviderConfig
from mklang.providers import streaming
from mklang.providers.base import seconds_left, throttled
from mklang.providers.streaming import Stream, StreamCut
from mklang.version import __version__

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
REASON_LIMIT = 200
MAX_CALL_TOKENS = 100_000_000  # more than any model reads and writes in one call: a larger count is malformed
POOL_SIZE = 1024  # idle connections a pool keeps for the next calls to its endpoint
IDLE_POOLS = 8  # pools no provider uses any more, kept open (with their connections) for the next providers
NO_RETRY = urllib3.Retry(False, redirect=False)  # `post` retries, by its own rule; built once, not per request


@dataclass(frozen=True)
class Reply:
    """One chat completion, reduced to what the engine needs.

    A token count the server sent malformed is None, and `usage_problem` says
    how; the provider then fails the call and counts it conservatively."""

    text: str
    reasoning: str | None
    input_tokens: int | None
    output_tokens: int | None
    usage_problem: str | None = None


def token_counts(usage: Any, keys: dict[str, tuple[str, ...]]) -> tuple[dict[str, int | None], str | None]:
    """The server's token counts, each summed over its `keys`: an absent count is 0; one that is not an
    integer from 0 to MAX_CALL_TOKENS (negative, text, a list, 1e400, NaN) is None, and the problem
    returned beside them names it."""
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        return dict.fromkeys(keys), f"the server's usage is malformed (usage: {_shown(usage)})"
    counts: dict[str, int | None] = {}
    problems = []
    for name, fields in keys.items():
        values = [0 if usage.get(field) is None else usage[field] for field in fields]
        bad = [f"{field}: {_shown(v)}" for field, v in zip(fields, values, strict=True) if not _is_count(v)]
        problems += bad
        counts[name] = None if bad else sum(values)
    return counts, f"the server's usage is malformed ({', '.join(problems)})" if problems else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CALL_TOKENS


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class HttpTransport:
    """POSTs JSON to one provider over a pool of kept-alive connections, with retries.

    Thread-safe: fan-out branches and batch runs share it and its urllib3 pool
    (ADR 0053), which lends each request an idle connection or opens one, so a
    call costs the same however many are in flight. The pool is the endpoint's,
    shared with every other transport of the process to the same server through
    the same proxy with the same certificates trusted (`POOLS`, ADR 0065); the
    key is this transport's own, sent in its requests' headers only. How many requests are
    in flight is the run's one limit (`--concurrency`); a provider's
    `max_in_flight`, when the config sets one, caps its own requests further (a
    semaphore). `sleep` is injectable so tests can observe the delays without
    waiting for them. Every request goes out through `_send`, the one place a
    request is made (a streamed answer is read from its response).
    """

    def __init__(
        self,
        config: ProviderConfig,
        headers: dict[str, str],
        *,
        secret: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.config = config
        self._secret = secret
        self._sleep = sleep
        cap = config.max_in_flight
        self._slots: contextlib.AbstractContextManager[Any] = (
            threading.BoundedSemaphore(cap) if cap is not None else contextlib.nullcontext()
        )
        self._endpoint = Endpoint.of(config)
        self._pool = POOLS.take(self._endpoint)
        self._timeout = urllib3.Timeout(connect=config.connect_timeout, read=config.timeout)
        self._headers = {
            "User-Agent": f"mklang/{__version__}",
            "Content-Type": "application/json",
            **self._endpoint.request_headers,
            **headers,
        }
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpTransport({self.config.name!r}, {self.config.base_url!r})"

    def close(self) -> None:
        """Give the endpoint's pool back (its connections stay for the next transport to it, `POOLS`);
        a later `post` raises RuntimeError."""
        if not self._closed:
            self._closed = True
            POOLS.give_back(self._endpoint)

    def post(self, path: str, body: dict[str, Any], stream: Callable[[], Stream] | None = None) -> dict[str, Any]:
        """POST `body` and return the decoded JSON object, retrying what can be retried. With
        `stream`, the answer is read as server-sent events into a fresh `stream()` each attempt,
        and a stream cut short is retried as a broken connection is (ADR 0060)."""
        if self._closed:
            raise RuntimeError(f"{self.config.name}: the HTTP client is closed")
        name = self.config.name
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        target = self._endpoint.target(path)
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            try:
                with self._slots:
                    read, connect = self._timeouts()  # after waiting for a slot: what is left now
                    response = self._send(target, payload, read, connect, streamed=stream is not None)
                    if response.status == 200 and stream is not None:
                        return self._streamed(response, stream())
            except urllib3.exceptions.HTTPError as error:
                failure, delay = self._failure(error, read, connect), None
            else:
                if response.status == 200:
                    return self._decode(response.data)
                phrase = response.reason or _phrase(response.status)
                failure = f"{response.status}: {self._reason(response.data, phrase)}"
                if response.status not in RETRYABLE_STATUS:
                    raise ProviderError(f"{name} {failure}{self._key_hint(response.status)}")
                delay = retry_after(response.headers.get("retry-after"))
                if delay is not None and response.status == 429:
                    throttled(delay)
            if attempt + 1 == attempts:
                break
            pause = self._delay(attempt, delay)
            left = seconds_left()
            if left is not None and pause >= left:
                raise ProviderError(f"{name} {failure} (no time left for a retry before the --max-time deadline)")
            self._sleep(pause)
        raise ProviderError(f"{name} {failure} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _send(
        self, target: str, payload: bytes, read: float, connect: float, streamed: bool = False
    ) -> urllib3.BaseHTTPResponse:
        """One request on a pooled connection, its answer read whole (or, `streamed`, left to be
        read as it arrives). urllib3 drops a connection a request failed on (a late answer is never
        read as the next one's), and one its server closed while it was idle, before a request is
        written to it."""
        timeout = self._timeout
        if (read, connect) != (timeout.read_timeout, timeout.connect_timeout):  # shortened to the deadline
            timeout = urllib3.Timeout(connect=connect, read=read)
        return self._pool.urlopen(
            "POST",
            target,
            body=payload,
            headers=self._headers,
            retries=NO_RETRY,
            redirect=False,
            assert_same_host=False,  # a plain-HTTP proxy's target is an absolute URL
            timeout=timeout,
            preload_content=not streamed,
            release_conn=True,  # a streamed answer's connection goes back to the pool once it is read
        )

    def _streamed(self, response: urllib3.BaseHTTPResponse, stream: Stream) -> dict[str, Any]:
        """The answer of a 200 read as server-sent events into `stream`: whole once its last event
        came, else a `StreamCut`. A connection left mid-stream is closed, never reused."""
        try:
            finished = False
            for event, data in streaming.events(streaming.lines(response)):
                finished = finished or stream.feed(event, data)
            if not finished:
                raise StreamCut("the stream ended before the answer was complete")
            return stream.answer()
        except ValueError as error:  # not UTF-8, not JSON, not the events of an answer
            response.close()
            what = self._snippet(str(error))
            raise ProviderError(f"{self.config.name} 200: the stream is not the events of an answer: {what}") from None
        except BaseException:
            response.close()
            raise

    def _failure(self, error: urllib3.exceptions.HTTPError, read: float, connect: float) -> str:
        """An attempt's failure in one phrase; a certificate not trusted is raised at once instead."""
        chain = _chain(error)
        for each in chain:
            if isinstance(each, ssl.SSLCertVerificationError):
                raise ProviderError(
                    f"{self.config.name} connection-error: the certificate of {self._endpoint.host} is not "
                    f"trusted ({each.verify_message}); SSL_CERT_FILE names the certificates to trust"
                ) from None
            if isinstance(each, StreamCut):
                return f"connection-error: {self._snippet(str(each))}"
            if isinstance(each, urllib3.exceptions.NewConnectionError):
                break  # a connection refused (urllib3 makes it a kind of connect timeout)
            if isinstance(each, urllib3.exceptions.ConnectTimeoutError):
                return f"timeout: no connection within {connect:.3g}s"
            if isinstance(each, urllib3.exceptions.ReadTimeoutError):
                return f"timeout: no answer within {read:.3g}s"
        return f"connection-error: {self._snippet(_described(chain[-1]))}"

    def _timeouts(self) -> tuple[float, float]:
        """The read and connect timeouts, shortened to what is left before the run's deadline."""
        left = seconds_left()
        if left is not None and left <= 0:
            raise ProviderError(f"{self.config.name} timeout: the --max-time deadline passed before the request")
        read, connect = self.config.timeout, self.config.connect_timeout
        if left is not None:
            read, connect = min(read, left), min(connect, left)
        return read, connect

    def _delay(self, attempt: int, retry_after_seconds: float | None) -> float:
        """The server's Retry-After when it gave one, else exponential backoff with jitter."""
        if retry_after_seconds is not None:
            return min(retry_after_seconds, self.config.max_backoff)
        ceiling = min(self.config.max_backoff, self.config.backoff * 2**attempt)
        return float(ceiling * random.uniform(0.5, 1.0))

    def _decode(self, data: bytes) -> dict[str, Any]:
        try:
            decoded = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            text = data.decode("utf-8", "replace")
            raise ProviderError(f"{self.config.name} 200: response is not JSON: {self._snippet(text)}") from None
        if not isinstance(decoded, dict):
            raise ProviderError(f"{self.config.name} 200: response is not a JSON object")
        return decoded

    def _reason(self, data: bytes, phrase: str) -> str:
        """The server's own error message when it sent one, else the HTTP reason phrase."""
        try:
            error = json.loads(data).get("error")
            message = error.get("message") if isinstance(error, dict) else error
        except (ValueError, AttributeError):
            message = None
        return self._snippet(message if isinstance(message, str) and message else phrase)

    def _key_hint(self, status: int) -> str:
        if status in (401, 403) and self.config.api_key_env and self._secret is None:
            return f" ({self.config.api_key_env} is not set)"
        return ""

    def _snippet(self, text: str) -> str:
        text = " ".join(self._clean(text).split())
        return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."

    def _clean(self, text: str) -> str:
        return redact(text, self._secret)


class _Idle(queue.LifoQueue):  # type: ignore[type-arg]  # urllib3 holds connections and None in it
    """A pool's idle connections. urllib3 also puts a None in the queue for each connection it may
    open (1,024 of them when a pool is built: 3.9 ms of CPU); with `block=False` an empty queue opens
    a connection just the same, so a None is not kept."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is not None:
            super().put(item, block, timeout)


class _Pool(urllib3.HTTPConnectionPool):
    QueueCls = _Idle


class _Verified(urllib3.connection.HTTPSConnection):
    """urllib3's HTTPS connection, with a timeout in a proxy's CONNECT or the TLS handshake reported as
    one while connecting (urllib3 reports it as a read timeout), as one in the TCP connect is."""

    def connect(self) -> None:
        try:
            super().connect()
        except TimeoutError as error:  # the socket's, not urllib3's: the TCP connect's is urllib3's already
            raise urllib3.exceptions.ConnectTimeoutError(self, f"Connection to {self.host} timed out") from error


class _TlsPool(urllib3.HTTPSConnectionPool):
    QueueCls = _Idle
    ConnectionCls = _Verified


def _chain(error: BaseException) -> list[BaseException]:
    """The error and those it wraps, outermost first: urllib3 wraps the socket's, TLS's and the
    standard library's HTTP errors."""
    chain = [error]
    while True:
        last = chain[-1]
        inner = last.__cause__ or next((arg for arg in reversed(last.args) if isinstance(arg, BaseException)), None)
        if inner is None or inner in chain:
            return chain
        chain.append(inner)


def _described(error: BaseException) -> str:
    """The innermost error as one readable phrase: an OSError says what failed, a broken response
    (the standard library's or urllib3's) is named by its kind."""
    text = str(error)
    if isinstance(error, OSError) or text.startswith(type(error).__name__):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "unknown status"


@dataclass(frozen=True)
class Endpoint:
    """Where a provider's requests go: its server, directly or through a proxy.

    Read once per provider, from its `base_url` and the environment: the proxy
    variables and, for HTTPS to the server or to the proxy, where the
    certificates to trust are (`SSL_CERT_FILE`, `SSL_CERT_DIR`)."""

    scheme: str
    host: str
    port: int
    prefix: str  # the base URL's path; every request path follows it
    certificates: tuple[str | None, str | None] | None  # None: neither the server nor the proxy is reached over TLS
    proxy: str | None = None  # the proxy's URL, without its credentials
    proxy_headers: dict[str, str] | None = field(default=None, repr=False)  # the proxy's credentials

    @classmethod
    def of(cls, config: ProviderConfig) -> Endpoint:
        url = urllib.parse.urlsplit(config.base_url.rstrip("/"))
        try:
            host, port = url.hostname, url.port
        except ValueError as error:
            raise UsageError(f"provider {config.name}: base_url {config.base_url!r} is malformed: {error}") from None
        if not host or url.scheme not in ("http", "https"):
            raise UsageError(f"provider {config.name}: base_url {config.base_url!r} names no http(s) server")
        if url.username is not None:
            raise UsageError(
                f"provider {config.name}: base_url must not hold a user name or password; "
                "set api_key_env to the variable that holds the key"
            )
        proxy, headers = _proxy(url.scheme, host, port)
        tls = url.scheme == "https" or (proxy or "").startswith("https:")
        certificates = (os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)
        return cls(
            url.scheme,
            host,
            port or (443 if url.scheme == "https" else 80),
            url.path,
            certificates if tls else None,
            proxy,
            headers,
        )

    @property
    def key(self) -> tuple[object, ...]:
        """What tells one endpoint's pool from another's: all but the path, the proxy's credentials as a digest
        (the table of pools never holds them in the clear)."""
        credentials = json.dumps(self.proxy_headers, sort_keys=True) if self.proxy_headers else None
        digest = hashlib.sha256(credentials.encode()).hexdigest() if credentials else None
        return (self.scheme, self.host, self.port, self.proxy, digest, self.certificates)

    @property
    def request_headers(self) -> dict[str, str]:
        """Headers every request carries: a forwarding proxy's credentials (a tunnel sends them once)."""
        return (self.proxy_headers or {}) if self._forwarded else {}

    def pool(self) -> urllib3.HTTPConnectionPool:
        """A new pool for the requests to this endpoint, keeping up to POOL_SIZE idle connections: to the
        server, tunnelled through the proxy for HTTPS (CONNECT), or to the proxy that forwards plain HTTP.
        Its connections share one TLS context."""
        context = None if self.certificates is None else trusted_certificates(*self.certificates)
        options: dict[str, Any] = {"num_pools": 1, "maxsize": POOL_SIZE, "block": False, "ssl_context": context}
        manager = (
            urllib3.ProxyManager(self.proxy, proxy_headers=self.proxy_headers, proxy_ssl_context=context, **options)
            if self.proxy is not None
            else urllib3.PoolManager(**options)
        )
        manager.pool_classes_by_scheme = {"http": _Pool, "https": _TlsPool}
        return manager.connection_from_host(self.host, self.port, self.scheme)

    def target(self, path: str) -> str:
        """The request target: the path, or the absolute URL a forwarding proxy reads."""
        if self._forwarded:
            return f"http://{_netloc(self.host, self.port)}{self.prefix}{path}"
        return self.prefix + path

    @property
    def _forwarded(self) -> bool:
        return self.proxy is not None and self.scheme == "http"


class Pools:
    """The connection pools of the process, one per endpoint (`Endpoint.key`), shared by the providers
    that reach it: the runs of a process (each awaited run builds its own providers) reuse one pool's
    connections and TLS context rather than each building its own (ADR 0065). A pool in use is never
    closed; of those no provider uses any more, the last `idle` used stay open for the next providers."""

    def __init__(self, idle: int):
        self._idle = idle
        self._guard = threading.Lock()
        self._pools: OrderedDict[tuple[object, ...], urllib3.HTTPConnectionPool] = OrderedDict()  # last used last
        self._users: Counter[tuple[object, ...]] = Counter()

    def __repr__(self) -> str:
        return f"Pools({len(self._pools)} open, {len(self._users)} in use)"

    def take(self, endpoint: Endpoint) -> urllib3.HTTPConnectionPool:
        """The endpoint's pool, built if there is none, used until `give_back`."""
        key = endpoint.key
        with self._guard:
            pool = self._pools.get(key) or endpoint.pool()
            self._pools[key] = pool
            self._pools.move_to_end(key)
            self._users[key] += 1
            return pool

    def give_back(self, endpoint: Endpoint) -> None:
        """One user fewer; pools nobody uses beyond the last `idle` are closed, the longest unused first."""
        key = endpoint.key
        with self._guard:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]
            self._pools.move_to_end(key)
            unused = [each for each in self._pools if each not in self._users]
            for each in unused[: max(0, len(unused) - self._idle)]:
                self._pools.pop(each).close()


POOLS = Pools(IDLE_POOLS)


def _proxy(scheme: str, host: str, port: int | None) -> tuple[str | None, dict[str, str] | None]:
    """The proxy the environment names for `scheme://host:port` (its URL without credentials) and the
    headers that authenticate to it, or (None, None): `HTTPS_PROXY`/`HTTP_PROXY`, else `ALL_PROXY`,
    unless `NO_PROXY` lists the host. Only an `http://` or `https://` proxy can be used; any other
    is refused, since ignoring it would send the requests around it."""
    proxies = urllib.request.getproxies_environment()
    setting = proxies.get(scheme) or proxies.get("all")
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # public, not in typeshed
    if not setting or bypass(_netloc(host, port), proxies):
        return None, None
    url = urllib.parse.urlsplit(setting if "://" in setting else f"http://{setting}")
    shown = f"{url.scheme}://{_netloc(url.hostname or '', url.port)}"
    if url.scheme not in ("http", "https") or not url.hostname:
        raise UsageError(
            f"the proxy {shown} for {scheme}://{host} cannot be used: mklang reaches proxies at http:// and "
            "https:// addresses only (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY lists the hosts to reach directly)"
        )
    headers = {}
    if url.username is not None:
        credentials = f"{urllib.parse.unquote(url.username)}:{urllib.parse.unquote(url.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return shown, headers


def _netloc(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def trusted_certificates(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    """A TLS context that verifies servers against `cafile` (`SSL_CERT_FILE`) or `capath` (`SSL_CERT_DIR`)
    when one is set, else certifi's bundle; an unreadable file is refused."""
    if cafile is None and capath is None:
        import certifi

        cafile = certifi.where()
    elif cafile is not None:
        capath = None
    try:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    except (OSError, ssl.SSLError) as error:
        variable = "SSL_CERT_FILE" if cafile else "SSL_CERT_DIR"
        reason = error.strerror or str(error) if isinstance(error, OSError) else str(error)
        raise UsageError(f"{variable}={cafile or capath}: no certificates could be read from it ({reason})") from None


def redact(text: str, secret: str | None) -> str:
    """Replace the secret (when there is one) with `***`, in every encoding an error may echo it.

    A server or a library can quote a key as Python `repr` (of the text or of
    its bytes), JSON-escaped, or URL-encoded; each of those forms is removed.
    """
    if not secret:
        return text
    forms = {
        secret,
        repr(secret)[1:-1],
        repr(secret.encode("utf-8", "backslashreplace"))[2:-1],
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
        urllib.parse.quote(secret),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret, safe=""),
    }
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, "***")
    return text


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class ProviderClient:
    """Base of the wire-format clients: owns the transport, shapes errors, checks answers."""

    path: str

    def __init__(self, config: ProviderConfig, *, sleep: Callable[[float], None] = time.sleep):
        self.config = config
        key = config.api_key()
        self._key = key
        self._transport = HttpTransport(config, self.headers(key), secret=key, sleep=sleep)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.name!r})"

    def headers(self, key: str | None) -> dict[str, str]:
        raise NotImplementedError

    def chat(self, model: str, system: str, user: str, *, reason: bool) -> Reply:
        raise NotImplementedError

    def close(self) -> None:
        self._transport.close()

    def _post(self, body: dict[str, Any], stream: Callable[[], Stream] | None = None) -> dict[str, Any]:
        return self._transport.post(self.path, {**self.config.params, **body}, stream)

    def _fail(self, model: str, what: str) -> ProviderError:
        """An error about an answer; `what` may quote the server, so the key is scrubbed from it."""
        return ProviderError(redact(f"{self.config.name} {model}: {what}", self._key))

    def _shape_error(self, model: str, missing: str) -> ProviderError:
        return self._fail(model, f"unexpected response shape: no {missing}")
