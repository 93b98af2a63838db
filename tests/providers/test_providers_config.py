"""Host config: where it is found, what it may say, how --provider/--model override it, `mklang config`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import mklang.cli.provider_cmds  # noqa: F401 - registers `config`
from mklang.cli.app import app
from mklang.errors import UsageError
from mklang.host.config import Price, Route, load_config

KEY = "sk-config-SECRET-987654321"

FULL = """
[tiers]
fast = "local:llama3.2"
balanced = "oa:gpt-4o"
reasoning = "an:claude-sonnet"

[providers.local]
kind = "openai"
base_url = "http://127.0.0.1:11434/v1"
max_in_flight = 2

[providers.oa]
kind = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "OA_KEY"
timeout = 30
retries = 5
params = { temperature = 0 }

[providers.an]
kind = "anthropic"
base_url = "https://api.anthropic.com"
api_key_env = "AN_KEY"

[providers.an.prices]
claude-sonnet = { input = 3, output = 15 }

[prices."oa:gpt-4o"]
input = 2.5
output = 10
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No config from the developer's machine leaks in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ("MKLANG_CONFIG", "OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def write(path, text=FULL):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_full_config_is_read(tmp_path):
    config = load_config(write(tmp_path / "a.toml"))
    assert config.tiers == {
        "fast": Route("local", "llama3.2"),
        "balanced": Route("oa", "gpt-4o"),
        "reasoning": Route("an", "claude-sonnet"),
    }
    oa = config.provider("oa")
    assert (oa.kind, oa.timeout, oa.retries, oa.params, oa.reasoning) == (
        "openai",
        30,
        5,
        {"temperature": 0},
        "scratchpad",
    )
    assert config.provider("an").reasoning == "native"
    assert config.provider("local").max_in_flight == 2
    assert config.price(Route("oa", "gpt-4o")) == Price(2.5, 10.0)
    assert config.price(Route("an", "claude-sonnet")) == Price(3.0, 15.0)
    assert config.price(Route("local", "llama3.2")) is None


def test_search_order(tmp_path, monkeypatch):
    user = write(tmp_path / "xdg" / "mklang" / "config.toml", '[tiers]\ndefault = "openai:from-user"\n')
    assert load_config().source == user
    local = write(tmp_path / "mklang.toml", '[tiers]\ndefault = "openai:from-cwd"\n')
    assert load_config().source == local
    env = write(tmp_path / "env.toml", '[tiers]\ndefault = "openai:from-env"\n')
    monkeypatch.setenv("MKLANG_CONFIG", str(env))
    assert load_config().route("fast") == Route("openai", "from-env")
    explicit = write(tmp_path / "explicit.toml", '[tiers]\ndefault = "openai:explicit"\n')
    assert load_config(explicit).route("reasoning") == Route("openai", "explicit")


def test_home_config_folder_when_xdg_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(tmp_path / "home" / ".config" / "mklang" / "config.toml", '[tiers]\nfast = "ollama:x"\n')
    assert load_config().source == path


def test_no_config_at_all():
    config = load_config()
    assert (config.source, config.tiers) == (None, {})


def test_missing_explicit_files_are_errors(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match=r"config file not found: .*nope\.toml"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv("MKLANG_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(UsageError, match=r"gone.toml \(from MKLANG_CONFIG\)"):
        load_config()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tiers\n", r"invalid TOML: .*line 1"),
        ('[tiers]\nfast = "no-colon"\n', r"\[tiers\] fast: expected 'provider:model', got 'no-colon'"),
        ('[tiers]\nturbo = "openai:x"\n', r"unknown tier 'turbo'"),
        ('[tiers]\nfast = "nowhere:x"\n', r"\[tiers\] fast: unknown provider 'nowhere'"),
        ('[providers.x]\nkind = "openai"\n', r"\[providers.x\]: missing 'base_url'"),
        ('[providers.x]\nkind = "gemini"\nbase_url = "u"\n', r"kind must be one of openai, anthropic"),
        ("[providers.openai]\ntimout = 3\n", r"unknown key 'timout'"),
        ('[providers.openai]\nbase_url = "localhost:11434"\n', r"base_url must start with http:// or https://"),
        ('[providers.openai]\nretries = "many"\n', r"retries has the wrong type \(str\)"),
        ("[providers.openai]\nmax_in_flight = 0\n", r"max_in_flight must be positive"),
        ("[providers.openai]\ntimeout = nan\n", r"timeout must be a finite number, got nan"),
        ("[providers.openai]\nbackoff = inf\n", r"backoff must be a finite number, got inf"),
        ("[providers.openai.params]\ntemperature = nan\n", r"params must hold JSON values only"),
        ("[providers.openai.params]\nstop = [1979-05-27]\n", r"params must hold JSON values only"),
        ('[prices."openai:x"]\ninput = 1\n', r"needs numbers 'input' and 'output'"),
        ('[prices."openai:x"]\ninput = -1\noutput = 1\n', r"prices must be numbers from 0 to 1,000,000"),
        ('[prices."openai:x"]\ninput = nan\noutput = 1\n', r"prices must be numbers from 0 to 1,000,000"),
        ('[prices."openai:x"]\ninput = 1\noutput = inf\n', r"prices must be numbers from 0 to 1,000,000"),
        ("[models]\n", r"unknown key 'models'"),
    ],
)
def test_bad_configs_say_what_is_wrong(tmp_path, text, message):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(UsageError, match=message) as caught:
        load_config(path)
    assert str(caught.value).startswith(str(path))


