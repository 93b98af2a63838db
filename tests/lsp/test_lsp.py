"""`mklang lsp`: a real server subprocess spoken to in JSON-RPC with Content-Length framing."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from mklang.lsp.analysis import Document
from mklang.syntax import format_machine, parse

TIMEOUT = 20

HELPER = """\
machine helper
entry echo
budget 3

state echo {
  structure "The text."
  prompt "Repeat {{text}}"
  output echoed
  otherwise -> END
}
"""

GOOD = """\
machine triage
entry classify
budget 10

context {
  ticket: { body: "hello" }
}

state classify {
  structure "One word."
  prompt "😀 Classify {{ticket.body}}"
  output category
  when "it is a bug" -> lookup
  otherwise -> draft
}

state lookup {
  call helper { text: "{{ticket.body}}" }
  output kb
  otherwise -> draft
}

state draft {
  structure "A reply."
  prompt "Reply using {{kb}}."
  output reply
  when "the reply has gaps" repair 1 -> draft
  otherwise -> END
}
"""

# The same machine with the target of the first gate missing (line 13, 0-based 12).
BROKEN = GOOD.replace('when "it is a bug" -> lookup', 'when "it is a bug" ->')
UGLY = GOOD.replace("  output category\n", "output    category\n").replace("budget 10", "budget   10")


def where(text: str, needle: str, nth: int = 0, shift: int = 0) -> dict:
    """The LSP position (UTF-16 columns) of the `nth` occurrence of `needle`, plus `shift` characters."""
    offset = -1
    for _ in range(nth + 1):
        offset = text.index(needle, offset + 1)
    offset += shift
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return {"line": line, "character": len(text[start:offset].encode("utf-16-le")) // 2}


class Client:
    """A minimal LSP client: framed JSON-RPC over the server's stdin/stdout."""

    def __init__(self, cwd: Path):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mklang", "lsp"],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.inbox: queue.Queue = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stream = self.process.stdout
        while True:
            headers = {}
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("ascii").partition(":")
                headers[name.strip().lower()] = value.strip()
            if not headers:
                return
            self.inbox.put(json.loads(stream.read(int(headers["content-length"]))))

    def send(self, message: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode("utf-8")
        self.process.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.process.stdin.flush()

    def notify(self, method: str, params: dict) -> None:
        self.send({"method": method, "params": params})

    def request(self, method: str, params: dict):
        self.next_id += 1
        self.send({"id": self.next_id, "method": method, "params": params})
        while True:
            message = self.inbox.get(timeout=TIMEOUT)
            if message.get("id") == self.next_id and "method" not in message:
                assert "error" not in message, message["error"]
                return message["result"]

    def diagnostics(self, uri: str) -> list[dict]:
        """The next diagnostics published for `uri`."""
        while True:
            message = self.inbox.get(timeout=TIMEOUT)
            if message.get("method") == "textDocument/publishDiagnostics" and message["params"]["uri"] == uri:
                return message["params"]["diagnostics"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lsp")
    (folder / "helper.mk").write_text(HELPER)
    path = folder / "triage.mk"
    path.write_text(GOOD)
    client = Client(folder)
    client.request("initialize", {"processId": None, "rootUri": folder.as_uri(), "capabilities": {}})
    client.notify("initialized", {})
    # Opened here, not by one of the tests: they run in any order, and each changes it back to GOOD.
    opened = {"uri": path.as_uri(), "languageId": "mklang", "version": 0, "text": GOOD}
    client.notify("textDocument/didOpen", {"textDocument": opened})
    assert client.diagnostics(path.as_uri()) == []
    yield client, path.as_uri(), folder
    client.request("shutdown", {})
    client.notify("exit", {})
    assert client.process.wait(timeout=TIMEOUT) == 0


def test_diagnostics_follow_the_text(session):
    client, uri, _ = session
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 1}, "contentChanges": [{"text": BROKEN}]}
    )
    [diagnostic] = client.diagnostics(uri)
    assert diagnostic["severity"] == 1 and diagnostic["source"] == "mklang"
    assert "->" in diagnostic["message"]
    # The front end reports line 13, column 24 (the end of the line, 1-based); LSP counts from 0.
    end_of_line = where(BROKEN, '"it is a bug" ->', shift=16)
    assert end_of_line == {"line": 12, "character": 23}
    assert diagnostic["range"] == {"start": end_of_line, "end": {"line": 12, "character": 24}}

    client.notify(
        "textDocument/didChange",
        {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": GOOD}]},
    )
    assert client.diagnostics(uri) == []


def test_check_warning_has_the_node_range(session):
    client, uri, _ = session
    text = GOOD.replace("Reply using {{kb}}.", "Reply using {{kb}} and {{nobody.wrote}}.")
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 3}, "contentChanges": [{"text": text}]}
    )
    [found] = client.diagnostics(uri)
    assert found["severity"] == 2 and found["code"] == "unwritten-context-key"
    line = '  prompt "Reply using {{kb}} and {{nobody.wrote}}."'
    assert found["range"] == {"start": where(text, line, shift=2), "end": where(text, line, shift=len(line))}
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 4}, "contentChanges": [{"text": GOOD}]}
    )
    assert client.diagnostics(uri) == []


def position(uri: str, text: str, needle: str, nth: int = 0, shift: int = 0) -> dict:
    return {"textDocument": {"uri": uri}, "position": where(text, needle, nth, shift)}


