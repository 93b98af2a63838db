"""Host configuration: which provider and model answers each tier, and at what price.

A `.mk` file names only tiers (`fast`, `balanced`, `reasoning`); this module
maps them to `provider:model` pairs. The config is TOML, found in this order:
`--config PATH`, `$MKLANG_CONFIG`, `./mklang.toml`, then the user config
folder (`$XDG_CONFIG_HOME/mklang/config.toml` or `~/.config/mklang/config.toml`).
`--provider` and `--model` override every tier's provider and model, so a
run needs no file at all: the built-in providers `openai`, `anthropic` and
`ollama` honour the usual environment variables.

The config holds the *name* of the variable that holds an API key, never
the key itself; the key is read from the environment only when a client is
built.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from mklang.errors import UsageError
from mklang.files import write_atomic
from mklang.limits import read_text
from mklang.mcp.servers import McpServer, parse_servers
from mklang.vocabulary import TIERS

KINDS = ("openai", "anthropic")
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})  # a server here may need no API key


@dataclass(frozen=True)
class ProviderConfig:
    """One model endpoint and how to talk to it.

    `base_url` follows each vendor's SDK convention: OpenAI-compatible URLs
    include `/v1` (requests go to `{base_url}/chat/completions`), Anthropic
    URLs do not (requests go to `{base_url}/v1/messages`).
    """

    name: str
    kind: Literal["openai", "anthropic"]
    base_url: str
    api_key_env: str | None = None
    timeout: float = 120.0  # seconds to wait for a response
    connect_timeout: float = 10.0
    retries: int = 3  # extra attempts after the first, on 429, 5xx and connection errors
    backoff: float = 1.0  # first retry delay in seconds; doubles per attempt, with jitter
    max_backoff: float = 30.0  # ceiling for one delay, Retry-After included
    max_in_flight: int | None = None  # a cap of this provider's own; None: the run's --concurrency decides
    max_tokens: int = 4096  # answer length cap sent to Anthropic (OpenAI-compatible: set it in params)
    reasoning: Literal["native", "scratchpad"] = "scratchpad"
    thinking_budget: int = 2048  # Anthropic `thinking.budget_tokens` for `reason` states
    params: dict[str, Any] = field(default_factory=dict)  # extra request body fields

    def api_key(self) -> str | None:
        """The key from the environment, or None (a local server needs none).

        A key in quotes, with whitespace (a pasted newline, a trailing `\\r`) or
        other than printable ASCII is refused here, before any request could
        carry it into a header error; the message names the variable, never
        the value.
        """
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env) or None
        if key is not None and (key[0] in "\"'" or not (key.isascii() and key.isprintable()) or " " in key):
            raise UsageError(
                f"{self.api_key_env} is malformed: it holds quotes, whitespace, control or non-ASCII characters "
                "(a stray newline or \\r?); set it to the key alone"
            )
        return key

    def answer_cap(self, reason: bool) -> int | None:
        """The most tokens one answer may take, or None when nothing caps it: Anthropic's `max_tokens`
        (plus the thinking budget for a natively reasoning state), an OpenAI-compatible provider's
        `max_completion_tokens` or `max_tokens` param."""
        if self.kind == "anthropic":
            native = reason and self.reasoning == "native"
            return self.max_tokens + (self.thinking_budget if native else 0)
        for name in ("max_completion_tokens", "max_tokens"):
            value = self.params.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    def require_key(self) -> None:
        """Refuse, before any request, a malformed key, or a missing one where it is needed:
        a server on this machine (a local model, a test server) may need none, any other
        endpoint would only answer 401, after retries."""
        if self.api_key() is None and self.api_key_env and urlsplit(self.base_url).hostname not in LOCAL_HOSTS:
            raise UsageError(
                f"{self.api_key_env} is not set: the {self.name} provider ({self.base_url}) needs it; "
                f"export {self.api_key_env}=<your key>"
            )

    def describe(self) -> dict[str, Any]:
        """Everything about this provider that is safe to print: no key, only whether it is set."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["api_key_set"] = self.api_key() is not None
        return data


@dataclass(frozen=True)
class Route:
    """The provider and model that answer one tier."""

    provider: str
    model: str

    @property
    def key(self) -> str:
        return f"{self.provider}:{self.model}"

    @classmethod
    def parse(cls, text: str, where: str) -> Route:
        provider, sep, model = text.partition(":")
        if not sep or not provider or not model:
            raise UsageError(f"{where}: expected 'provider:model', got {text!r}")
        return cls(provider, model)


