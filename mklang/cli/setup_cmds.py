"""`mklang init` (a project that passes its own tests) and `mklang doctor` (what a run would find).

Both were mklang 1.x commands. `init` writes a machine and its scenario script,
never over a file that exists; `doctor` prints one line per thing a run needs
(key variables, the config, the checkpoint key, a store, the extras), each
with what to do when it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import typer

from mklang import exitcodes
from mklang.cli.app import app, handle_errors

MACHINE = """# hello.mk: a one-line greeting for `name`, checked by a judge and repaired once.
# Reads `name`; writes `greeting` (the result).
mklang 0.4
machine hello
entry greet
budget 4
result greeting

context {
  name: "<who to greet>"
}

state greet {
  tier fast
  structure "One friendly line that greets the person by name."
  prompt "Write a one-line greeting for {{name}}."
  output greeting
  when "the greeting names the person" -> END
  when "the greeting leaves the name out" repair 1 -> greet
  otherwise fail
}
"""
SCRIPT = """# Scenarios of hello.mk, answered by a scripted model (no API key): run them with
#   mklang test hello.mk --script hello.scenarios.yaml
# The format is in docs/scenarios.md.
scenarios:
  - name: greets-by-name
    input: {name: Ada}
    llm:
      produce: ["Hello, Ada! Good to see you."]
      judge: [0]                       # the judge picks the first condition: it names the person
    expect:
      status: done
      result: "Hello, Ada! Good to see you."

  - name: repaired-once
    input: {name: Ada}
    llm:
      produce: ["Hello there!", "Hello, Ada!"]
      judge: [1, 0]                    # the name is left out: the state runs again, told why
    expect:
      status: done
      result: "Hello, Ada!"
      trace:
        - {state: greet, policy: repair, to: greet}
        - {state: greet, policy: ok, to: END}
"""
FILES = {"hello.mk": MACHINE, "hello.scenarios.yaml": SCRIPT}
# The extras and a module each one installs, with what needs it.
EXTRAS = {
    "console": ("starlette", "mklang serve"),
    "otel": ("opentelemetry.sdk", "OpenTelemetry export"),
    "lsp": ("pygls", "mklang lsp"),
    "distributed": ("celery", "batch --executor celery, mklang worker"),
}


@app.command("init")
def init(
    folder: Path = typer.Argument(Path("."), help="The project's folder (made if missing)."),
) -> None:
    """Start a project: a machine and its scenario script, whose `mklang test` passes. Files there are kept."""
    with handle_errors():
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in FILES.items():
            path = folder / name
            if path.exists():
                print(f"kept {path} (it exists)", file=sys.stderr)
                continue
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
        machine, script = (folder / name for name in FILES)
        print(f"next: mklang test {machine} --script {script}")
        print(f"then: mklang run {machine} --set name=Ada --provider openai --model gpt-4o-mini")


@app.command("doctor")
def doctor(
    store: str = typer.Option(".", "--store", help="The checkpoint store to reach (a folder or a URI)."),
    config: Path | None = typer.Option(None, "--config", help="The config file (default: searched as by run)."),
) -> None:
    """Check what a run needs, one line each, with what to do: key variables, config, checkpoint key, store, extras.
    Exit 2 when something a run would fail on is wrong; a missing key or extra is only reported."""
    with handle_errors():
        lines = [*_config_lines(config), _checkpoint_key_line(), _store_line(store), *_extra_lines()]
        for status, text in lines:
            print(f"{status:<8}{text}")
        raise typer.Exit(exitcodes.USAGE if any(status == "error" for status, _ in lines) else exitcodes.OK)


def _config_lines(path: Path | None) -> list[tuple[str, str]]:
    """The config, and the key variable of each provider it (or a run without one) may use."""
    from mklang.errors import MklangError
    from mklang.host.config import builtin_providers, load_config, search_paths

    try:
        loaded = load_config(path)
    except MklangError as error:
        return [("error", f"config: {error}: fix the file, or pass --config with another one")]
    if loaded.source is None:
        searched = ", ".join(str(p) for p in search_paths())
        line = ("ok", f"config: none found (searched {searched}); runs take --provider and --model")
    else:
        line = ("ok", f"config: {loaded.source} ({len(loaded.tiers)} tiers mapped; mklang config shows them)")
    lines = [line]
    providers = {**builtin_providers(), **{name: loaded.provider(name) for name in loaded.providers}}
    for name, provider in providers.items():
        if provider.api_key_env is None:
            continue
        if os.environ.get(provider.api_key_env):
            lines.append(("ok", f"{provider.api_key_env}: set (provider {name})"))
        else:
            lines.append(
                ("missing", f"{provider.api_key_env}: not set: export it to use provider {name} (no key is needed "
                 "for scenario scripts or a local Ollama)")
            )  # fmt: skip
    return lines


def _checkpoint_key_line() -> tuple[str, str]:
    from mklang.checkpoint.signing import KEY_VARIABLE, key_file

    if os.environ.get(KEY_VARIABLE):
        return "ok", f"checkpoint key: {KEY_VARIABLE} (the team's or fleet's)"
    if key_file().exists():
        return "ok", f"checkpoint key: {key_file()} (yours; set {KEY_VARIABLE} to share one)"
    return "ok", f"checkpoint key: {key_file()} is made on the first checkpoint (set {KEY_VARIABLE} to share one)"


def _store_line(uri: str) -> tuple[str, str]:
    from mklang.errors import MklangError, redacted
    from mklang.stores import open_store

    try:
        store = open_store(uri, create=False)
        try:
            count = len(store.runs())
        finally:
            store.close()
    except MklangError as error:  # its message names the store already: `URI: what is wrong`
        shown = redacted(uri)
        return "error", f"store {shown}: {str(error).removeprefix(shown + ': ')}"
    return (
        "ok",
        f"store {redacted(uri)}: reachable, {count} run{'' if count == 1 else 's'} (mklang runs --store lists them)",
    )


def _extra_lines() -> list[tuple[str, str]]:
    lines = []
    for extra, (module, needed_by) in EXTRAS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing
            found = False
        if found:
            lines.append(("ok", f"extra {extra}: installed ({needed_by})"))
        else:
            lines.append(("missing", f"extra {extra}: not installed: pip install 'mklang[{extra}]>=2' for {needed_by}"))
    return lines
