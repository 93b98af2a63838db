"""One way to build a run: `mklang.session` under the CLI, the Python API and the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.examples import HITL
from support.plugins import install_entry_points
from support.runs import CALLS_CHILD, HOOKED_CHILD

import mklang
from mklang.checkpoint.envelope import load
from mklang.errors import LoadError, UsageError
from mklang.runs import RunRequest, build_host, start
from mklang.scenarios import Scenario, load_script
from mklang.session import Host, preflight

PACKAGE = Path(mklang.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_host_package_stays_below_the_engine_and_the_checkpoint():
    upward = ("mklang.engine", "mklang.checkpoint", "mklang.session", "mklang.cli")
    for path in sorted((PACKAGE / "host").glob("*.py")):
        bad = sorted(name for name in _imports(path) if name.startswith(upward))
        assert not bad, f"{path.name} imports {bad}"


def test_the_python_api_runs_durably_with_a_checkpoint(tmp_path):
    machine = mklang.load(HITL / "approval" / "approval.mk")
    checkpoint = tmp_path / "cp.json"
    first = mklang.run(
        machine,
        script=HITL / "approval" / "scenarios.yaml",
        scenario="ask-then-publish",
        checkpoint=checkpoint,
        hitl=True,
    )
    assert (first.status, first.reply_to) == ("suspended", "approval.answer")
    assert load(checkpoint).status == "suspended"


def test_a_scenario_host_supplies_input_and_run_settings_under_the_callers(tmp_path):
    machine = mklang.load(HITL / "approval" / "approval.mk")
    scenario = next(s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    assert scenario.run.get("hitl") is True
    parked = start(machine, None, Host.for_scenario(scenario), checkpoint=tmp_path / "cp.json")
    assert parked.status == "suspended"  # hitl from the scenario's run settings
    direct = start(machine, None, Host.for_scenario(scenario), hitl=False)
    assert direct.status != "suspended"  # the caller's setting wins


SCRIPT = HITL / "approval" / "scenarios.yaml"


def built(max_cost: float | None = None, priced_for: str = "max_cost", **hosting) -> Host:
    """The host `mklang run` builds from these host options (`runs.build_host`)."""
    return build_host(RunRequest(hosting=hosting, max_cost=max_cost, priced_for=priced_for))


@pytest.mark.parametrize("given", ["provider", "model", "replay", "record", "config"])
def test_a_script_answers_offline_and_refuses_what_builds_a_provider(given):
    with pytest.raises(UsageError) as refused:
        built(script=SCRIPT, **{given: "x"})
    assert str(refused.value) == (
        "--script answers offline: it cannot be combined with --provider, --model, --config, --replay or --record"
    )


@pytest.mark.parametrize(("priced_for", "option"), [("max_cost", "--max-cost"), ("batch_max_cost", "--batch-max-cost")])
def test_a_dollar_limit_is_refused_for_a_scripted_model_naming_the_option_given(priced_for, option):
    with pytest.raises(UsageError) as refused:
        built(script=SCRIPT, max_cost=1.0, priced_for=priced_for)
    assert str(refused.value) == f"{option} needs model prices, and a scripted model has none: use --max-tokens"


def test_the_python_api_is_told_of_its_keywords_not_of_command_line_flags(tmp_path):
    """A host refused for a call of `mklang.run`, `resume` or `batch` names what the call passed."""
    machine = HITL / "approval" / "approval.mk"
    with pytest.raises(UsageError) as priced:
        mklang.run(machine, script=SCRIPT, scenario="ask-then-publish", max_cost=1.0)
    assert str(priced.value) == "max_cost= needs model prices, and a scripted model has none: use max_tokens="
    with pytest.raises(UsageError) as offline:
        mklang.run(machine, script=SCRIPT, model="m")
    assert str(offline.value) == (
        "script= answers offline: it cannot be combined with provider=, model=, config=, replay= or record="
    )
    with pytest.raises(UsageError) as batched:
        mklang.batch(machine, [{}], store=tmp_path / "runs", provider="ollama", model="m", batch_max_cost=1.0)
    assert str(batched.value).startswith("batch_max_cost= needs a price for ollama:m (tier ")
    parked = mklang.run(machine, script=SCRIPT, scenario="ask-then-publish", checkpoint=tmp_path / "cp.json")
    assert parked.status == "suspended"
    with pytest.raises(UsageError) as resumed:
        mklang.resume(tmp_path / "cp.json", reply={"approval.answer": "yes"}, max_cost=1.0)
    assert str(resumed.value) == "max_cost= needs model prices, and a scripted model has none: use max_tokens="
    with pytest.raises(UsageError) as unscripted:
        mklang.run(machine, scenario="ask-then-publish", provider="ollama")
    assert str(unscripted.value) == "scenario= needs script="
    with pytest.raises(UsageError) as unpicked:
        mklang.run(machine, script=SCRIPT)
    assert str(unpicked.value).startswith(f"{SCRIPT} holds 4 scenarios: pick one with scenario= (")


def test_a_host_built_from_the_config_routes_its_tiers_and_takes_its_read_only_tools(tmp_path, monkeypatch):
    """What `mklang run --config` hosts a run with; --provider and --model replace what the config routes;
    --record records what it answers; a cassette replays with no config read (a broken one in the
    working folder is not in the way)."""
    config = tmp_path / "mklang.toml"
    config.write_text(
        '[providers.local]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n[tiers]\ndefault = "local:m"\n'
        '[tools]\nread_only = ["issue_refund"]\n'
    )
    with built(config=config) as routed:
        assert (routed.provider.route_of("fast"), routed.read_only_tools) == (("local", "m"), {"issue_refund"})
    with built(config=config, provider="ollama", model="llama3") as chosen:
        assert chosen.provider.route_of("fast") == ("ollama", "llama3")
    with built(config=config, record=tmp_path / "calls.yaml"):
        assert (tmp_path / "calls.yaml").is_file()  # a recording's cassette is written from the start
    config.write_text("[tiers\n")
    monkeypatch.chdir(tmp_path)
    with built(replay="calls.yaml") as replaying:
        assert replaying.read_only_tools == frozenset() and replaying.recorded().replay == str(tmp_path / "calls.yaml")


def test_a_scenario_needs_a_script():
    with pytest.raises(UsageError) as refused:
        built(scenario="ask-then-publish", provider="scripted")
    assert str(refused.value) == "--scenario needs --script"


def test_a_scripted_host_records_the_script_and_scenario_it_answers_from(tmp_path, monkeypatch):
    (tmp_path / "plugin.py").write_text("TOOLS = {'publish': lambda text: 'mine'}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    host = built(script=SCRIPT, scenario="ask-then-publish", plugins=["plugin.py"])
    assert host.recorded().model_dump() == {
        **host.recorded().model_dump(),
        "script": str(SCRIPT.resolve()),
        "scenario": "ask-then-publish",
        "provider": None,
        "config": None,
        "replay": None,
        "record": None,
        "plugins": [str(tmp_path.resolve() / "plugin.py")],
    }
    assert host.scenario is not None and host.scenario.name == "ask-then-publish"
    assert host.tools["publish"]("text") == "https://status.example.com/posts/118"  # the script's, not the plugin's
    alone = Host.for_scenario(load_script(SCRIPT)[1])
    assert alone.settings == {"scenario": load_script(SCRIPT)[1].name, "script": str(SCRIPT.resolve())}
    assert Host.for_scenario(Scenario("inline")).settings == {"scenario": "inline", "script": None}  # no file


def test_a_script_of_one_scenario_answers_from_it_and_records_its_name_else_one_must_be_picked(tmp_path):
    """The recorded name is what `mklang resume` answers from; a script's errors name the script."""
    (tmp_path / "one.yaml").write_text("scenarios:\n  - name: only\n", encoding="utf-8")
    host = built(script=tmp_path / "one.yaml")
    assert (host.scenario.name, host.recorded().scenario) == ("only", "only")
    with pytest.raises(UsageError) as unpicked:
        built(script=SCRIPT)
    assert str(unpicked.value).startswith(f"{SCRIPT} holds 4 scenarios: pick one with --scenario (")