MAX_PRICE = 1_000_000.0  # USD per million tokens: far above any model's; a larger price is a typo


@dataclass(frozen=True)
class Price:
    """USD per million input and output tokens, and where they came from (the config, genai-prices)."""

    input: float
    output: float
    source: str = "the config"

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input + output_tokens * self.output) / 1_000_000


# What genai-prices said in this process, by (provider, base_url, model): looked up once each.
_CATALOG: dict[tuple[str, str, str], Price | None] = {}


def catalog_price(provider: str, base_url: str, model: str) -> Price | None:
    """What genai-prices (maintained price data of the major providers) says `model` costs, or None.

    A built-in provider is looked up by name, any other by its endpoint. Tiered
    prices are read at a million tokens, so a cap never counts a call cheaper
    than it was."""
    key = (provider, base_url, model)
    if key not in _CATALOG:
        _CATALOG[key] = _looked_up(provider, base_url, model)
    return _CATALOG[key]


def catalog_prices() -> list[dict[str, Any]]:
    """The genai-prices answers of this process, as JSON, for `known_catalog_prices` in another."""
    return [{"route": list(key), "price": None if price is None else asdict(price)} for key, price in _CATALOG.items()]


def known_catalog_prices(answers: list[dict[str, Any]]) -> None:
    """Take another process's `catalog_prices` as this one's: a child of a spread batch is handed
    its parent's, and does not load the price table (a third of a second of its start-up)."""
    for answer in answers:
        provider, base_url, model = answer["route"]
        _CATALOG[(provider, base_url, model)] = None if answer["price"] is None else Price(**answer["price"])


def _looked_up(provider: str, base_url: str, model: str) -> Price | None:
    from importlib.metadata import version

    from genai_prices import Usage, calc_price

    def per_million(usage: Usage) -> float:
        if provider in KINDS:
            return float(calc_price(usage, model, provider_id=provider).total_price)
        return float(calc_price(usage, model, provider_api_url=base_url).total_price)

    try:
        per_input, per_output = per_million(Usage(input_tokens=1_000_000)), per_million(Usage(output_tokens=1_000_000))
    except (LookupError, ValueError):
        return None
    price = Price(per_input, per_output, f"genai-prices {version('genai-prices')}")
    return price if _valid_price(price) else None


def _valid_price(price: Price) -> bool:
    return all(math.isfinite(value) and 0 <= value <= MAX_PRICE for value in (price.input, price.output))


def builtin_providers() -> dict[str, ProviderConfig]:
    """Providers usable with no config file, read from the environment at call time."""
    return {
        "openai": ProviderConfig(
            name="openai",
            kind="openai",
            base_url=os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1",
            api_key_env="OPENAI_API_KEY",
        ),
        "anthropic": ProviderConfig(
            name="anthropic",
            kind="anthropic",
            base_url=os.environ.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com",
            api_key_env="ANTHROPIC_API_KEY",
            reasoning="native",
        ),
        "ollama": ProviderConfig(name="ollama", kind="openai", base_url="http://localhost:11434/v1"),
    }


