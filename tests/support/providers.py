"""Providers of the fake server built by hand, and the one-line error a provider call fails with."""

from __future__ import annotations

from typing import Any

import pytest

from mklang.errors import ProviderError
from mklang.host.config import ProviderConfig
from mklang.providers.http import HttpTransport
from support.fakeserver import FakeServer


def provider_config(server: FakeServer, kind: str = "openai", **options: Any) -> ProviderConfig:
    """Provider `p` of `kind` at the fake server: no retry, short waits; `options` change any setting."""
    base_url = server.openai_url if kind == "openai" else server.anthropic_url
    settings: dict[str, Any] = {"retries": 0, "backoff": 0.001, "max_backoff": 0.01, "timeout": 5, **options}
    return ProviderConfig(name="p", kind=kind, base_url=base_url, **settings)  # type: ignore[arg-type]


def http_transport(server: FakeServer, slept: list[float] | None = None, **options: Any) -> HttpTransport:
    """An OpenAI-wire transport to the fake server that records its waits in `slept` instead of sleeping."""
    sleep = slept.append if slept is not None else (lambda seconds: None)
    return HttpTransport(provider_config(server, **options), {}, sleep=sleep)


def provider_error(call: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the ProviderError `call(*args, **kwargs)` raises."""
    with pytest.raises(ProviderError) as caught:
        call(*args, **kwargs)
    return str(caught.value)