def test_builtin_provider_can_be_tuned_without_restating_it(tmp_path):
    config = load_config(write(tmp_path / "c.toml", "[providers.openai]\nretries = 9\n"), provider="openai", model="m")
    openai = config.provider("openai")
    assert (openai.retries, openai.base_url, openai.api_key_env) == (9, "https://api.openai.com/v1", "OPENAI_API_KEY")


def test_overrides(tmp_path, monkeypatch):
    path = write(tmp_path / "a.toml")
    model_only = load_config(path, model="big")
    assert [r.key for r in model_only.tiers.values()] == ["local:big", "oa:big", "an:big"]
    provider_only = load_config(path, provider="ollama")
    assert [r.key for r in provider_only.tiers.values()] == ["ollama:llama3.2", "ollama:gpt-4o", "ollama:claude-sonnet"]
    with pytest.raises(UsageError, match="--provider openai needs --model"):
        load_config(provider="openai")
    with pytest.raises(UsageError, match="--model needs --provider"):
        load_config(model="m")
    with pytest.raises(UsageError, match="unknown provider 'nope'"):
        load_config(provider="nope", model="m")


def test_no_config_env_defaults(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9000")
    openai = load_config(provider="openai", model="m")
    assert openai.provider("openai").base_url == "http://127.0.0.1:8000/v1"
    assert openai.route("balanced") == Route("openai", "m")
    assert load_config(provider="anthropic", model="m").provider("anthropic").base_url == "http://127.0.0.1:9000"


runner = CliRunner()


def test_config_command_shows_which_keys_are_set_never_their_values(tmp_path, monkeypatch):
    monkeypatch.setenv("OA_KEY", KEY)
    path = write(tmp_path / "a.toml")
    result = runner.invoke(app, ["config", "--config", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tiers"] == {"fast": "local:llama3.2", "balanced": "oa:gpt-4o", "reasoning": "an:claude-sonnet"}
    assert data["providers"]["oa"]["api_key_set"] is True
    assert data["providers"]["an"]["api_key_set"] is False
    assert data["providers"]["local"]["api_key_env"] is None
    text = runner.invoke(app, ["config", "--config", str(path), "--format", "text"])
    assert "oa: openai https://api.openai.com/v1 (key: OA_KEY set)" in text.stdout
    assert "an: anthropic https://api.anthropic.com (key: AN_KEY not set)" in text.stdout
    assert "balanced   oa:gpt-4o  ($2.5 in / $10 out per million tokens, from the config)" in text.stdout
    assert KEY not in result.stdout + text.stdout + result.stderr + text.stderr


def test_config_command_with_overrides_and_no_file():
    result = runner.invoke(app, ["config", "--provider", "ollama", "--model", "llama3.2", "--format", "text"])
    assert result.exit_code == 0
    assert result.stdout.startswith("config: none found (searched mklang.toml, ")
    assert "fast       ollama:llama3.2  (no price)" in result.stdout
    assert "ollama: openai http://localhost:11434/v1 (key: no key)" in result.stdout


def test_config_command_errors_exit_2_with_one_line(tmp_path):
    path = write(tmp_path / "bad.toml", '[tiers]\nfast = "x"\n')
    result = runner.invoke(app, ["config", "--config", str(path), "--format", "text"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == f"mklang: error: {path}: [tiers] fast: expected 'provider:model', got 'x'\n"
    as_json = runner.invoke(app, ["config", "--config", str(path), "--format", "json"])  # the one error document
    assert json.loads(as_json.stdout) == {"status": "error", "error": result.stderr[15:-1], "exit_code": 2}


def test_prices_handed_from_another_process_are_answered_as_the_catalogs(monkeypatch):
    """A child of a spread batch (ADR 0041) prices its runs with its parent's genai-prices answers,
    without loading the price table itself."""
    from mklang.host import config

    monkeypatch.setattr(config, "_CATALOG", {})
    looked_up = config.catalog_price("openai", "https://api.openai.com/v1", "gpt-4o-mini")
    assert looked_up is not None and looked_up.source.startswith("genai-prices ")
    handed = json.loads(json.dumps(config.catalog_prices()))  # as a child reads them from its stdin
    monkeypatch.setattr(config, "_CATALOG", {})
    config.known_catalog_prices(
        [*handed, {"route": ["openai", "https://api.openai.com/v1", "gpt-4o"], "price": {"input": 7, "output": 9}}]
    )
    assert config.catalog_price("openai", "https://api.openai.com/v1", "gpt-4o-mini") == looked_up
    assert config.catalog_price("openai", "https://api.openai.com/v1", "gpt-4o") == Price(7, 9)  # not the table's