@dataclass(frozen=True)
class HostConfig:
    """The resolved config: providers by name, tier routes, prices by `provider:model`, the
    host tools the operator classifies read-only (`[tools] read_only`, control-flow taint), and
    the MCP servers whose tools runs may use (`[mcp.servers.NAME]`, docs/mcp.md)."""

    source: Path | None
    providers: dict[str, ProviderConfig]
    tiers: dict[str, Route]
    prices: dict[str, Price]
    read_only_tools: frozenset[str] = frozenset()
    prompt_tokens: int | None = None  # `[limits]`: the most tokens a call's prompt takes, for cost bounds
    mcp_servers: tuple[McpServer, ...] = ()

    def route(self, tier: str) -> Route | None:
        return self.tiers.get(tier) or self.tiers.get("default")

    def provider(self, name: str) -> ProviderConfig:
        found = self.providers.get(name) or builtin_providers().get(name)
        if found is None:
            known = sorted(set(self.providers) | set(builtin_providers()))
            raise UsageError(f"unknown provider {name!r} (known: {', '.join(known)})")
        return found

    def price(self, route: Route) -> Price | None:
        """The config's price of a route, else the one genai-prices knows, else None."""
        if route.key in self.prices:
            return self.prices[route.key]
        return catalog_price(route.provider, self.provider(route.provider).base_url, route.model)

    def with_overrides(self, provider: str | None, model: str | None) -> HostConfig:
        """Apply `--provider` / `--model`: each replaces that half of every tier's route."""
        if provider is None and model is None:
            return self
        tiers = dict(self.tiers)
        for tier in TIERS:
            base = self.route(tier)
            new_provider = provider or (base.provider if base else None)
            new_model = model or (base.model if base else None)
            if new_provider is None and len(self.providers) == 1:
                new_provider = next(iter(self.providers))
            if new_provider is None:
                raise UsageError("--model needs --provider (or a config that maps tiers or defines one provider)")
            if new_model is None:
                raise UsageError(f"--provider {provider} needs --model (or a config that maps tier {tier!r})")
            tiers[tier] = Route(new_provider, new_model)
        tiers.pop("default", None)
        self.provider(tiers[TIERS[0]].provider)  # fail early on an unknown name
        return replace(self, tiers=tiers)

    def key_routes(self) -> list[str]:
        """Where this config sends a key variable other than where the built-in providers do."""
        routes = []
        for name, mine in sorted(self.providers.items()):
            builtin = builtin_providers().get(name)
            same = builtin is not None and (mine.api_key_env, mine.base_url) == (builtin.api_key_env, builtin.base_url)
            if mine.api_key_env is not None and not same:
                routes.append(f"{mine.api_key_env} to {mine.base_url}")
        return routes

    def unallowed(self) -> list[str]:
        """What this config does that a config found in the working folder may not do until the
        user allows it: send a key variable elsewhere than the built-in providers do, start or
        reach an MCP server (it would run a command of a cloned repository's choosing)."""
        return [f"sends {route}" for route in self.key_routes()] + [server.describe() for server in self.mcp_servers]

    def describe(self) -> dict[str, Any]:
        """The resolved config as JSON-ready data, for `mklang config`."""
        used = {route.provider for route in self.tiers.values()} | set(self.providers)
        return {
            "source": str(self.source) if self.source else None,
            "tiers": {tier: route.key for tier, route in self.tiers.items()},
            "tier_prices": {tier: _described(self.price(route)) for tier, route in self.tiers.items()},
            "providers": {name: self.provider(name).describe() for name in sorted(used)},
            "prices": {key: {"input": p.input, "output": p.output} for key, p in sorted(self.prices.items())},
            "tools": {"read_only": sorted(self.read_only_tools)},
            "mcp": {server.name: server.describe() for server in self.mcp_servers},
        }


def _described(price: Price | None) -> dict[str, Any] | None:
    return None if price is None else {"input": price.input, "output": price.output, "source": price.source}


# `api_key_env` rule (docs/limits.md): a config names only variables that look
# like a model provider's key, so a config file cannot have a run send another
# secret (a GitHub token, cloud credentials, the checkpoint key) to an endpoint.
_KEY_ENV = re.compile(r"[A-Z][A-Z0-9_]*_KEY")
_OTHER_SECRETS = re.compile(
    r"^(MKLANG|AWS|AZURE|GCP|GOOGLE_APPLICATION|GITHUB|GH|GITLAB|SSH|GPG|PGP|NPM|PYPI|DOCKER)_|SECRET|PRIVATE|PASSWORD|TOKEN"
)


def _check_key_env(name: str, provider: str, label: str) -> None:
    """Refuse an `api_key_env` that does not look like this provider's key variable."""
    vendor = provider.upper() if provider in builtin_providers() else None
    if not _KEY_ENV.fullmatch(name) or _OTHER_SECRETS.search(name) or (vendor and vendor not in name):
        must = f", contain {vendor}" if vendor else ""
        raise UsageError(
            f"{label}: api_key_env {name!r} does not look like a model key variable "
            f"(it must be upper case, end in _KEY{must}, and not name another kind of secret)"
        )


