"""Static cost bounds (mklang.costs, `check --cost`) held against runs: over every example and
library machine and a generated corpus, no run with random model, hook and tool answers goes past
a computed maximum, and none that reaches END comes under a minimum."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from mklang.costs import judge_calls, machine_costs
from mklang.engine import run
from mklang.model import Call, Gate, Machine, Produce
from mklang.providers.base import NONE, UNPARSEABLE, Produced, Usage, Verdict
from mklang.syntax import parse
from mklang.syntax.machines import MachineLoader

PROMPT, ANSWER = 50, 20  # the most input and output tokens one random call reports


class RandomModel:
    """Answers every call at random (lists for `parse list`, JSON for `parse json`), counting calls."""

    def __init__(self, seed: int, parse_of: dict[str, str | None]):
        self.random = random.Random(seed)
        self.parse_of = parse_of  # a state's prompt text -> its parse, to answer in shape
        self.calls = 0
        self.lock = threading.Lock()

    def _usage(self) -> Usage:
        return Usage(self.random.randint(1, PROMPT), self.random.randint(0, ANSWER))

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        with self.lock:
            self.calls += 1
            kind = next((parse for prompt, parse in self.parse_of.items() if prompt in user), None)
            if kind == "list":
                text = json.dumps([f"item {n}" for n in range(self.random.randint(0, 4))])
            elif kind == "json":
                text = json.dumps({"verdict": self.random.choice(["supported", "unknown"]), "n": 1})
            else:
                text = self.random.choice(["yes", "no", "a draft", "1. first\n2. second"])
            return Produced(text, "thought" if reason else None, self._usage())

    def judge(self, conditions: list[str], output: Any, reasoning: Any, context: Any, tier: str) -> Verdict:
        with self.lock:
            self.calls += 1
            choice = self.random.choice([*range(len(conditions)), NONE, NONE, UNPARSEABLE])
            return Verdict(choice, self._usage())


def _machines(root: Machine, loader: MachineLoader) -> list[Machine]:
    from mklang.model import called_machines

    return list(called_machines(root, _quiet(loader)))


def _quiet(loader: MachineLoader):
    def load(name: str, near: str | None) -> Machine | None:
        try:
            return loader(name, near)
        except Exception:
            return None

    return load


def _root_steps(trace: list[dict[str, Any]]) -> int:
    return sum(max(1, len(step["branches"])) if "branches" in step else 1 for step in trace)


def _runs_within_bounds(root: Machine, loader: MachineLoader, seeds: range) -> int:
    """Run `root` once per seed with random answers; assert each run within its bounds; count done runs."""
    machines = _machines(root, loader)
    (bounds, *_) = machine_costs(root, _quiet(loader), lambda _tier, _reason: PROMPT + ANSWER)
    parse_of = {
        state.face.prompt.strip()[:40]: state.face.parse
        for machine in machines
        for state in machine.states
        if isinstance(state.face, Produce) and "{{" not in state.face.prompt.strip()[:40]
    }
    hooks = {gate.hook for machine in machines for state in machine.states for gate in state.gates if gate.hook}
    tools = {state.face.tool for machine in machines for state in machine.states if hasattr(state.face, "tool")}
    finished = 0
    for seed in seeds:
        chance = random.Random(seed)
        model = RandomModel(seed, parse_of)
        result = run(
            root,
            dict(root.context),
            provider=model,
            loader=loader,
            hooks={name: (lambda _context, _output, chance=chance: chance.random() < 0.5) for name in hooks},
            tools={name: (lambda _input, chance=chance: chance.choice(["found it", ""])) for name in tools},
        )
        steps = _root_steps(result.trace)
        where = f"{root.name} seed {seed}: {result.status} {result.error}"
        assert model.calls <= bounds.calls.most, where
        assert steps <= bounds.steps.most, where
        assert result.usage.tokens <= bounds.tokens, where
        if result.status == "done":
            finished += 1
            assert model.calls >= bounds.calls.least, where
            assert steps >= bounds.steps.least, where
    return finished


SHIPPED = sorted([*ROOT.glob("examples/*/*.mk"), *ROOT.glob("machines/*.mk")])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_no_run_of_a_shipped_machine_leaves_its_bounds(path: Path):
    loader = MachineLoader()
    root = loader.load_path(path)
    _runs_within_bounds(root, loader, range(40))


def _generated(seed: int) -> str:
    """A random machine: prose, hook, repair and fail gates, fan-outs, `max_visits`, cycles."""
    chance = random.Random(seed)
    names = [f"s{n}" for n in range(chance.randint(1, 6))]
    lines = [f"machine gen{seed}", "entry s0", f"budget {chance.randint(len(names), 3 * len(names) + 4)}"]
    lines.append('context {\n  items: ["a", "b", "c"]\n}')
    for name in names:
        body = ['  structure "x"', f'  prompt "write {name}"', f"  output {name}"]
        shape = chance.random()
        if shape < 0.15:
            body.append(f"  sample {chance.randint(2, 3)}")
        elif shape < 0.3:
            body.append("  over items")
        if chance.random() < 0.3:
            body.append(f"  max_visits {chance.randint(1, 3)}")
        for _ in range(chance.randint(1, 4)):
            target = chance.choice([*names, "END", "END"])
            kind = chance.random()
            when = f'when "{name} condition {chance.randint(0, 9)}"'
            if kind < 0.15:
                body.append(f"  {when} hook h{chance.randint(0, 1)} -> {target}")
            elif kind < 0.4:
                body.append(f"  {when} repair {chance.randint(1, 2)} -> {chance.choice(names)}")
            elif kind < 0.5:
                body.append(f"  {when} fail")
            else:
                body.append(f"  {when} -> {target}")
        if chance.random() < 0.6:
            body.append(f"  otherwise -> {chance.choice([*names, 'END'])}")
        lines.append(f"state {name} {{\n" + "\n".join(body) + "\n}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("block", range(4))
def test_no_run_of_a_generated_machine_leaves_its_bounds(block: int):
    finished = 0
    for seed in range(block * 60, (block + 1) * 60):
        machine = parse(_generated(seed), f"gen{seed}.mk")
        finished += _runs_within_bounds(machine, MachineLoader(), range(6))
    assert finished > 20  # enough runs reach END for the minima to be tested


def test_a_gate_further_down_pays_every_batch_before_it():
    prose = [Gate(when="a"), Gate(when="b"), Gate(when="c", hook="h"), Gate(when="d"), Gate()]
    assert [judge_calls(prose, index) for index in range(5)] == [(1, 1), (1, 1), (1, 1), (2, 2), (1, 2)]
    repaired = [Gate(when="a", policy="repair", repair=1, target="x"), Gate(when="b", hook="h"), Gate(when="c")]
    # Once the repair gate is spent the scan starts at the hook: `c` may be judged alone.
    assert judge_calls(repaired, 2) == (1, 2)


def test_a_repair_loop_is_bounded_by_its_budget_not_the_step_budget():
    machine = parse(
        'machine m\nentry w\nbudget 50\nstate w {\n  structure "x"\n  prompt "p"\n  output o\n'
        '  when "bad" repair 3 -> w\n  otherwise -> END\n}\n',
        "m.mk",
    )
    (cost,) = machine_costs(machine, lambda *_: None)
    assert (cost.steps.least, cost.steps.most) == (1, 4)
    assert (cost.calls.least, cost.calls.most) == (1, 8)  # four drafts, each judged
    assert cost.binds == "repair budgets and max_visits"


def test_a_cycle_only_the_budget_stops_is_named():
    machine = parse(
        'machine m\nentry a\nbudget 7\nstate a {\n  structure "x"\n  prompt "p"\n  output o\n'
        '  when "again" -> b\n  otherwise -> END\n}\nstate b {\n  structure "x"\n  prompt "q"\n  output p\n'
        "  otherwise -> a\n}\n",
        "m.mk",
    )
    (cost,) = machine_costs(machine, lambda *_: None)
    assert cost.unbounded_cycles == [["a", "b"]]
    assert cost.binds == "the step budget"
    assert cost.steps.most == 7 and cost.calls.most == 7 + 4  # a's four visits are judged, b's are not


def test_a_called_machine_counts_in_its_caller():
    loader = MachineLoader()
    root = loader.load_path(ROOT / "examples/nested/brief.mk")
    costs = {cost.machine.name: cost for cost in machine_costs(root, _quiet(loader))}
    assert set(costs) == {"brief", "section", "fact_check"}
    assert costs["brief"].calls.most >= 3 * costs["section"].calls.most
    assert isinstance(root.states[0].face, Call) or any(isinstance(s.face, Call) for s in root.states)


def test_check_cost_prices_each_call_at_its_caps(tmp_path: Path):
    from typer.testing import CliRunner

    from mklang.cli.app import app
    from mklang.cli.syntax_cmds import check_command  # noqa: F401 - registers the command

    config = tmp_path / "config.toml"
    config.write_text(
        '[providers.local]\nkind = "anthropic"\nbase_url = "http://127.0.0.1:9"\nmax_tokens = 100\n'
        '[tiers]\ndefault = "local:m"\n[prices]\n"local:m" = { input = 1.0, output = 2.0 }\n'
    )
    machine = ROOT / "machines/chain_of_thought.mk"
    runner = CliRunner()
    priced = runner.invoke(
        app, ["check", str(machine), "--cost", "--prompt-tokens", "400", "--config", str(config), "--format", "json"]
    )
    assert priced.exit_code == 0, priced.output
    (bounds,) = json.loads(priced.stdout)["files"][0]["machines"]
    calls = bounds["model_calls"]["max"]
    assert bounds["tokens"]["max"] == calls * 500
    assert bounds["cost"]["max"] == pytest.approx(calls * (400 * 1.0 + 100 * 2.0) / 1_000_000)
    unpriced = runner.invoke(app, ["check", str(machine), "--cost", "--format", "json"])
    assert json.loads(unpriced.stdout)["files"][0]["machines"][0]["tokens"]["max"] is None
    assert any("--prompt-tokens" in note for note in json.loads(unpriced.stdout)["notes"])


def test_check_refuses_cost_flags_without_cost():
    from typer.testing import CliRunner

    from mklang.cli.app import app
    from mklang.cli.syntax_cmds import check_command  # noqa: F401 - registers the command

    refused = CliRunner().invoke(app, ["check", str(ROOT / "machines/debate.mk"), "--prompt-tokens", "10"])
    assert refused.exit_code == 2
    assert "--prompt-tokens only take effect with --cost" in refused.stderr


PRICED = (
    '[providers.local]\nkind = "anthropic"\nbase_url = "http://127.0.0.1:9"\nmax_tokens = 100\n'
    '[tiers]\ndefault = "local:m"\n[prices]\n"local:m" = { input = 1.0, output = 2.0 }\n'
    "[limits]\nprompt_tokens = 400\n"
)


def test_a_batch_preflight_multiplies_one_runs_worst_case_and_says_what_the_ceiling_covers(tmp_path: Path):
    from mklang.cli.cost_report import batch_preflight

    config = tmp_path / "config.toml"
    config.write_text(PRICED)
    machine = MachineLoader().load_path(ROOT / "machines/chain_of_thought.mk")
    (bounds,) = machine_costs(machine, lambda *_: None)
    worst = bounds.calls.most * (400 * 1.0 + 100 * 2.0) / 1_000_000
    line = batch_preflight(machine, 1000, {"config": str(config)}, batch_cost=0.5)
    assert line.startswith(f"1,000 items x at most {bounds.calls.most:,.0f} model calls")
    assert f"at most ${1000 * worst:,.2f}" in line
    assert line.endswith(f"--batch-max-cost $0.50 covers {int(0.5 // worst):,} at worst")
    offline = batch_preflight(machine, 3, {"script": "s.yaml"}, batch_cost=None)
    assert offline.endswith("(answered offline, at no cost)")


def test_a_batch_prints_its_preflight_before_it_starts(tmp_path: Path):
    from support.commands import cli

    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"id": "a"}\n{"id": "b"}\n')
    script = ROOT / "machines/chain_of_thought.scenarios.yaml"
    scenario = next(iter(__import__("yaml").safe_load(script.read_text())["scenarios"]))
    done = cli(
        "batch",
        str(ROOT / "machines/chain_of_thought.mk"),
        "--inputs",
        str(inputs),
        "--store",
        f"sqlite:///{tmp_path}/runs.db",
        "--script",
        str(script),
        "--scenario",
        scenario["name"],
    )
    assert "mklang: 2 items x at most" in done.stderr.splitlines()[0], done.stderr