def test_a_run_setting_is_the_callers_else_the_scenarios_else_the_default():
    scenario = next(s for s in load_script(SCRIPT) if s.name == "ask-then-publish")
    host = Host.for_scenario(scenario)
    assert host.run_setting("hitl", False) is False
    assert host.run_setting("hitl", None) is True
    assert host.run_setting("concurrency", None, 4) == 4
    assert Host(provider=None).run_setting("hitl", None, "default") == "default"


class Closing:
    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_leaving_a_host_closes_its_provider_if_it_can_be_closed():
    provider = Closing()
    with Host(provider=provider) as host:
        assert host.provider is provider and provider.closed == 0
    assert provider.closed == 1
    with Host(provider=object()):
        pass  # nothing to close


PUBLISHES = """\
mklang 0.4
machine post
entry send
budget 5

tool publish "Post the text. Input: {text}."

state send {
  tool publish { text: "{{line}}" }
  output url
  otherwise -> END
}
"""


def test_preflight_refuses_a_tool_or_hook_without_implementation_before_anything_is_paid(tmp_path):
    from mklang.syntax import load_file

    (tmp_path / "post.mk").write_text(PUBLISHES, encoding="utf-8")
    machine = load_file(tmp_path / "post.mk")
    provider = object()
    with pytest.raises(UsageError) as refused:
        preflight(machine, Host(provider=provider))
    assert str(refused.value) == (
        'tool "publish" has no implementation: provide it with --plugin MODULE|FILE.py (a TOOLS map), '
        'a "mklang.tools" entry point, or tools= in the Python API'
    )
    preflight(machine, Host(provider=provider, tools={"publish": lambda text: "url"}))