def config_folder() -> Path:
    """The user's config folder: $XDG_CONFIG_HOME/mklang, else ~/.config/mklang."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")) / "mklang"


PROJECT_CONFIG = Path("mklang.toml")  # found in the working folder: maybe a cloned repository's


def search_paths() -> list[Path]:
    """Where a config is looked for when no `--config` is given, in order."""
    paths = []
    if os.environ.get("MKLANG_CONFIG"):
        paths.append(Path(os.environ["MKLANG_CONFIG"]))
    paths.append(PROJECT_CONFIG)
    paths.append(config_folder() / "config.toml")
    return paths


def find_config(config_path: str | os.PathLike | None = None) -> Path | None:
    """The config file to use, or None. An explicit path (or $MKLANG_CONFIG) must exist."""
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise UsageError(f"config file not found: {path}")
        return path.absolute()
    for index, path in enumerate(search_paths()):
        explicit = index == 0 and bool(os.environ.get("MKLANG_CONFIG"))
        if path.is_file():
            return path.absolute()
        if explicit:
            raise UsageError(f"config file not found: {path} (from MKLANG_CONFIG)")
    return None


def load_config(
    config_path: str | os.PathLike | None = None,
    *,
    provider: str | None = None,
    model: str | None = None,
) -> HostConfig:
    """Find, read and validate the config, then apply `--provider` / `--model`.

    A config found in the working folder that sends a key variable anywhere the
    built-in providers do not is not used until the user allows it (`mklang
    config allow`): the user's own config is used instead, and stderr says so.
    """
    path = find_config(config_path)
    if path is None:
        return HostConfig(None, {}, {}, {}).with_overrides(provider, model)
    text = read_text(path, "config")
    config = _read(path, text)
    if path == PROJECT_CONFIG.absolute() and config_path is None and config.unallowed():
        allowed = allowed_configs().get(str(path))
        if allowed != _sha256(text):
            changed = " (changed since it was allowed)" if allowed else ""
            print(
                f"mklang: note: {path} (found in the working folder) is not used{changed}: it "
                f"{', '.join(config.unallowed())}; `mklang config allow {path}` to use it, or name it with --config",
                file=sys.stderr,
            )
            own = config_folder() / "config.toml"
            config = _read(own, read_text(own, "config")) if own.is_file() else HostConfig(None, {}, {}, {})
    return config.with_overrides(provider, model)


ALLOWED_FILE = "allowed-configs"  # one line per allowed project config: the sha256 of its text, its absolute path


def allowed_configs() -> dict[str, str]:
    """The project configs the user allowed: absolute path -> sha256 of the text allowed."""
    record = config_folder() / ALLOWED_FILE
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise UsageError(f"{record}: cannot read the allowed configs: {error.strerror}") from None
    pairs = (line.split(" ", 1) for line in lines if " " in line)
    return {path: digest for digest, path in pairs}


def allow_config(path: str | os.PathLike) -> HostConfig:
    """Record `path`'s text as allowed (`mklang config allow`): it may route keys until it changes."""
    found = Path(path).absolute()
    if not found.is_file():
        raise UsageError(f"config file not found: {found}")
    text = read_text(found, "config")
    config = _read(found, text)  # a file that does not load is not worth allowing
    allowed = {**allowed_configs(), str(found): _sha256(text)}
    record = config_folder() / ALLOWED_FILE
    try:
        record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(record, "".join(f"{digest} {name}\n" for name, digest in sorted(allowed.items())).encode())
    except OSError as error:
        raise UsageError(f"{record}: cannot record the allowed config: {error.strerror}") from None
    return config


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read(path: Path, text: str) -> HostConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path}: invalid TOML: {error}") from None
    except RecursionError:
        raise UsageError(f"{path}: invalid TOML: values nested too deeply") from None
    where = str(path)
    _only_keys(data, {"tiers", "providers", "prices", "tools", "limits", "mcp"}, where)
    providers: dict[str, ProviderConfig] = {}
    prices: dict[str, Price] = {}
    for name, table in _table(data, "providers", where).items():
        providers[name] = _provider(name, _as_table(table, f"{where}: [providers.{name}]"), where, prices)
    for key, table in _table(data, "prices", where).items():
        prices[key] = _price(table, f"{where}: [prices.{key!r}]")
        Route.parse(key, f"{where}: [prices]")
    tiers = {}
    for tier, text in _table(data, "tiers", where).items():
        if tier not in (*TIERS, "default"):
            raise UsageError(f"{where}: [tiers] unknown tier {tier!r} (expected one of {', '.join(TIERS)} or default)")
        if not isinstance(text, str):
            raise UsageError(f"{where}: [tiers] {tier} must be a string 'provider:model'")
        tiers[tier] = Route.parse(text, f"{where}: [tiers] {tier}")
    config = HostConfig(
        path,
        providers,
        tiers,
        prices,
        _read_only_tools(_table(data, "tools", where), where),
        _prompt_tokens(_table(data, "limits", where), where),
        parse_servers(data.get("mcp", {}), where),
    )
    for tier, route in tiers.items():
        try:
            config.provider(route.provider)
        except UsageError as error:
            raise UsageError(f"{where}: [tiers] {tier}: {error}") from None
    return config


