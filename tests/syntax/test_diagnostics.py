"""Diagnostics as a user sees them: each broken file in tests/diagnostics/ through the CLI.

Paths are relative (the test runs inside the fixture directory), so the
snapshots hold exactly what a terminal shows. Each fixture states on its
first line the codes it must produce (`# expect: code, code`); the test
holds the file to exactly those, so a snapshot update cannot quietly
accept a different diagnosis.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.commands import cli

from mklang.errors import Diagnostic, MkSyntaxError
from mklang.syntax import parse
from mklang.syntax.diagnostics import render_text

FIXTURES = Path(__file__).resolve().parent / "diagnostics"
BROKEN = sorted(FIXTURES.glob("*.mk"))
EXPECT = "# expect: "


def expected_codes(path: Path) -> set[str]:
    """The codes a fixture's first line says it must produce."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(EXPECT), f"{path.name}: the first line must be `{EXPECT}<code>, ...`"
    return {code.strip() for code in first.removeprefix(EXPECT).split(",")}


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_file_diagnostics(path, snapshot, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    result = cli("check", path.name)
    assert result.stdout == ""
    has_error = ": error: " in result.stderr
    assert result.returncode == (2 if has_error else 0)
    assert f"exit {result.returncode}\n{result.stderr}" == snapshot


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_file_produces_the_codes_it_states(path, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    result = cli("check", "--format", "json", path.name)
    assert {record["code"] for record in json.loads(result.stdout)} == expected_codes(path)


def test_fixtures_cover_at_least_fifteen_distinct_codes(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    result = cli("check", "--format", "json", *[p.name for p in BROKEN])
    codes = {record["code"] for record in json.loads(result.stdout)}
    assert len(codes) >= 15
    syntax_messages = {record["message"] for record in json.loads(result.stdout) if record["code"] == "syntax"}
    assert len(syntax_messages) >= 8


def test_caret_under_the_missing_target(tmp_path):
    path = tmp_path / "m.mk"
    path.write_text("machine m\nentry a\nbudget 3\nstate a {\n  otherwise ->\n}\n")
    with pytest.raises(MkSyntaxError) as caught:
        parse(path.read_text(), str(path))
    assert render_text(caught.value.diagnostics) == (
        f'{path}:5:15: error: expected a state name or END after "->" [syntax]\n'
        " 5 |   otherwise ->\n"
        "   |               ^"
    )


def test_caret_spans_the_offending_statement(tmp_path):
    path = tmp_path / "m.mk"
    path.write_text("machine m\nentry a\nbudget 3\nstate a {\n\ttool t\n}\n")
    found = Diagnostic(str(path), 5, 2, 5, 8, "warning", "undeclared-tool", 'tool "t" is not declared')
    assert render_text([found]) == (
        f'{path}:5:2: warning: tool "t" is not declared [undeclared-tool]\n 5 |  tool t\n   |  ^^^^^^'
    )
    assert render_text([found], color=True).count("\x1b[") == 4
    assert render_text([Diagnostic(None, 1, 1, 1, 1, "error", "syntax", "x")]) == "<text>:1:1: error: x [syntax]"


def test_no_raw_parser_words_reach_users(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    result = cli("check", *[p.name for p in BROKEN])
    for raw in ("Token(", "_NL", "$END", "UnexpectedToken", "Expected one of", "Traceback", "NAME", "__ANON"):
        assert raw not in result.stderr
