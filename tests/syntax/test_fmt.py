"""`fmt`: the canonical text reads back to the same model, is idempotent and keeps comments."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ROOT
from typer.testing import CliRunner

from mklang.cli.app import app
from mklang.cli.syntax_cmds import fmt_command  # noqa: F401 - registers the command
from mklang.model import Call, Choice, Declaration, Gate, Machine, Produce, State, Timeout, ToolDeclaration, ToolUse
from mklang.syntax import format_machine, load_file, parse
from mklang.vocabulary import TIERS

MACHINE_FILES = sorted(ROOT.glob("examples/**/*.mk")) + sorted(ROOT.glob("machines/*.mk"))
KEYWORDS = {"true", "false", "null", "END"}

# [a-z_][a-z0-9_]{0,8}, drawn as its two parts: a regex strategy takes three times as long per name.
LOWER = "abcdefghijklmnopqrstuvwxyz"
names = (
    st.tuples(st.sampled_from(LOWER + "_"), st.text(LOWER + "0123456789_", max_size=8))
    .map("".join)
    .filter(lambda n: n not in KEYWORDS)
)
paths = st.lists(names, min_size=1, max_size=3).map(".".join)
prose = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
blocks = st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20), min_size=2, max_size=4).map(
    "\n".join
)
texts = st.one_of(prose, blocks)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=False, allow_infinity=False), prose
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.one_of(names, prose), inner, max_size=3)),
    max_leaves=8,
)
maps = st.dictionaries(st.one_of(names, prose), values, max_size=4)


# Strategies are built once, here: a composite that builds them at each draw spends its time
# analysing new strategy objects rather than drawing examples.
maybe_prose = st.one_of(st.none(), prose)
maybe_names = st.one_of(st.none(), names)
maybe_paths = st.one_of(st.none(), paths)
maybe_maps = st.one_of(st.none(), maps)
digits = st.integers(0, 9)
maybe_digits = st.one_of(st.none(), digits)
faces = st.one_of(
    st.builds(
        Produce,
        prompt=texts,
        structure=texts,
        execution=st.one_of(st.none(), texts),
        reason=st.booleans(),
        parse=st.sampled_from([None, "list", "json"]),
    ),
    st.builds(Call, machine=names, input=maybe_maps),
    st.builds(ToolUse, tool=names, input=maybe_maps),
)
policies = st.sampled_from(["ok", "repair", "escalate", "decide", "fail"])
durations = st.tuples(st.integers(0, 999), st.sampled_from("smhd")).map(lambda d: f"{d[0]}{d[1]}")
tiers = st.sampled_from([None, *TIERS])
tool_lists = st.lists(st.builds(ToolDeclaration, name=names, description=prose, read_only=st.booleans()), max_size=2)
hook_lists = st.lists(st.builds(Declaration, name=names, description=prose), max_size=2)


@st.composite
def gates(draw, targets):
    when = draw(maybe_prose)
    policy = draw(policies)
    if policy == "decide":  # a human decision: choices and a deadline, each `-> target` or `fail`
        to = st.one_of(st.none(), targets)
        return Gate(
            when=when,
            hook=draw(maybe_names) if when is not None else None,
            policy="escalate",
            ask=draw(maybe_prose),
            show=draw(maybe_paths),
            reply_to=draw(maybe_paths),
            choices=draw(st.lists(st.builds(Choice, label=prose, target=to), max_size=3)),
            timeout=draw(st.one_of(st.none(), st.builds(Timeout, within=durations, target=to))),
        )
    return Gate(
        when=when,
        hook=draw(maybe_names) if when is not None else None,
        policy=policy,
        target=None if policy == "fail" else draw(targets),
        repair=draw(digits) if policy == "repair" else None,
        ask=draw(maybe_prose) if policy == "escalate" else None,
        reply_to=draw(maybe_paths) if policy == "escalate" else None,
        show=draw(maybe_paths) if policy == "escalate" else None,
    )


@st.composite
def states(draw, name, gate_lists):
    return State(
        name=name,
        face=draw(faces),
        tier=draw(tiers),
        output=draw(names),
        accumulate=draw(st.booleans()),
        sample=draw(maybe_digits),
        over=draw(maybe_paths),
        max_visits=draw(maybe_digits),
        gates=draw(gate_lists),
    )


@st.composite
def machines(draw):
    state_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    gate_lists = st.lists(gates(st.sampled_from([*state_names, "END"])), max_size=4)
    return Machine(
        name=draw(names),
        version=draw(st.sampled_from([None, "0.4", "0.5"])),
        entry=draw(st.sampled_from(state_names)),
        budget=draw(st.integers(0, 10**6)),
        tier=draw(st.sampled_from(TIERS)),
        result=draw(maybe_paths),
        context=draw(maps),
        tools=draw(tool_lists),
        hooks=draw(hook_lists),
        states=[draw(states(name, gate_lists)) for name in state_names],
    )


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines())
def test_parse_of_fmt_is_the_same_machine(machine):
    text = format_machine(machine)
    again = parse(text)
    assert again == machine
    assert format_machine(again) == text


COMMENTED = """\
# a machine with comments everywhere
machine m  # its name
entry a
budget 5

# the context
context {
  x: 1  # moves above the context
}

