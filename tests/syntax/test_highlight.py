"""Highlighting: the Pygments lexer and the TextMate grammar agree with SPEC section 2."""

from __future__ import annotations

import json
import re

import pytest
from pygments.token import Comment, Error, Keyword, Name, Number, Operator, String
from support import ROOT

from mklang.highlight import MkLexer, highlight_source

EXAMPLES = sorted([*ROOT.glob("examples/**/*.mk"), *ROOT.glob("machines/*.mk")])
GRAMMAR = ROOT / "grammar" / "mklang.tmLanguage.json"

SAMPLE = '''\
# triage.mk: route a support ticket
mklang 0.4
machine triage
entry classify
budget 25
tier balanced
result draft

context {
  ticket: { body: "<the customer ticket>", amount: 42, ratio: -1.5e3 }
  notes: [],
}

tool search_kb "Look up KB facts. Input: {query}."
hook amount_ok "True when amount <= 100."

state classify {
  tier fast
  structure "One word: \\"bug\\", billing or other."
  prompt """
    Classify this ticket: {{ticket.body}}
    A lone { brace and a "quote" stay text.
    """
  output category
  when "the category is billing" hook amount_ok -> draft
  otherwise -> lookup
}

state lookup {                         # a tool state
  tool search_kb { query: "{{ticket.body}}" }
  over chunks
  max_visits 3
  output kb
  when "no facts" escalate -> review ask "Handle manually?" reply_to manual.answer
  when "the reply has gaps" repair 2 -> lookup
  when "hopeless" fail
  otherwise -> END
}

state per_chunk {
  call summarize_doc { text: "{{item}}" }
  parse json
  otherwise -> END
}
'''


def tokens(text: str) -> list[tuple[object, str]]:
    return [(kind, value) for kind, value in MkLexer().get_tokens(text) if value.strip()]


def test_sample_tokens():
    toks = tokens(SAMPLE)
    assert not [t for t in toks if t[0] in Error]
    assert (Comment.Single, "# triage.mk: route a support ticket") in toks
    assert (Name.Class, "classify") in toks  # state and entry names
    assert (Name.Class, "draft") in toks and (Name.Class, "lookup") in toks  # gate targets
    assert (Keyword.Constant, "END") in toks
    assert (Operator, "->") in toks
    assert (Name.Namespace, "summarize_doc") in toks and (Name.Namespace, "triage") in toks
    assert (Name.Function, "search_kb") in toks and (Name.Function, "amount_ok") in toks
    for policy in ("repair", "escalate", "fail"):
        assert (Keyword.Reserved, policy) in toks
    assert (Keyword, "otherwise") in toks and (Keyword, "when") in toks
    assert (Number, "25") in toks and (Number, "-1.5e3") in toks and (Number, "0.4") in toks
    assert (String.Interpol, "{{ticket.body}}") in toks and (String.Interpol, "{{item}}") in toks
    assert (String.Escape, '\\"') in toks
    assert (Name.Variable, "manual.answer") in toks
    block = [value for kind, value in MkLexer().get_tokens(SAMPLE) if kind in String.Double]
    assert '"""' in block and 'A lone { brace and a "quote" stay text.' in "".join(block)


def test_unterminated_string_is_an_error_token():
    assert any(kind in Error for kind, _ in MkLexer().get_tokens('state a { prompt "open\n}\n'))


def test_registered_as_pygments_lexer():
    from pygments.lexers import get_lexer_by_name, get_lexer_for_filename

    assert isinstance(get_lexer_by_name("mk"), MkLexer)
    assert isinstance(get_lexer_for_filename("triage.mk"), MkLexer)


def test_highlight_source_is_a_rich_renderable():
    from rich.console import Console

    console = Console(force_terminal=True, color_system="standard", width=100)
    with console.capture() as captured:
        console.print(highlight_source("state a {\n  otherwise -> END\n}\n", line_numbers=True))
    out = captured.get()
    assert "\x1b[" in out
    assert "otherwise" in re.sub(r"\x1b\[[0-9;]*m", "", out)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_lexes_without_error(path):
    errors = [(value, kind) for kind, value in MkLexer().get_tokens(path.read_text()) if kind in Error]
    assert errors == []


# ---------------------------------------------------------------- TextMate


def regexes(node, where="$"):
    """Every (location, pattern) of a TextMate grammar: match, begin and end."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("match", "begin", "end") and isinstance(value, str):
                yield f"{where}.{key}", value
            else:
                yield from regexes(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from regexes(value, f"{where}[{index}]")


def grammar() -> dict:
    return json.loads(GRAMMAR.read_text())


def test_textmate_grammar_is_valid_and_compiles():
    data = grammar()
    assert data["scopeName"] == "source.mklang" and "mk" in data["fileTypes"]
    found = list(regexes(data))
    assert len(found) > 20
    for where, pattern in found:
        re.compile(pattern), where  # Oniguruma-only syntax would raise here
    includes = re.findall(r'"include": "#([\w-]+)"', GRAMMAR.read_text())
    assert set(includes) <= set(data["repository"]), "every include names a repository rule"


def test_textmate_rules_match_what_they_name():
    repo = grammar()["repository"]
    target = re.compile(repo["target"]["match"])
    assert target.search("otherwise -> draft").group(3) == "draft"
    assert target.search('when "x" repair 2 ->END').group(2) == "END"
    placeholder = re.compile(repo["placeholder"]["match"])
    assert placeholder.search('prompt "Reply to {{ ticket.body }} now"').group(2) == "ticket.body"
    state = re.compile(repo["declaration"]["patterns"][0]["match"])
    assert state.search("state per_chunk {").group(2) == "per_chunk"
    keyword = re.compile(repo["keyword"]["match"])
    assert keyword.search("  max_visits 3") and not keyword.search("outputs")
    policy = re.compile(repo["policy"]["match"])
    assert [m.group() for m in policy.finditer('when "x" repair 2 -> a  fail escalate')] == [
        "repair",
        "fail",
        "escalate",
    ]
    number = re.compile(repo["number"]["match"])
    assert number.search("ratio: -1.5e3").group() == "-1.5e3"
