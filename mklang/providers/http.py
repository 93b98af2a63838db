"""The HTTP plumbing both wire formats share: one pooled client, a request limit, retries.

Retries follow one rule: 429, 408, 5xx, timeouts and connection errors are
tried again after an exponential, jittered delay (or the server's
`Retry-After`, capped at `max_backoff`); any other status fails at once.
After the last attempt a `ProviderError("<provider> <status>: <reason>")`
is raised. The API key is scrubbed from every message this module builds.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mklang.errors import ProviderError
from mklang.host.config import ProviderConfig
from mklang.providers.base import seconds_left


def _import_httpx_without_its_command_line() -> None:
    """`import httpx` also imports httpx's command-line client, which loads click, rich
    and pygments when they are installed (tens of milliseconds of every `mklang run`
    over HTTP). A None entry in `sys.modules` makes that one import fail, and httpx
    then defines a stand-in `httpx.main`; the entry is removed again at once."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx  # noqa: F401
    finally:
        del sys.modules["httpx._main"]


_import_httpx_without_its_command_line()
import httpx  # noqa: E402

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
    """POSTs JSON to one provider with pooling and retries.

    Thread-safe: fan-out branches share it. How many requests are in flight
    is the run's one limit (`--concurrency`); a provider's `max_in_flight`,
    when the config sets one, caps its own requests further (a semaphore and
    a pool of that size). `sleep` is injectable so tests can observe the
    delays without waiting for them.
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
        limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
        self._client = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=limits,
        )

    def __repr__(self) -> str:
        return f"HttpTransport({self.config.name!r}, {self.config.base_url!r})"

    def close(self) -> None:
        self._client.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` and return the decoded JSON object, retrying what can be retried."""
        name = self.config.name
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            try:
                with self._slots:
                    timeout = self._timeout()  # after waiting for a slot: what is left now
                    response = self._client.post(path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                failure, delay = f"timeout: no answer within {timeout.read:.3g}s", None
            except httpx.TransportError as error:
                failure, delay = f"connection-error: {self._clean(str(error) or type(error).__name__)}", None
            else:
                if response.status_code == 200:
                    return self._decode(response)
                failure = f"{response.status_code}: {self._reason(response)}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise ProviderError(f"{name} {failure}{self._key_hint(response.status_code)}")
                delay = retry_after(response.headers.get("retry-after"))
            if attempt + 1 == attempts:
                break
            pause = self._delay(attempt, delay)
            left = seconds_left()
            if left is not None and pause >= left:
                raise ProviderError(f"{name} {failure} (no time left for a retry before the --max-time deadline)")
            self._sleep(pause)
        raise ProviderError(f"{name} {failure} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _timeout(self) -> httpx.Timeout:
        """The configured timeouts, shortened to what is left before the run's deadline."""
        left = seconds_left()
        if left is not None and left <= 0:
            raise ProviderError(f"{self.config.name} timeout: the --max-time deadline passed before the request")
        read, connect = self.config.timeout, self.config.connect_timeout
        if left is not None:
            read, connect = min(read, left), min(connect, left)
        return httpx.Timeout(read, connect=connect, pool=read)

    def _delay(self, attempt: int, retry_after_seconds: float | None) -> float:
        """The server's Retry-After when it gave one, else exponential backoff with jitter."""
        if retry_after_seconds is not None:
            return min(retry_after_seconds, self.config.max_backoff)
        ceiling = min(self.config.max_backoff, self.config.backoff * 2**attempt)
        return float(ceiling * random.uniform(0.5, 1.0))

    def _decode(self, response: httpx.Response) -> dict[str, Any]:
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ProviderError(
                f"{self.config.name} 200: response is not JSON: {self._snippet(response.text)}"
            ) from None
        if not isinstance(data, dict):
            raise ProviderError(f"{self.config.name} 200: response is not a JSON object")
        return data

    def _reason(self, response: httpx.Response) -> str:
        """The server's own error message when it sent one, else the HTTP reason phrase."""
        try:
            error = response.json().get("error")
            message = error.get("message") if isinstance(error, dict) else error
        except (ValueError, AttributeError):
            message = None
        return self._snippet(message if isinstance(message, str) and message else response.reason_phrase)

    def _key_hint(self, status: int) -> str:
        if status in (401, 403) and self.config.api_key_env and self._secret is None:
            return f" ({self.config.api_key_env} is not set)"
        return ""

    def _snippet(self, text: str) -> str:
        text = " ".join(self._clean(text).split())
        return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."

    def _clean(self, text: str) -> str:
        return redact(text, self._secret)


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