state a {  # the only state
  # how it thinks
  structure "s"
  prompt "p"
  output o
  # the gates
  otherwise -> END  # always
  # nothing after
}
# the end
"""


def test_comments_are_kept_and_fmt_is_idempotent():
    text = format_machine(parse(COMMENTED))
    for comment in [line.split("#", 1)[1] for line in COMMENTED.splitlines() if "#" in line]:
        assert comment in text
    assert "machine m  # its name" in text and "state a {  # the only state" in text
    assert "  otherwise -> END  # always\n  # nothing after\n}" in text
    assert format_machine(parse(text)) == text


def test_canonical_order_and_layout():
    source = (
        'state a {\n  output o\n  when "w" -> END\n  prompt "p"\n  tier fast\n  structure "s"\n  otherwise fail\n}\n'
        "budget 3\nentry a\nmachine m\n"
    )
    assert format_machine(parse(source)) == (
        'machine m\nentry a\nbudget 3\n\nstate a {\n  tier fast\n  structure "s"\n  prompt "p"\n  output o\n'
        '  when "w" -> END\n  otherwise fail\n}\n'
    )


@pytest.mark.parametrize("path", MACHINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_and_library_are_canonical(path):
    text = path.read_text(encoding="utf-8")
    assert format_machine(parse(text)) == text
    assert parse(format_machine(parse(text))) == parse(text)


def _machine_file(tmp_path, text, name="m.mk"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cli_fmt_prints_checks_and_writes(tmp_path):
    messy = _machine_file(
        tmp_path, "entry a\nmachine m\nbudget 2\nstate a {\n  output o\n  tool t\n  otherwise -> END\n}\n"
    )
    canonical = format_machine(load_file(messy))
    runner = CliRunner()
    shown = runner.invoke(app, ["fmt", str(messy)])
    assert (shown.exit_code, shown.stdout) == (0, canonical)
    checked = runner.invoke(app, ["fmt", "--check", str(tmp_path)])
    assert (checked.exit_code, checked.stdout) == (1, f"{messy}\n")
    written = runner.invoke(app, ["fmt", "--write", str(messy)])
    assert written.exit_code == 0 and messy.read_text() == canonical
    assert runner.invoke(app, ["fmt", "--check", str(messy)]).exit_code == 0


def test_cli_fmt_converts_yaml_and_reports_broken_files(tmp_path):
    yaml_file = _machine_file(
        tmp_path,
        "machine: m\nentry: a\nbudget: 2\nstates:\n  a:\n    tool: t\n    output: o\n    gates:\n      - {to: END}\n",
        "m.mkl",
    )
    runner = CliRunner()
    converted = runner.invoke(app, ["fmt", str(yaml_file)])
    assert converted.exit_code == 0 and parse(converted.stdout) == load_file(yaml_file)
    assert runner.invoke(app, ["fmt", "--check", str(yaml_file)]).exit_code == 1
    broken = _machine_file(tmp_path, "machine m\nentry\n", "broken.mk")
    result = runner.invoke(app, ["fmt", str(broken)])
    assert result.exit_code == 2 and "broken.mk:2:6" in result.stderr and result.stdout == ""


def _string_free_lines(text: str) -> list[int]:
    """Indexes of lines outside `\"\"\"` blocks, where a comment can go."""
    free, inside = [], False
    for number, line in enumerate(text.split("\n")):
        opens = line.count('"""') % 2 == 1
        if not inside and not opens:
            free.append(number)
        inside ^= opens
    return free


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(MACHINE_FILES or [None]),
    st.lists(st.tuples(st.integers(0, 10**6), st.booleans()), min_size=1, max_size=6),
)
def test_comments_anywhere_survive_fmt(path, places):
    if path is None:
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    free = _string_free_lines("\n".join(lines))
    for number, (where, own_line) in enumerate(places):
        index = free[where % len(free)]
        if own_line:
            lines[index] = f"# note {number}\n{lines[index]}"
        elif lines[index].strip() and "#" not in lines[index]:
            lines[index] += f"  # note {number}"
    text = "\n".join(lines)
    machine = parse(text)
    formatted = format_machine(machine)
    assert [n for n in range(len(places)) if f"# note {n}" in text] == [
        n for n in range(len(places)) if f"# note {n}" in formatted
    ]
    assert parse(formatted) == machine and format_machine(parse(formatted)) == formatted


# --- fmt: the line-width boundary of input maps -------------------------------


@pytest.mark.parametrize(("extra", "inline"), [(0, True), (1, False)])
def test_fmt_keeps_an_input_map_inline_up_to_88_columns(extra, inline):
    def machine(width: int) -> str:
        return f'machine m\nentry a\nbudget 1\ntool t "x"\nstate a {{\n  tool t {{ q: "{"x" * width}" }}\n  output o\n  otherwise -> END\n}}\n'

    # Find the value width whose inline line is exactly 88 columns.
    line = next(line for line in format_machine(parse(machine(1), "m.mk")).splitlines() if "tool t {" in line)
    width = 1 + 88 - len(line) + extra
    text = format_machine(parse(machine(width), "m.mk"))
    lines = [line for line in text.splitlines() if line.startswith("  tool t")]
    assert len(lines) == 1
    assert (len(lines[0]) == 88 + extra) if inline else lines[0] == "  tool t {"
    assert parse(text, "m.mk") == parse(machine(width), "m.mk")