UNDECLARED = """\
mklang 0.4
machine post
entry send
budget 5

tool archive "Keep the text."
hook audit "Check a post."

state send {
  tool publish { text: "{{line}}" }
  output url
  when "posted" hook plausible -> add
  otherwise -> add
}

state add {
  tool calc { expression: "1 + 1" }
  output total
  otherwise -> END
}
"""


def test_preflight_asks_for_every_tool_and_hook_declared_or_used_but_the_built_in_ones(tmp_path):
    """Every tool and hook a machine declares or uses (using one undeclared is only warned of) needs
    an implementation before anything is paid; `calc` is built in."""
    from mklang.syntax import load_file

    (tmp_path / "post.mk").write_text(UNDECLARED, encoding="utf-8")
    machine, tools, hooks = load_file(tmp_path / "post.mk"), {}, {}
    for kind, name, given in [("tool", "archive", tools), ("tool", "publish", tools), ("hook", "audit", hooks),
                              ("hook", "plausible", hooks)]:  # fmt: skip
        with pytest.raises(UsageError) as refused:
            preflight(machine, Host(provider=object(), tools=tools, hooks=hooks))
        assert str(refused.value).startswith(f'{kind} "{name}" has no implementation')
        given[name] = print
    preflight(machine, Host(provider=object(), tools=tools, hooks=hooks))


def test_preflight_takes_the_tools_and_hooks_installed_plugins_provide(tmp_path, monkeypatch):
    from mklang.syntax import load_file

    source = "def publish(arguments):\n    return 'url'\n\ndef plausible(output, context):\n    return True\n"
    install_entry_points(tmp_path, "post_plugin", source, {"mklang.tools": "publish", "mklang.hooks": "plausible"})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "post.mk").write_text(UNDECLARED, encoding="utf-8")
    preflight(
        load_file(tmp_path / "post.mk"), Host(provider=object(), tools={"archive": print}, hooks={"audit": print})
    )


