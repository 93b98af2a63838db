"""Checks before the first paid call: API keys, tool and hook implementations, the
version line, and the check warnings `mklang run` prints as it starts.

Each refusal is exit 2 with one line on stderr, and the model server (a real
HTTP server on 127.0.0.1) has received no request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, cli_env, refused
from support.fakeserver import FakeServer, answer
from support.runs import CALLS_CHILD, HOOKED_CHILD

import mklang as api
from mklang.errors import UsageError
from mklang.providers.scripted import ScriptedProvider

PUBLISH = """\
machine post
entry write
budget 5

tool publish "Post the text. Input: {text}."

state write {
  structure "One line."
  prompt "Write a line."
  output line
  otherwise -> send
}

state send {
  tool publish { text: "{{line}}" }
  output url
  otherwise -> END
}
"""

PLUGIN = """\
TOOLS = {"publish": lambda input: "https://example.test/1"}
"""


def project(tmp_path: Path, **files: str) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def run_against(server: FakeServer, folder: Path, machine: str, *args: str, **env: str):
    environment = cli_env(OPENAI_BASE_URL=server.openai_url, **env)
    return cli(
        "run", machine, "--provider", "openai", "--model", "m", "--format", "json", *args, cwd=folder, env=environment
    )


def test_a_missing_api_key_is_refused_naming_the_variable():
    done = cli(
        "run",
        str(ROOT / "machines" / "chain_of_thought.mk"),
        "--set",
        "question=why",
        "--provider",
        "openai",
        "--model",
        "m",
        "--format",
        "json",
        env=cli_env(OPENAI_BASE_URL="http://mklang-preflight.invalid/v1"),
    )
    refused(done, "OPENAI_API_KEY is not set", "export OPENAI_API_KEY=")


@pytest.mark.parametrize("key", ["sk-abc def", "sk-abc\n", '"sk-abc"', "sk-äbc"])
def test_a_malformed_api_key_is_refused_before_any_request(tmp_path, key):
    folder = project(tmp_path, **{"post.mk": PUBLISH, "tools.py": PLUGIN})
    with FakeServer() as server:
        server.add(answer("Hello."))
        done = run_against(server, folder, "post.mk", "--plugin", "tools.py", OPENAI_API_KEY=key)
        refused(done, "OPENAI_API_KEY is malformed")
        assert key.strip() not in done.stderr + done.stdout  # never echo a secret
        assert server.count == 0


def test_a_declared_tool_without_implementation_is_refused_naming_it_and_how_to_provide_it(tmp_path):
    folder = project(tmp_path, **{"post.mk": PUBLISH, "tools.py": PLUGIN})
    with FakeServer() as server:
        server.add(answer("Hello."))
        done = run_against(server, folder, "post.mk")
        refused(done, 'tool "publish" has no implementation', "--plugin", '"mklang.tools" entry point')
        assert server.count == 0
        with_plugin = run_against(server, folder, "post.mk", "--plugin", "tools.py")
        assert with_plugin.returncode == 0, with_plugin.stderr
        assert server.count == 1


def test_a_hook_declared_by_a_called_machine_is_checked_too(tmp_path):
    folder = project(tmp_path, **{"parent.mk": CALLS_CHILD, "child.mk": HOOKED_CHILD})
    with FakeServer() as server:
        server.add(answer("Hmm."))
        done = run_against(server, folder, "parent.mk")
        refused(done, 'hook "plausible" has no implementation')
        assert server.count == 0


def test_a_version_line_this_release_does_not_run_is_refused(tmp_path):
    folder = project(tmp_path, **{"parent.mk": CALLS_CHILD, "child.mk": "mklang 9.1\n" + HOOKED_CHILD})
    with FakeServer() as server:
        done = run_against(server, folder, "parent.mk")
        refused(done, "child.mk:1:1: this is mklang", "not the newer 9.1")
        assert server.count == 0


def test_the_python_api_gets_the_same_preflight(tmp_path):
    project(tmp_path, **{"post.mk": PUBLISH})
    with pytest.raises(UsageError, match='tool "publish" has no implementation'):
        api.run(str(tmp_path / "post.mk"), provider=ScriptedProvider({"produce": ["x"]}))
    done = api.run(
        str(tmp_path / "post.mk"), provider=ScriptedProvider({"produce": ["x"]}), tools={"publish": lambda i: "ok"}
    )
    assert done.status == "done"


UNCLOSED = """\
machine hello
entry greet
budget 3

state greet {
  structure "One line."
  prompt "Greet {{name."
  output greeting
  otherwise -> END
}
"""


def test_check_warnings_are_printed_as_a_run_starts_unless_quiet(tmp_path):
    folder = project(
        tmp_path, **{"hello.mk": UNCLOSED, "s.yaml": "scenarios:\n  - name: a\n    llm: {produce: [hi]}\n"}
    )
    done = cli("run", "hello.mk", "--script", "s.yaml", "--format", "json", cwd=folder)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("hello.mk:7:3: warning: ") and first.endswith("[unclosed-placeholder]")
    assert len(done.stderr.splitlines()) == 1
    quiet = cli("run", "hello.mk", "--script", "s.yaml", "--format", "json", "--quiet", cwd=folder)
    assert quiet.returncode == 0 and quiet.stderr == ""
    check = cli("check", "hello.mk", cwd=folder)
    assert "never closes it" in check.stderr