def _read_only_tools(table: dict, where: str) -> frozenset[str]:
    """`[tools] read_only = ["search", ...]`: tools that change nothing (ADR 0021)."""
    _only_keys(table, {"read_only"}, f"{where}: [tools]")
    names = table.get("read_only", [])
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UsageError(f"{where}: [tools] read_only must be a list of tool names")
    return frozenset(names)


def _prompt_tokens(table: dict, where: str) -> int | None:
    """`[limits] prompt_tokens = N`: what `check --cost` and a batch's preflight bound a prompt by."""
    _only_keys(table, {"prompt_tokens"}, f"{where}: [limits]")
    value = table.get("prompt_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(f"{where}: [limits] prompt_tokens must be a whole number of tokens, 1 or more")
    return value


_PROVIDER_FIELDS = {f.name: f for f in fields(ProviderConfig) if f.name != "name"}


def _provider(name: str, table: dict, where: str, prices: dict[str, Price]) -> ProviderConfig:
    label = f"{where}: [providers.{name}]"
    _only_keys(table, set(_PROVIDER_FIELDS) | {"prices"}, label)
    for model, price in _as_table(table.get("prices", {}), f"{label} prices").items():
        prices[f"{name}:{model}"] = _price(price, f"{label} prices.{model}")
    values = {key: value for key, value in table.items() if key != "prices"}
    base = builtin_providers().get(name)
    if base is None:
        for required in ("kind", "base_url"):
            if required not in values:
                raise UsageError(f"{label}: missing {required!r}")
    if values.get("kind", base.kind if base else None) not in KINDS:
        raise UsageError(f"{label}: kind must be one of {', '.join(KINDS)}")
    if "reasoning" in values and values["reasoning"] not in ("native", "scratchpad"):
        raise UsageError(f"{label}: reasoning must be 'native' or 'scratchpad'")
    if "kind" in values and "reasoning" not in values:
        values["reasoning"] = "native" if values["kind"] == "anthropic" else "scratchpad"
    for key, value in values.items():
        _check_type(key, value, label)
    if values.get("api_key_env") is not None:
        _check_key_env(values["api_key_env"], name, label)
    if base is not None:
        return replace(base, **values)
    return ProviderConfig(name=name, **values)


_TYPES: dict[str, Any] = {  # key -> the type(s) isinstance accepts
    "kind": str,
    "base_url": str,
    "api_key_env": str,
    "timeout": (int, float),
    "connect_timeout": (int, float),
    "retries": int,
    "backoff": (int, float),
    "max_backoff": (int, float),
    "max_in_flight": int,
    "max_tokens": int,
    "reasoning": str,
    "thinking_budget": int,
    "params": dict,
}


def _check_type(key: str, value: Any, label: str) -> None:
    expected = _TYPES[key]
    if isinstance(value, bool) or not isinstance(value, expected):
        raise UsageError(f"{label}: {key} has the wrong type ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{label}: {key} must be a finite number, got {value}")
    if key == "params":
        _check_params(value, label)
    if key == "base_url" and not value.startswith(("http://", "https://")):
        raise UsageError(f"{label}: base_url must start with http:// or https://, got {value!r}")
    if key in ("max_in_flight", "timeout", "connect_timeout") and value <= 0:
        raise UsageError(f"{label}: {key} must be positive")
    if key in ("retries", "backoff", "max_backoff", "max_tokens", "thinking_budget") and value < 0:
        raise UsageError(f"{label}: {key} must not be negative")


def _check_params(params: dict, label: str) -> None:
    """Extra request body fields are sent as JSON, which has no NaN, infinity or date: refused
    here, once, rather than failing every call of the run."""
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError):
        raise UsageError(f"{label}: params must hold JSON values only (no nan, inf or dates)") from None


def _price(table: Any, label: str) -> Price:
    table = _as_table(table, label)
    _only_keys(table, {"input", "output"}, label)
    try:
        price = Price(float(table["input"]), float(table["output"]))
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{label}: needs numbers 'input' and 'output' (USD per million tokens)") from None
    if not _valid_price(price):
        raise UsageError(f"{label}: prices must be numbers from 0 to {MAX_PRICE:,.0f} (USD per million tokens)")
    return price


def _table(data: dict, key: str, where: str) -> dict:
    return _as_table(data.get(key, {}), f"{where}: [{key}]")


def _as_table(value: Any, label: str) -> dict:
    if not isinstance(value, dict):
        raise UsageError(f"{label} must be a table")
    return value


def _only_keys(table: dict, allowed: set[str], label: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UsageError(f"{label}: unknown key {unknown[0]!r} (expected one of {', '.join(sorted(allowed))})")