def test_preflight_checks_the_machines_a_run_calls_and_their_hooks(tmp_path):
    from mklang.syntax import load_file

    (tmp_path / "parent.mk").write_text(CALLS_CHILD, encoding="utf-8")
    (tmp_path / "child.mk").write_text(HOOKED_CHILD, encoding="utf-8")
    parent = load_file(tmp_path / "parent.mk")
    with pytest.raises(UsageError) as refused:
        preflight(parent, Host(provider=object()))
    assert str(refused.value) == (
        'hook "plausible" has no implementation: provide it with --plugin MODULE|FILE.py (a HOOKS map), '
        'a "mklang.hooks" entry point, or hooks= in the Python API'
    )
    preflight(parent, Host(provider=object(), hooks={"plausible": lambda output, context: True}))
    (tmp_path / "child.mk").write_text("mklang 9.1\n" + HOOKED_CHILD, encoding="utf-8")
    with pytest.raises(LoadError, match=r"child\.mk:1:1: .* not the newer 9\.1"):
        preflight(load_file(tmp_path / "parent.mk"), Host(provider=object(), hooks={"plausible": print}))


def test_a_resume_answers_as_a_trusted_checkpoint_recorded_and_ignores_what_an_untrusted_one_recorded(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "the key that signed the run, long enough")
    checkpoint = tmp_path / "cp.json"
    parked = mklang.run(HITL / "approval" / "approval.mk", script=SCRIPT, scenario="ask-then-publish",
                        checkpoint=checkpoint, hitl=True)  # fmt: skip
    assert parked.status == "suspended"
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another key, as long as the first one")
    with pytest.raises(UsageError):  # nothing given answers, and the file's script is not taken
        mklang.resume(checkpoint, reply={"approval.answer": "yes"}, trust=True)
    assert capsys.readouterr().err == (
        "mklang: the checkpoint is not signed with your key: ignored its recorded script, scenario\n"
    )
    done = mklang.resume(
        checkpoint, reply={"approval.answer": "yes"}, trust=True, script=SCRIPT, scenario="ask-then-publish"
    )
    assert (done.status, capsys.readouterr().err) == ("done", "")


class Priced:
    """A provider object that charges a quarter dollar a call."""

    def produce(self, system: str, user: str, tier: str, reason: bool) -> mklang.Produced:
        return mklang.Produced("word", None, mklang.Usage(10, 5, cost_usd=0.25))


def test_a_resume_keeps_the_runs_dollar_limit_and_refuses_a_host_that_cannot_price_it(tmp_path):
    """A scripted model has no prices: resuming on one a run started with a dollar limit is refused,
    as starting it would be (the run's limit holds when the resume gives none)."""
    from support.batches import MACHINE

    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    checkpoint = tmp_path / "cp.json"
    started = mklang.run(tmp_path / "twostep.mk", {"topic": "t"}, provider=Priced(), checkpoint=checkpoint,
                         max_cost=1.0, max_tokens=15)  # fmt: skip
    assert started.status == "suspended"
    with pytest.raises(UsageError) as refused:
        mklang.resume(checkpoint, max_tokens=30, script=SCRIPT, scenario="ask-then-publish")
    assert str(refused.value) == "max_cost= needs model prices, and a scripted model has none: use max_tokens="


def test_a_python_caller_is_told_which_keyword_lets_a_checkpoint_through(tmp_path, monkeypatch):
    """`trust=True` and `force=True`: what `mklang resume` says as --trust and --force."""
    import shutil

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    machine, script = tmp_path / "approval" / "approval.mk", tmp_path / "approval" / "scenarios.yaml"
    checkpoint = tmp_path / "cp.json"
    parked = mklang.run(machine, script=script, scenario="ask-then-publish", checkpoint=checkpoint)
    assert parked.status == "suspended"
    with monkeypatch.context() as other:
        other.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
        with pytest.raises(mklang.CheckpointError) as unsigned:
            mklang.resume(checkpoint, reply={"approval.answer": "yes"})
    assert str(unsigned.value).endswith(
        "resume it with trust=True to run it as untrusted data (host settings from your call only)"
    )
    machine.write_text(machine.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    with pytest.raises(mklang.CheckpointError) as changed:
        mklang.resume(checkpoint, reply={"approval.answer": "yes"})
    assert str(changed.value) == (
        f"{machine}: machine file changed since the checkpoint was written (to move the parked run to it once it is checked compatible: "
        "mklang.runs.migrate(run, FILE), then resume; to accept the change unchecked: resume with force=True)"
    )
