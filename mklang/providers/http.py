"""The HTTP plumbing both wire formats share: a kept-alive connection per thread, a request limit, retries.

Each thread that calls a provider keeps one HTTP/1.1 connection to it
(`http.client`, ADR 0033): it is opened on the thread's first call, reused
while the server keeps it open, and opened again after a connection error, a
`Connection: close`, or a server that closed it while it was idle. TLS is
verified against `SSL_CERT_FILE` (or `SSL_CERT_DIR`), else certifi's bundle;
`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY` and `NO_PROXY` are honoured (an
`http://` proxy: a CONNECT tunnel for HTTPS, the absolute URL for HTTP), and a
proxy that cannot be used is refused rather than bypassed. Redirects are not
followed.

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
import json
import os
import random
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.client import HTTPConnection, HTTPException, HTTPResponse, HTTPSConnection
from typing import Any

from mklang.errors import ProviderError, UsageError
from mklang.host.config import ProviderConfig
from mklang.providers.base import seconds_left
from mklang.version import __version__

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
REASON_LIMIT = 200
MAX_CALL_TOKENS = 100_000_000  # more than any model reads and writes in one call: a larger count is malformed


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
    """POSTs JSON to one provider over a kept-alive connection per thread, with retries.

    Thread-safe: fan-out branches and batch runs share it, each thread on its own
    connection, so a call costs the same however many are in flight (ADR 0033).
    How many requests are in flight is the run's one limit (`--concurrency`); a
    provider's `max_in_flight`, when the config sets one, caps its own requests
    further (a semaphore). `sleep` is injectable so tests can observe the delays
    without waiting for them.
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
        self._headers = {
            "User-Agent": f"mklang/{__version__}",
            "Content-Type": "application/json",
            **self._endpoint.request_headers,
            **headers,
        }
        self._local = threading.local()
        self._kept: weakref.WeakSet[_Kept] = weakref.WeakSet()
        self._kept_lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpTransport({self.config.name!r}, {self.config.base_url!r})"

    def close(self) -> None:
        """Close every thread's connection; a later `post` raises RuntimeError."""
        self._closed = True
        with self._kept_lock:
            kept = list(self._kept)
        for each in kept:
            each.connection.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` and return the decoded JSON object, retrying what can be retried."""
        if self._closed:
            raise RuntimeError(f"{self.config.name}: the HTTP client is closed")
        name = self.config.name
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            try:
                with self._slots:
                    read, connect = self._timeouts()  # after waiting for a slot: what is left now
                    response, data = self._exchange(self._endpoint.target(path), payload, read, connect)
            except _Failed as failed:
                failure, delay = failed.args[0], None
            except ssl.SSLCertVerificationError as error:
                raise ProviderError(
                    f"{name} connection-error: the certificate of {self._endpoint.host} is not trusted "
                    f"({error.verify_message}); SSL_CERT_FILE names the certificates to trust"
                ) from None
            except (OSError, HTTPException) as error:
                failure, delay = f"connection-error: {self._snippet(_described(error))}", None
            else:
                if response.status == 200:
                    return self._decode(data)
                failure = f"{response.status}: {self._reason(data, response.reason or _phrase(response.status))}"
                if response.status not in RETRYABLE_STATUS:
                    raise ProviderError(f"{name} {failure}{self._key_hint(response.status)}")
                delay = retry_after(response.getheader("retry-after"))
            if attempt + 1 == attempts:
                break
            pause = self._delay(attempt, delay)
            left = seconds_left()
            if left is not None and pause >= left:
                raise ProviderError(f"{name} {failure} (no time left for a retry before the --max-time deadline)")
            self._sleep(pause)
        raise ProviderError(f"{name} {failure} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _exchange(self, target: str, payload: bytes, read: float, connect: float) -> tuple[HTTPResponse, bytes]:
        """One request on this thread's connection, opened first when it is not open: the
        response and its whole body. Any failure closes the connection, so the next call
        opens a fresh one; a timeout raises `_Failed`, other errors propagate."""
        connection = self._connection()
        try:
            if connection.sock is not None and _readable(connection.sock):
                connection.close()  # an idle connection the server closed (or wrote to unasked): not reused
            if connection.sock is None:
                connection.timeout = connect
                try:
                    connection.connect()
                except TimeoutError:
                    raise _Failed(f"timeout: no connection within {connect:.3g}s") from None
            connection.sock.settimeout(read)
            try:
                connection.request("POST", target, payload, self._headers)
                response = connection.getresponse()
                return response, response.read()
            except TimeoutError:
                raise _Failed(f"timeout: no answer within {read:.3g}s") from None
        except BaseException:
            connection.close()
            raise

    def _connection(self) -> HTTPConnection:
        """This thread's connection object (its socket may be closed)."""
        kept: _Kept | None = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = _Kept(self._endpoint.connection())
            with self._kept_lock:
                self._kept.add(kept)
        return kept.connection

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


class _Failed(Exception):
    """A timeout, already worded as the failure of one attempt."""


class _Kept:
    """A thread's connection to one provider: closed when the thread ends (the thread-local
    holding it is dropped) or when the transport closes."""

    __slots__ = ("__weakref__", "connection")

    def __init__(self, connection: HTTPConnection):
        self.connection = connection

    def __del__(self) -> None:
        self.connection.close()


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: its server closed it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _described(error: BaseException) -> str:
    """A connection error as one readable phrase: an OSError says what failed, an
    HTTPException (a broken response) is named by its kind."""
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
    """Where a provider's requests go: its server, directly or through an `http://` proxy.

    Read once per provider, from its `base_url` and the environment, as httpx did:
    the proxy variables and, for HTTPS, the certificates to trust (one
    `ssl.SSLContext`, shared by the provider's connections)."""

    host: str
    port: int
    prefix: str  # the base URL's path; every request path follows it
    tls: ssl.SSLContext | None  # None: plain HTTP
    proxy: tuple[str, int] | None = None
    proxy_headers: dict[str, str] | None = None

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
        https = url.scheme == "https"
        proxy, headers = _proxy(url.scheme, host, port)
        return cls(
            host, port or (443 if https else 80), url.path, trusted_certificates() if https else None, proxy, headers
        )

    @property
    def request_headers(self) -> dict[str, str]:
        """Headers every request carries: a plain-HTTP proxy's credentials (a tunnel sends them once)."""
        return (self.proxy_headers or {}) if self.tls is None else {}

    def connection(self) -> HTTPConnection:
        """A new, unopened connection to the server, tunnelled through the proxy for HTTPS."""
        host, port = self.proxy or (self.host, self.port)
        if self.tls is None:
            return HTTPConnection(host, port)
        connection = HTTPSConnection(host, port, context=self.tls)
        if self.proxy is not None:
            connection.set_tunnel(self.host, self.port, self.proxy_headers)
        return connection

    def target(self, path: str) -> str:
        """The request target: the path, or the absolute URL a plain-HTTP proxy forwards."""
        if self.tls is None and self.proxy is not None:
            return f"http://{_netloc(self.host, self.port)}{self.prefix}{path}"
        return self.prefix + path


def _proxy(scheme: str, host: str, port: int | None) -> tuple[tuple[str, int] | None, dict[str, str] | None]:
    """The proxy the environment names for `scheme://host:port` and the headers that
    authenticate to it, or (None, None): `HTTPS_PROXY`/`HTTP_PROXY`, else `ALL_PROXY`,
    unless `NO_PROXY` lists the host. Only an `http://` proxy can be used; any other
    is refused, since ignoring it would send the requests around it."""
    proxies = urllib.request.getproxies_environment()
    setting = proxies.get(scheme) or proxies.get("all")
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # public, not in typeshed
    if not setting or bypass(_netloc(host, port), proxies):
        return None, None
    url = urllib.parse.urlsplit(setting if "://" in setting else f"http://{setting}")
    shown = f"{url.scheme}://{url.hostname}" + (f":{url.port}" if url.port else "")
    if url.scheme != "http" or not url.hostname:
        raise UsageError(
            f"the proxy {shown} for {scheme}://{host} cannot be used: mklang reaches proxies at http:// "
            "addresses only (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY lists the hosts to reach directly)"
        )
    headers = {}
    if url.username is not None:
        credentials = f"{urllib.parse.unquote(url.username)}:{urllib.parse.unquote(url.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return (url.hostname, url.port or 80), headers


def _netloc(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def trusted_certificates() -> ssl.SSLContext:
    """A TLS context that verifies servers against `SSL_CERT_FILE` or `SSL_CERT_DIR` when
    one is set, else certifi's bundle (what httpx trusted); an unreadable file is refused."""
    cafile, capath = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
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

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._transport.post(self.path, {**self.config.params, **body})

    def _fail(self, model: str, what: str) -> ProviderError:
        """An error about an answer; `what` may quote the server, so the key is scrubbed from it."""
        return ProviderError(redact(f"{self.config.name} {model}: {what}", self._key))

    def _shape_error(self, model: str, missing: str) -> ProviderError:
        return self._fail(model, f"unexpected response shape: no {missing}")
