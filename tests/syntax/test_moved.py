"""`moved "old" -> "new"` (ADR 0061): a state renamed since an earlier version, in `.mk` and
YAML, printed by `fmt`, held by `check` to name a state that is gone and one that is here."""

from __future__ import annotations

import pytest
from pygments.token import Error, Keyword
from support.commands import cli

from mklang.checker import check
from mklang.errors import MkSyntaxError
from mklang.highlight import MkLexer
from mklang.syntax import format_machine, parse
from mklang.syntax.yaml_front import parse_yaml

MOVED = """\
mklang 0.5
machine review
entry compose
budget 10

tool publish "Post it."
# `draft` was renamed in the second version
moved "draft" -> "compose"  # a clearer name
moved "post" -> "publish"

state compose {
  structure "An announcement."
  prompt "Write it."
  output announcement
  otherwise -> publish
}

state publish {
  tool publish { text: "{{announcement}}" }
  output published
  otherwise -> END
}
"""

YAML = """\
mklang: "0.5"
machine: review
entry: compose
budget: 10
tools:
  - name: publish
    description: Post it.
moved:
  draft: compose
  post: publish
states:
  compose:
    structure: An announcement.
    prompt: Write it.
    output: announcement
    gates:
      - to: publish
  publish:
    tool: publish
    input: {text: "{{announcement}}"}
    output: published
    gates:
      - to: END
"""


def test_moved_lines_read_into_renames_and_check_clean():
    machine = parse(MOVED, "m.mk")
    assert [(moved.old, moved.new) for moved in machine.moved] == [("draft", "compose"), ("post", "publish")]
    assert machine.renames() == {"draft": "compose", "post": "publish"}
    assert check(machine) == []


def test_fmt_prints_them_after_the_declarations_with_their_comments_and_reads_them_back():
    machine = parse(MOVED)
    text = format_machine(machine)
    assert text == MOVED
    assert parse(text) == machine
    assert parse(MOVED.replace('moved "post" -> "publish"\n', "")) != machine  # a rename is meaning


def test_yaml_reads_into_the_same_model():
    machine = parse_yaml(YAML, "m.mkl")
    assert machine == parse(MOVED)
    assert check(machine) == []


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('moved "compose" -> "publish"', ("moved-state-exists", '"compose" is moved but is still a state')),
        ('moved "old" -> "publsh"', ("unknown-target", '"publsh" is not a state of this machine; did you mean')),
        ('moved "old" -> "END"', ("unknown-target", '"END" is not a state of this machine')),
        ('moved "draft" -> "publish"', ("duplicate-moved", 'state "draft" is moved twice (first at line 8)')),
        ('moved "not a name" -> "publish"', ("invalid-name", '"not a name" is not a state name')),
    ],
)
def test_check_holds_each_rename_to_its_rules(line, expected):
    text = MOVED.replace('moved "post" -> "publish"', line)
    found = [(d.code, d.line, d.col, d.message) for d in check(parse(text, "m.mk")) if d.severity == "error"]
    assert len(found) == 1
    code, where, col, message = found[0]
    assert (code, where, col) == (expected[0], 9, 1) and message.startswith(expected[1])


def test_a_bad_rename_is_one_line_at_its_place_from_the_command_line(tmp_path):
    path = tmp_path / "m.mk"
    path.write_text(MOVED.replace('"publish"\n\nstate', '"publsh"\n\nstate', 1))
    done = cli("check", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr  # an error finding
    assert f'{path}:9:1: error: "publsh" is not a state of this machine; did you mean "publish"?' in done.stderr


def test_a_rename_needs_two_quoted_names():
    for broken in ('moved draft -> "compose"', 'moved "draft" "compose"', 'moved "draft" ->'):
        with pytest.raises(MkSyntaxError) as raised:
            parse(MOVED.replace('moved "draft" -> "compose"', broken), "m.mk")
        assert raised.value.diagnostics[0].line == 8


def test_yaml_renames_must_be_a_mapping_of_names():
    with pytest.raises(MkSyntaxError) as raised:
        parse_yaml(YAML.replace("moved:\n  draft: compose\n  post: publish\n", "moved: [draft]\n"), "m.mkl")
    assert "moved must be a mapping of old state names to new ones" in raised.value.diagnostics[0].message
    with pytest.raises(MkSyntaxError) as raised:
        parse_yaml(YAML.replace("  post: publish\n", "  post: [publish]\n"), "m.mkl")
    assert raised.value.diagnostics[0].line == 10


def test_highlighting_and_completion_know_the_keyword():
    from mklang.lsp.analysis import Document

    tokens = [(kind, value) for kind, value in MkLexer().get_tokens(MOVED) if value.strip()]
    assert (Keyword, "moved") in tokens and not any(kind is Error for kind, _ in tokens)
    assert "moved" in [completion.label for completion in Document(MOVED).completions((9, 0))]
