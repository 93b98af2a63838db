"""`make_provider`: from CLI options and the host config to a ready `Provider`.

Replay needs neither config nor network. Otherwise the config is resolved
(see `mklang.host.config`), one client is built per provider (shared by its
tiers, so fan-out shares its connection pool and request limit), and a
dollar budget is refused up front when a routed model has no price.
"""

from __future__ import annotations

import os

from mklang.errors import UsageError
from mklang.host.config import HostConfig, ProviderConfig, load_config
from mklang.providers.anthropic import AnthropicClient
from mklang.providers.base import Provider
from mklang.providers.http import ProviderClient
from mklang.providers.openai import OpenAIClient
from mklang.providers.routed import RoutedProvider, Target
from mklang.vocabulary import TIERS

CLIENTS: dict[str, type[ProviderClient]] = {"openai": OpenAIClient, "anthropic": AnthropicClient}


def make_provider(
    *,
    provider: str | None = None,
    model: str | None = None,
    config_path: str | os.PathLike[str] | None = None,
    record: str | os.PathLike[str] | None = None,
    replay: str | os.PathLike[str] | None = None,
    max_cost: float | None = None,
    config: HostConfig | None = None,
    priced_for: str = "--max-cost",
) -> Provider:
    """The provider for one run. Raises `UsageError` for anything the operator must fix first.

    `config` is the host config when the caller has loaded it already. A dollar limit
    (`max_cost`, given as the option `priced_for`) needs every model's price."""
    if record is not None and replay is not None:
        raise UsageError("--record and --replay cannot be used together")
    if replay is not None:
        from mklang.providers.cassette import ReplayProvider

        return ReplayProvider(replay)
    config = config or load_config(config_path, provider=provider, model=model)
    routed = build_routed(config, max_cost=max_cost, priced_for=priced_for)
    if record is not None:  # cassettes are YAML: its parser is loaded only for one
        from mklang.providers.cassette import RecordingProvider

        return RecordingProvider(routed, record)
    return routed


def build_routed(
    config: HostConfig, *, max_cost: float | None = None, priced_for: str = "--max-cost"
) -> RoutedProvider:
    """One client per provider in use, one target per tier."""
    routes = {tier: route for tier in TIERS if (route := config.route(tier)) is not None}
    if not routes:
        raise UsageError(
            "no model configured: pass --provider (openai, anthropic, ollama) and --model, "
            "or map tiers in a config file (see `mklang config`)"
        )
    if max_cost is not None:
        for tier, route in routes.items():
            if config.price(route) is None:
                raise UsageError(
                    f"{priced_for} needs a price for {route.key} (tier {tier}): "
                    f'add [prices."{route.key}"] input = ..., output = ... (USD per million tokens) to the config'
                )
    clients: dict[str, ProviderClient] = {}
    targets: dict[str, Target] = {}
    for route in routes.values():
        config.provider(route.provider).require_key()
    for tier, route in routes.items():
        if route.provider not in clients:
            clients[route.provider] = make_client(config.provider(route.provider))
        targets[tier] = Target(route, clients[route.provider], config.price(route))
    where = f"add it to [tiers] in {config.source}" if config.source else "pass --model"
    return RoutedProvider(targets, where)


def make_client(config: ProviderConfig) -> ProviderClient:
    return CLIENTS[config.kind](config)
