"""`mklang config`: the resolved host config, which keys are set (never their values)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from mklang.cli.app import OutputFormat, app, handle_errors, print_json, wants_json

config_app = typer.Typer()
app.add_typer(config_app, name="config")


@config_app.callback(invoke_without_command=True)
def config(
    context: typer.Context,
    config_path: Path | None = typer.Option(None, "--config", help="The config file (default: search, see below)."),
    provider: str | None = typer.Option(None, "--provider", help="Send every tier to this provider."),
    model: str | None = typer.Option(None, "--model", help="Use this model for every tier."),
    fmt: OutputFormat = typer.Option(OutputFormat.auto, "--format", help="text, json, or auto (json when piped)."),
) -> None:
    """Show the resolved provider config: tiers, their prices, providers, and whether each API key is set.

    The config is `--config`, else $MKLANG_CONFIG, else ./mklang.toml, else
    $XDG_CONFIG_HOME/mklang/config.toml (~/.config/mklang/config.toml). A
    ./mklang.toml that sends a key variable to a host of its own is used only
    once allowed: `mklang config allow mklang.toml`.
    """
    if context.invoked_subcommand is not None:
        return
    with handle_errors(wants_json(fmt)):
        from mklang.host.config import load_config, search_paths

        data = load_config(config_path, provider=provider, model=model).describe()
        data["searched"] = [str(path) for path in search_paths()] if config_path is None else [str(config_path)]
        if wants_json(fmt):
            print_json(data)
        else:
            print(render_text(data))


@config_app.command("allow")
def allow(
    path: Path = typer.Argument(Path("mklang.toml"), help="The project's config file (default ./mklang.toml)."),
) -> None:
    """Let a config found in this folder send API keys where it says, until its text changes (like `direnv allow`)."""
    with handle_errors():
        from mklang.host.config import allow_config

        does = allow_config(path).unallowed()
        said = f": it {', '.join(does)}" if does else ""
        print(f"allowed {path.absolute()}{said} (until it changes)")


def render_text(data: dict[str, Any]) -> str:
    lines = [f"config: {data['source'] or 'none found (searched ' + ', '.join(data['searched']) + ')'}"]
    lines.append("tiers:")
    for tier, key in data["tiers"].items():
        price = data["tier_prices"][tier]
        cost = "no price"
        if price:
            cost = f"${price['input']:g} in / ${price['output']:g} out per million tokens, from {price['source']}"
        lines.append(f"  {tier:<10} {key}  ({cost})")
    if not data["tiers"]:
        lines.append("  (none: pass --provider and --model, or map tiers in the config)")
    lines.append("providers:")
    for name, p in data["providers"].items():
        key = f"{p['api_key_env']} {'set' if p['api_key_set'] else 'not set'}" if p["api_key_env"] else "no key"
        lines.append(f"  {name}: {p['kind']} {p['base_url']} (key: {key})")
        lines.append(
            f"    timeout {p['timeout']:g}s, connect {p['connect_timeout']:g}s, retries {p['retries']}, "
            f"backoff {p['backoff']:g}s..{p['max_backoff']:g}s, "
            f"max_in_flight {p['max_in_flight'] or 'per --concurrency'}, "
            f"max_tokens {p['max_tokens']}, reasoning {p['reasoning']}"
        )
        if p["params"]:
            lines.append(f"    params {json.dumps(p['params'], sort_keys=True)}")
    return "\n".join(lines)