def test_definition_of_a_gate_target_and_a_call(session):
    client, uri, folder = session
    answer = client.request("textDocument/definition", position(uri, GOOD, "-> lookup", shift=4))
    assert answer["uri"] == uri
    assert answer["range"] == {"start": where(GOOD, "lookup {"), "end": where(GOOD, "lookup {", shift=6)}
    answer = client.request("textDocument/definition", position(uri, GOOD, "helper", shift=2))
    assert Path(answer["uri"].removeprefix("file://")).resolve() == (folder / "helper.mk").resolve()


def test_references_of_a_state(session):
    client, uri, _ = session
    params = position(uri, GOOD, "state draft", shift=7) | {"context": {"includeDeclaration": True}}
    found = client.request("textDocument/references", params)
    starts = sorted((r["range"]["start"]["line"], r["range"]["start"]["character"]) for r in found)
    expected = sorted(
        (p["line"], p["character"])
        for p in [
            where(GOOD, "-> draft", 0, 3),
            where(GOOD, "-> draft", 1, 3),
            where(GOOD, "-> draft", 2, 3),
            where(GOOD, "state draft", 0, 6),
        ]
    )
    assert starts == expected
    params["context"]["includeDeclaration"] = False
    assert len(client.request("textDocument/references", params)) == 3


def test_completion(session):
    client, uri, _ = session
    text = GOOD.replace("  otherwise -> END\n}", "  otherwise -> \n}")
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 5}, "contentChanges": [{"text": text}]}
    )
    client.diagnostics(uri)
    answer = client.request("textDocument/completion", position(uri, text, "otherwise -> \n", shift=13))
    assert [item["label"] for item in answer["items"]] == ["classify", "lookup", "draft", "END"]
    inside = client.request("textDocument/completion", position(uri, text, "  output reply", shift=2))
    labels = {item["label"] for item in inside["items"]}
    assert {"prompt", "when", "otherwise", "sample", "max_visits"} <= labels and "machine" not in labels
    keys = client.request("textDocument/completion", position(uri, text, "{{kb}}", shift=2))
    assert {"ticket", "ticket.body", "category", "kb", "reply"} <= {item["label"] for item in keys["items"]}
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 6}, "contentChanges": [{"text": GOOD}]}
    )
    client.diagnostics(uri)


def test_hover(session):
    client, uri, _ = session
    state = client.request("textDocument/hover", position(uri, GOOD, "-> lookup", shift=5))
    assert state["contents"]["kind"] == "markdown"
    assert state["contents"]["value"].startswith("**state `lookup`**: call helper, output `kb`")
    declared = client.request("textDocument/hover", position(uri, GOOD, "state draft", shift=8))
    assert declared["contents"]["value"] == (
        "**state `draft`**: generative, output `reply`\n\n"
        "model calls a visit: at least 1, at most 2\n\n"  # the draft, and the judge of `the reply has gaps`
        "- the reply has gaps · repair 1 → `draft`\n"
        "- otherwise → `END`"
    )
    key = client.request("textDocument/hover", position(uri, GOOD, "{{kb}}", shift=3))
    assert "state `lookup` writes it (`output kb`)" in key["contents"]["value"]
    assert key["range"] == {"start": where(GOOD, "{{kb}}"), "end": where(GOOD, "{{kb}}", shift=6)}
    # After a non-BMP character the client counts UTF-16 units: the server must too.
    body = client.request("textDocument/hover", position(uri, GOOD, "{{ticket.body}}", shift=4))
    assert "initial `context`" in body["contents"]["value"]
    assert body["range"]["start"] == where(GOOD, "{{ticket.body}}")


def test_formatting(session):
    client, uri, _ = session
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 7}, "contentChanges": [{"text": UGLY}]}
    )
    client.diagnostics(uri)
    params = {"textDocument": {"uri": uri}, "options": {"tabSize": 2, "insertSpaces": True}}
    [edit] = client.request("textDocument/formatting", params)
    assert edit["newText"] == format_machine(parse(UGLY))
    assert "  output category\n" in edit["newText"] and "budget 10\n" in edit["newText"]
    assert edit["range"]["start"] == {"line": 0, "character": 0}
    assert edit["range"]["end"]["line"] == UGLY.count("\n")


def test_document_symbols(session):
    client, uri, _ = session
    client.notify(
        "textDocument/didChange", {"textDocument": {"uri": uri, "version": 8}, "contentChanges": [{"text": GOOD}]}
    )
    client.diagnostics(uri)
    found = client.request("textDocument/documentSymbol", {"textDocument": {"uri": uri}})
    assert [(s["name"], s["detail"]) for s in found] == [
        ("classify", "generative"),
        ("lookup", "call helper"),
        ("draft", "generative"),
    ]
    assert found[1]["selectionRange"]["start"] == where(GOOD, "lookup {")
    assert found[1]["range"]["start"] == where(GOOD, "state lookup")


# ---------------------------------------------------------------- without a client


def test_keywords_at_top_level_and_inside_a_map():
    doc = Document(GOOD)
    top = {c.label for c in doc.completions((3, 0))}  # the blank line after `budget 10`
    assert "machine" in top and "prompt" not in top
    in_map = doc.completions((5, 2))  # inside `context { ... }`
    assert in_map == []


def test_broken_text_keeps_the_last_machine():
    first = Document(GOOD)
    second = Document(BROKEN, previous=first.model)
    assert second.machine is None and second.model is first.machine
    assert second.formatted() is None
    assert [c.label for c in second.completions((12, len('  when "it is a bug" ->')))][:3] == [
        "classify",
        "lookup",
        "draft",
    ]
