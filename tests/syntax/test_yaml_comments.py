"""`fmt` of a YAML machine keeps its comments, and never takes a `#` of a value for one."""

from __future__ import annotations

from mklang.syntax import format_machine
from mklang.syntax.yaml_front import parse_yaml, yaml_comments

MACHINE = """# header: reads `topic`, writes `note` (the result)
mklang: "0.2"
machine: notes  # the name
entry: write
budget: 3
result: note

context:
  topic: "issue #12"  # a quoted '#' is text
  tag: a#b

states:
  # the only state
  write:
    structure: >
      One line. Not a # comment.
    prompt: |
      Write about {{topic}}.
      # this line is part of the prompt
    output: note
"""


def test_the_comments_of_a_yaml_machine_are_found_and_nothing_else():
    assert [comment.text for comment in yaml_comments(MACHINE)] == [
        "# header: reads `topic`, writes `note` (the result)",
        "# the name",
        "# a quoted '#' is text",
        "# the only state",
    ]


def test_fmt_of_a_yaml_machine_prints_its_comments_where_they_were():
    printed = format_machine(parse_yaml(MACHINE, "notes.mkl"))
    lines = printed.splitlines()
    assert lines[0] == "# header: reads `topic`, writes `note` (the result)"
    assert "machine notes  # the name" in lines
    assert lines[lines.index("# the only state") + 1] == "state write {"
    assert "    # this line is part of the prompt" in lines  # a line of the prompt, not a comment
    assert 'topic: "issue #12"' in printed and "a#b" in printed


def test_a_comment_inside_the_context_moves_above_it_and_one_after_it_stays_with_what_follows():
    """As in a `.mk` file: a comment inside a multi-line statement goes above that statement, and a
    comment after the context's last line, past a blank line, belongs to what comes next."""
    lines = format_machine(parse_yaml(MACHINE, "notes.mkl")).splitlines()
    assert lines[lines.index("# a quoted '#' is text") + 1] == "context {"
    for last in ("  tag: a#b\n", "  tag: |\n    a#b\n"):  # a block scalar ends at the next line's start
        below = MACHINE.replace("  tag: a#b\n", f"{last}# about the states\n")
        lines = format_machine(parse_yaml(below, "notes.mkl")).splitlines()
        assert lines[lines.index("# about the states") + 1 : lines.index("# about the states") + 3] == [
            "# the only state",
            "state write {",
        ], lines
