"""Hostile input is refused with one line (exit 2) before any spend, or ends in a clean halt.

One test per attack; the limits are in docs/limits.md.
Commands run in this process through the CLI's entry function; the inputs that
could hang a run go to a real (forked) `mklang` process with a timeout.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from support.commands import cli, cli_env, refused
from support.fakeserver import FakeServer, answer, error, refusal
from support.forks import forked
from support.yaml_machines import AUTHORED, EVERYTHING, HOSTILE, mutate

from mklang.limits import MAX_DEPTH, json_depth, text_depth
from mklang.yaml_composer import LimitError, load_yaml

JSON_MACHINE = """\
mklang 0.4
machine deep
entry ask
budget 3

state ask {
  prompt "Give JSON about {{topic}}"
  structure "JSON"
  parse json
  output data
  otherwise -> END
}
"""


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    path = tmp_path / "deep.mk"
    path.write_text(JSON_MACHINE)
    return path


# -- HTTP deadline ----------------------------------------------------------------


def test_max_time_holds_against_a_hanging_server(machine: Path):
    """A server that never answers: the request waits only until the `--max-time` deadline, no retry
    starts, and the run halts `time-exhausted` at the state whose call was cut short.

    Before, each of the 4 attempts waited the full 120 s timeout. Process
    start-up is not bounded by the deadline, so the wall-clock check is loose.
    """
    with FakeServer() as server:
        server.fallback = answer("{}", delay=60)
        started = time.monotonic()
        done = cli(
            "run", str(machine), "--set", "topic=x", "--max-time", "2s", "--provider", "openai", "--model", "m",
            "--format", "json",
            env=cli_env(OPENAI_BASE_URL=server.openai_url, OPENAI_API_KEY="sk-test"),
        )  # fmt: skip
        elapsed = time.monotonic() - started
        attempts = server.count
    result = json.loads(done.stdout)
    assert done.returncode == 1 and (result["status"], result["error"], result["at"]) == (
        "halted",
        "time-exhausted",
        "ask",
    ), done.stdout
    assert attempts == 1 and elapsed < 30


@pytest.mark.slow
def test_max_time_against_a_hanging_server_suspends_a_checkpointed_run(machine: Path, tmp_path: Path):
    """With `--checkpoint` the cut call leaves a resumable run: resume asks the (now answering) server again."""
    checkpoint = tmp_path / "cp.json"
    with FakeServer() as server:
        server.fallback = answer("{}", delay=60)
        env = cli_env(OPENAI_BASE_URL=server.openai_url, OPENAI_API_KEY="sk-test")
        common = ("--provider", "openai", "--model", "m", "--format", "json")
        cut = cli("run", str(machine), "--set", "topic=x", "--max-time", "2s", "--checkpoint", str(checkpoint),
                     *common, env=env)  # fmt: skip
        server.fallback = answer('{"a": 1}')
        resumed = cli("resume", str(checkpoint), *common, env=env)
    assert cut.returncode == 3 and json.loads(cut.stdout)["reason"] == "time-exhausted", cut.stdout
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["result"] == {"a": 1}, resumed.stdout


def test_backoff_never_sleeps_past_the_deadline():
    """A 429 asking for a 5 s wait, one second before the deadline: the transport gives up at once."""
    from mklang.errors import ProviderError
    from mklang.host.config import builtin_providers
    from mklang.providers.base import deadline
    from mklang.providers.openai import OpenAIClient

    slept: list[float] = []
    with FakeServer() as server:
        server.add(error(429, retry_after="5"))
        config = replace(builtin_providers()["openai"], base_url=server.openai_url, api_key_env=None)
        client = OpenAIClient(config, sleep=slept.append)
        with deadline(time.monotonic() + 1), pytest.raises(ProviderError, match="no time left for a retry"):
            client.chat("m", "system", "user", reason=False)
        client.close()
        assert server.count == 1 and slept == []


# -- YAML: alias bombs, depth, size -------------------------------------------------


def alias_bomb(indent: str = "") -> str:
    """Nine levels of nine aliases each: 387 million values once expanded."""
    lines = [f"{indent}l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, 9):
        lines.append(f"{indent}l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def script(input_yaml: str = "      topic: x\n", produce: str = '{"a": 1}') -> str:
    return f"scenarios:\n  - name: s\n    input:\n{input_yaml}    llm:\n      produce: [{json.dumps(produce)}]\n"


def test_alias_bomb_in_a_scenario_input_is_refused(machine: Path, tmp_path: Path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(script(alias_bomb("      ")))
    done = forked("run", str(machine), "--script", str(bomb), env=cli_env(), timeout=20)
    refused(done, f"{bomb}:", "values once aliases are expanded")


def test_alias_bomb_in_a_yaml_machine_context_is_a_diagnostic(tmp_path: Path):
    path = tmp_path / "bomb.yaml"
    path.write_text(
        "machine: m\nentry: a\nbudget: 2\ncontext:\n"
        + alias_bomb("  ")
        + "states:\n  a:\n    tool: t\n    output: o\n    gates:\n      - {to: END}\n"
    )
    done = forked("check", str(path), env=cli_env(), timeout=20)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{path}:" in done.stderr and "once aliases are expanded" in done.stderr


def test_yaml_nested_a_hundred_thousand_deep_is_refused(machine: Path, tmp_path: Path):
    deep = tmp_path / "deep.yaml"
    deep.write_text(script(f"      topic: {'[' * 100_000}\n"))
    refused(cli("run", str(machine), "--script", str(deep)), "more than 64 levels deep")


def test_a_recursive_alias_is_refused(machine: Path, tmp_path: Path):
    loop = tmp_path / "loop.yaml"
    loop.write_text(script("      topic: &t [x, *t]\n"))
    refused(cli("run", str(machine), "--script", str(loop)), "refers to a value that contains it")


def test_aliases_are_refused_for_what_they_add_not_for_the_documents_own_values():
    own = ", ".join(["v"] * 120_000)  # more plain values than aliases may add
    anchor = "a: &a [" + ", ".join(["x"] * 999) + "]\n"  # 1,000 values with its list

    def document(aliases: int) -> str:
        return f"own: [{own}]\n{anchor}copies: [{', '.join(['*a'] * aliases)}]\n"

    assert len(load_yaml(document(100))["copies"]) == 100  # the limit exactly: 100,000 values added
    with pytest.raises(LimitError, match="grows by more than 100000 values once aliases are expanded"):
        load_yaml(document(101))


def five_thousand_states() -> str:
    """An ordinary YAML machine of 5,000 states (about 1 MB), written out in full without aliases."""
    lines = ["mklang: 0.4\nmachine: big\nentry: s0\nbudget: 10000\ncontext:\n  topic: x\nstates:"]
    for i in range(5_000):
        target = f"s{i + 1}" if i + 1 < 5_000 else "END"
        lines.append(
            f"  s{i}:\n    structure: One paragraph.\n    prompt: Write step {i} about {{{{topic}}}}.\n"
            f"    output: out{i}\n    gates:\n      - when: the text is done\n        to: {target}\n"
            f"      - when: otherwise\n        to: {target}"
        )
    return "\n".join(lines) + "\n"


def test_a_five_thousand_state_yaml_machine_checks_clean(tmp_path: Path):
    path = tmp_path / "big.yaml"
    path.write_text(five_thousand_states())
    done = cli("check", str(path))
    assert done.returncode == 0 and "0 errors, 0 warnings" in done.stdout + done.stderr, done.stderr[-500:]


def test_a_script_larger_than_the_document_limit_is_refused(machine: Path, tmp_path: Path):
    big = tmp_path / "big.yaml"
    big.write_text(script(f"      topic: {'x' * (9 * 1024 * 1024)}\n"))
    refused(cli("run", str(machine), "--script", str(big)), "larger than 8 MiB")


# -- JSON nesting depth --------------------------------------------------------------


def test_input_nested_too_deep_is_refused(machine: Path, tmp_path: Path):
    data = tmp_path / "in.json"
    data.write_text('{"topic": ' + nested(1_000) + "}")
    plain = tmp_path / "plain.yaml"
    plain.write_text(script())
    done = cli("run", str(machine), "--script", str(plain), "--input", str(data))
    refused(done, "--input", f"nested more than {MAX_DEPTH} levels deep")


def test_set_value_nested_too_deep_is_refused(machine: Path, tmp_path: Path):
    plain = tmp_path / "plain.yaml"
    plain.write_text(script())
    done = cli("run", str(machine), "--script", str(plain), "--set", f"topic={nested(MAX_DEPTH + 1)}")
    refused(done, "--set topic", "nested more than")


def test_deep_answer_under_parse_json_halts_and_the_checkpoint_still_reads(machine: Path, tmp_path: Path):
    answers = tmp_path / "answers.yaml"
    answers.write_text(script(produce=nested(300)))
    checkpoint = tmp_path / "cp.json"
    done = cli("run", str(machine), "--script", str(answers), "--checkpoint", str(checkpoint), "--format", "json")
    result = json.loads(done.stdout)
    assert done.returncode == 1, done.stderr
    assert result["error"] == f"state-error: parse-json: the answer is nested more than {MAX_DEPTH} levels deep"
    shown = cli("show", str(checkpoint), "--format", "json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "halted", shown.stderr


def test_mk_context_nested_too_deep_is_a_diagnostic(tmp_path: Path):
    """A 400-deep context value once loaded, ran, and wrote checkpoints that could not be serialized."""
    path = tmp_path / "deep.mk"
    path.write_text(JSON_MACHINE.replace("budget 3\n", f"budget 3\ncontext {{\n  topic: {nested(400)}\n}}\n"))
    done = cli("check", str(path))
    assert done.returncode == 2 and f"{path}:5:1: error: context values nest more than {MAX_DEPTH}" in done.stderr


def test_checkpoint_nested_too_deep_is_refused(tmp_path: Path):
    checkpoint = tmp_path / "cp.json"
    checkpoint.write_text('{"format": 1, "frames": ' + nested(5_000) + "}")
    refused(cli("resume", str(checkpoint)), f"{checkpoint}:", "nested more than")


# -- calc ------------------------------------------------------------------------------


def _nested(rng: random.Random, depth: int = 0):
    """A random JSON value whose strings hold brackets, quotes and backslashes."""
    roll = rng.random()
    if depth > 8 or roll < 0.3:
        return rng.choice(['a"b', "\\", "[", "}{", '\\"]', 1, None, 2.5, '\\\\"', "é[ü", ""])
    if roll < 0.65:
        return [_nested(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "[", '\\"', "}"]) + str(i): _nested(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_the_depth_of_a_json_text_is_the_depth_of_its_value():
    """Checkpoints are measured on their bytes (fast); brackets inside strings must not count."""
    rng = random.Random(7)
    for _ in range(3000):
        value = _nested(rng)
        for ascii_only in (True, False):
            text = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")
            assert text_depth(text) == json_depth(value), text


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("(((9**64)**64)**64)**64", "result larger than 100 digits"),
        ("9**64**64", "larger than 100 digits"),
        ("1" * 500, "operand larger than 100 digits"),
        ("1e308 * 10", "operand larger than 100 digits"),
        ("2.0 ** 63 * 2.0 ** 63 * 2.0 ** 63 * 2.0 ** 63 * 2.0 ** 63 * 2.0 ** 63", "result larger than 100 digits"),
        ("-" * 5_000 + "1", "longer than 1000 characters"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calc_refuses_huge_numbers_at_once(expression: str, problem: str):
    from mklang.host.registry import calc

    with pytest.raises(ValueError, match="cannot evaluate") as refused:
        calc({"expression": expression})
    assert problem in str(refused.value) and len(str(refused.value)) < 200
    assert calc({"expression": "2 ** 64 - 1"}) == "18446744073709551615"


# -- terminal output -------------------------------------------------------------------

ECHO_MACHINE = JSON_MACHINE.replace("  parse json\n", "")
HOSTILE_TEXT = "fine\x1b[2J\x1b]0;owned\x07\r\u202eevil"


def test_model_output_reaches_the_terminal_escaped_and_json_exact(tmp_path: Path):
    machine = tmp_path / "echo.mk"
    machine.write_text(ECHO_MACHINE)
    answers = tmp_path / "answers.yaml"
    answers.write_text(script(produce=HOSTILE_TEXT))
    shown = cli("run", str(machine), "--script", str(answers), "--format", "text")
    assert shown.returncode == 0, shown.stderr
    for raw in ("\x1b", "\x07", "\r", "\u202e"):
        assert raw not in shown.stdout + shown.stderr
    assert "result: fine\\x1b[2J\\x1b]0;owned\\x07 \\u202eevil" in shown.stdout  # \r is whitespace
    exact = cli("run", str(machine), "--script", str(answers), "--format", "json")
    assert json.loads(exact.stdout)["result"] == HOSTILE_TEXT


def test_an_error_line_is_escaped(tmp_path: Path):
    missing = tmp_path / "no\x1b[2Jsuch.mk"
    done = cli("resume", str(missing))
    assert "\x1b" not in done.stderr and "no\\x1b[2Jsuch.mk" in refused(done)


def test_a_machine_file_with_escape_sequences_is_shown_escaped(tmp_path: Path):
    path = tmp_path / "evil.mk"
    path.write_text(JSON_MACHINE.replace('structure "JSON"', 'structure "JSON\x1b]0;owned\x07" bogus'))
    done = cli("check", str(path))
    assert done.returncode == 2 and "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert 'structure "JSON\\x1b]0;owned\\x07" bogus' in done.stderr, done.stderr


# -- API keys and found configs ------------------------------------------------------


@pytest.mark.parametrize("key", ["sk-live-123\r", "sk-live-123\n", "sk live 123", "sk-livé-123", "sk-live-\x1b123"])
def test_a_malformed_key_is_refused_before_any_request_without_showing_it(machine: Path, key: str):
    with FakeServer() as server:
        server.fallback = answer('{"a": 1}')
        done = cli(
            "run", str(machine), "--set", "topic=x", "--provider", "openai", "--model", "m",
            env=cli_env(OPENAI_BASE_URL=server.openai_url, OPENAI_API_KEY=key),
        )  # fmt: skip
        assert server.count == 0
    line = refused(done, "OPENAI_API_KEY")
    assert "sk-liv" not in done.stdout + done.stderr and "123" not in line


@pytest.mark.parametrize("reply", [lambda text: error(400, text), refusal], ids=["error", "refusal"])
def test_a_key_echoed_by_the_server_is_redacted_in_every_encoding(machine: Path, reply):
    key = 'sk-a+b/c="d'
    echoes = [key, repr(key), json.dumps(key), quote(key), quote(key, safe=""), quote_plus(key)]
    with FakeServer() as server:
        server.add(reply("bad request from " + " and ".join(echoes)))
        done = cli(
            "run", str(machine), "--set", "topic=x", "--provider", "openai", "--model", "m", "--format", "json",
            env=cli_env(OPENAI_BASE_URL=server.openai_url, OPENAI_API_KEY=key),
        )  # fmt: skip
    assert done.returncode == 1 and "bad request from ***" in json.loads(done.stdout)["error"]
    for echo in echoes:
        assert echo not in done.stdout + done.stderr, echo


def found_config(folder: Path, provider_table: str) -> Path:
    path = folder / "mklang.toml"
    path.write_text("[providers.openai]\n" + provider_table)
    return path


def test_a_found_config_that_redirects_a_builtin_provider_is_not_used_until_allowed(
    machine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from mklang.providers.http import HttpTransport

    monkeypatch.setattr(HttpTransport, "_delay", lambda self, attempt, retry_after: 0.0)  # retry the refusals at once
    with FakeServer() as server:
        server.fallback = answer('{"a": 1}')
        config = found_config(tmp_path, f'base_url = "{server.openai_url}"\n')
        args = ("run", str(machine), "--set", "topic=x", "--provider", "openai", "--model", "m")
        env = cli_env(OPENAI_API_KEY="sk-test", OPENAI_BASE_URL="http://127.0.0.1:9/v1")
        done = cli(*args, cwd=tmp_path, env=env)
        assert server.count == 0  # the built-in endpoint was used, and could not be reached
        named = cli(*args, "--config", str(config), env=env)
    assert done.returncode == 1
    note = f"mklang: note: {config} (found in the working folder) is not used: it sends OPENAI_API_KEY to {server.openai_url}"
    assert note in done.stderr
    assert named.returncode == 0 and "note:" not in named.stderr


def test_a_found_config_that_changes_a_builtin_key_variable_is_not_used_until_allowed(machine: Path, tmp_path: Path):
    config = found_config(tmp_path, 'api_key_env = "WORK_OPENAI_KEY"\n')
    with FakeServer() as server:
        server.fallback = answer('{"a": 1}')
        env = cli_env(OPENAI_BASE_URL=server.openai_url, WORK_OPENAI_KEY="sk-work", OPENAI_API_KEY="sk-own")
        args = ("run", str(machine), "--set", "topic=x", "--provider", "openai", "--model", "m")
        done = cli(*args, cwd=tmp_path, env=env)
        assert server.requests[0].headers["authorization"] == "Bearer sk-own"
        assert cli("config", "allow", cwd=tmp_path, env=env).returncode == 0
        allowed = cli(*args, cwd=tmp_path, env=env)
        assert server.requests[-1].headers["authorization"] == "Bearer sk-work"
    assert done.returncode == 0, done.stderr
    note = f"mklang: note: {config} (found in the working folder) is not used: it sends WORK_OPENAI_KEY to"
    assert done.stderr.splitlines() == [f"{note} {server.openai_url}; `mklang config allow {config}` to use it, "
                                        "or name it with --config"]  # fmt: skip
    assert allowed.returncode == 0 and allowed.stderr == ""


@pytest.mark.parametrize(
    "variable", ["GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "MKLANG_CHECKPOINT_KEY", "ANTHROPIC_API_KEY"]
)
def test_api_key_env_must_look_like_this_providers_key(machine: Path, tmp_path: Path, variable: str):
    found_config(tmp_path, f'api_key_env = "{variable}"\n')
    with FakeServer() as server:
        done = cli(
            "run", str(machine), "--set", "topic=x", "--provider", "openai", "--model", "m", cwd=tmp_path,
            env=cli_env(OPENAI_BASE_URL=server.openai_url, **{variable: "secret-value"}),
        )  # fmt: skip
        assert server.count == 0
    refused(done, "mklang.toml", f"api_key_env {variable!r} does not look like a model key variable")


# -- fuzzed YAML machines ----------------------------------------------------------------


@pytest.mark.slow
def test_fuzzed_yaml_machines_give_diagnostics_only_and_fmt_reads_back():
    """Any mutated machine either loads (and then checks, and formats to `.mk` that parses to the same
    machine) or is refused with diagnostics: never another exception."""
    import copy

    import yaml
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mklang.checker import check
    from mklang.errors import LoadError
    from mklang.syntax import format_machine, parse
    from mklang.syntax.yaml_front import parse_yaml

    seed = yaml.safe_load(EVERYTHING)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: a fifth of an example's time in Python

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        document, actions = copy.deepcopy(seed), data.draw(st.sampled_from([HOSTILE, AUTHORED]))
        for _ in range(data.draw(st.integers(1, 4))):
            mutate(data.draw, document, actions)
        text = yaml.dump(document, Dumper=dumper, allow_unicode=True, sort_keys=False)
        try:
            machine = parse_yaml(text, "fuzz.yaml")
        except LoadError as refused:
            assert refused.diagnostics
            return
        check(machine)
        printed = format_machine(machine)
        assert parse(printed, "fuzz.mk") == machine, printed

    fuzz()


@pytest.mark.parametrize(
    "gate, message",
    [
        ("{hook: amount_ok, to: END}", 'a gate with a "hook" needs a "when"'),
        ("{when: 2001-12-14, to: END}", "when must be text"),
        ("{when: ok, then: 2001-12-14T10:00:00Z, to: END}", 'a gate\'s "then" must be ok'),
        ("{when: ok, repair: 2001-12-14, to: END}", "repair must be a whole number"),
        ("{when: ok, to: !!timestamp 2001-12-14}", "a state name must be a name"),
    ],
)
def test_yaml_gates_found_by_fuzzing_are_diagnostics(tmp_path: Path, gate: str, message: str):
    path = tmp_path / "gate.yaml"
    path.write_text(
        "machine: m\nentry: a\nbudget: 2\nhooks:\n  - {name: amount_ok}\nstates:\n  a:\n    tool: t\n"
        f"    output: o\n    gates:\n      - {gate}\n      - {{when: otherwise, to: END}}\n"
    )
    done = cli("check", str(path))
    assert done.returncode == 2 and f"{path}:11:" in done.stderr and f"error: {message}" in done.stderr, done.stderr
