"""One vocabulary: the checker, the engine, the editors and the grammar agree on the language's words."""

from __future__ import annotations

import json
import re

from conformance.harness import Recorder, run_mk
from pygments.token import Keyword, String
from support import ROOT

from mklang import vocabulary
from mklang.checker import check
from mklang.highlight import MkLexer
from mklang.lsp.analysis import Document
from mklang.syntax import parse

HYPHENATED = """machine m
entry a
budget 5
context { "ticket-id": "T-42" }
state a {
  prompt "Look up {{ ticket-id }}."
  structure "The ticket."
  output answer
  otherwise -> END
}
"""


def test_a_hyphenated_context_key_is_read_by_the_engine_and_known_to_the_checker():
    machine = parse(HYPHENATED)
    assert [d.code for d in check(machine)] == []
    provider = Recorder({"produce": ["ok"]})
    result = run_mk(machine, provider=provider)
    assert result.status == "done"
    assert "Look up T-42." in provider.produced[0].user


def test_the_checker_still_warns_about_a_hyphenated_key_nothing_writes():
    machine = parse(HYPHENATED.replace("{{ ticket-id }}", "{{ order-id }}"))
    found = [(d.code, d.message) for d in check(machine)]
    assert found == [("unwritten-context-key", 'state "a" reads "order-id", which nothing writes')]


def grammar_keywords() -> set[str]:
    """The words the grammar's keyword terminals spell (`PROMPT: "prompt"`), END aside."""
    text = (ROOT / "grammar" / "mklang.lark").read_text(encoding="utf-8")
    return set(re.findall(r'^[A-Z_]+: "([a-z_]+)"$', text, re.M))


def test_the_keyword_list_is_the_grammars():
    assert set(vocabulary.KEYWORDS) == grammar_keywords() - set(vocabulary.LITERALS)


def test_every_keyword_the_language_server_offers_opens_a_line_the_grammar_accepts():
    inside_state = Document(HYPHENATED).completions((6, 0))  # the blank start of the `structure` line
    offered = {completion.label for completion in inside_state}
    assert "input" not in offered and offered == set(vocabulary.STATE_KEYWORDS)
    top = {completion.label for completion in Document(HYPHENATED).completions((3, 0))}
    assert top == set(vocabulary.HEADER_KEYWORDS)


def test_the_language_server_completes_a_hyphenated_placeholder():
    text = HYPHENATED.replace("{{ ticket-id }}.", "{{ ticket-")
    labels = {completion.label for completion in Document(text).completions((5, len('  prompt "Look up {{ ticket-')))}
    assert "ticket-id" in labels


def test_the_highlighter_and_the_textmate_grammar_use_the_vocabulary():
    tokens = list(MkLexer().get_tokens('state a {\n  input x\n  prompt "{{ ticket-id }}"\n}\n'))
    assert (Keyword, "input") not in tokens
    assert (String.Interpol, "{{ ticket-id }}") in tokens
    repository = json.loads((ROOT / "grammar" / "mklang.tmLanguage.json").read_text(encoding="utf-8"))["repository"]
    keywords = set(re.fullmatch(r"\\b\((.*)\)\\b", repository["keyword"]["match"]).group(1).split("|"))
    assert keywords == set(vocabulary.KEYWORDS) - set(vocabulary.POLICY_KEYWORDS)
    placeholder = re.compile(repository["placeholder"]["match"])
    assert placeholder.search("{{ ticket-id }}").group(2) == "ticket-id"
    assert placeholder.search("{{ ticket id }}") is None  # not a placeholder: the engine leaves it as text


def test_the_placeholder_pattern_is_written_once():
    """No module but the vocabulary spells a `{{` pattern."""
    spelled = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "mklang").rglob("*.py")
        if path.name != "_parser.py" and re.search(r"r[\"'][^\"'\n]*\\\{\\\{", path.read_text(encoding="utf-8"))
    ]
    assert spelled == ["mklang/vocabulary.py"]
