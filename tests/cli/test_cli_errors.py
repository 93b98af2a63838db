"""One error shape for every failure of every command, flag parsing included, and
the small things a new user trips on: NO_COLOR, a UTF-8 BOM, keyword typos, the
root cause first, `fmt --check` that says how to fix, and options that would
silently do nothing."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, cli_env, refused
from support.examples import HITL

APPROVAL = HITL / "approval"
TRIAGE = ROOT / "examples" / "triage"

HELLO = """\
machine hello
entry greet
budget 3

context {
  name: "<who to greet>"
}

state greet {
  structure "One line."
  prompt "Greet {{name}}."
  output greeting
  otherwise -> END
}
"""
SCRIPT = "scenarios:\n  - name: a\n    input: {name: Ada}\n    llm: {produce: [Hello]}\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "hello.mk").write_text(HELLO, encoding="utf-8")
    (tmp_path / "s.yaml").write_text(SCRIPT, encoding="utf-8")
    (tmp_path / "broken.toml").write_text("[tiers\nfast = 1\n", encoding="utf-8")
    done = cli("run", "hello.mk", "--script", "s.yaml", "--checkpoint", "cp.json", "--max-tokens", "0", cwd=tmp_path)
    assert done.returncode in (0, 3), done.stderr
    return tmp_path


FAILURES = [
    (["run", "hello.mk", "--max-token", "3"], 'unknown option --max-token; did you mean "--max-tokens"?'),
    (["run", "hello.mk", "--max-tokens", "abc"], "--max-tokens expects a whole number of at least 0, got 'abc'"),
    (["run", "hello.mk", "--format", "yaml"], "--format expects one of auto, text, json, got 'yaml'"),
    (["run", "hello.mk", "--concurrency", "0"], "--concurrency expects a whole number of at least 1, got '0'"),
    (["run", "hello.mk", "--max-tokens"], "--max-tokens needs a value"),
    (["run"], "missing MACHINE"),
    (["run", "hello.mk", "--config", "broken.toml", "--format", "json"], "broken.toml"),
    (["resume", "cp.json", "--budget", "many"], "--budget expects a whole number of at least 0, got 'many'"),
    (["show", "cp.json", "--last", "x"], "--last expects a whole number of at least 0, got 'x'"),
    (["config", "--config", "broken.toml"], "broken.toml"),
    (["check", "hello.mk", "--format", "json", "--strict"], "unknown option --strict"),
    (["test", "hello.mk", "--script", "s.yaml", "--format", "json", "--scenaro", "a"], "unknown option --scenaro"),
    (["rnu", "hello.mk"], "unknown command 'rnu'; did you mean \"run\"?"),
]


@pytest.mark.parametrize(("args", "words"), FAILURES, ids=[" ".join(a) for a, _ in FAILURES])
def test_every_failure_is_one_json_document_when_piped_and_printed_once(folder, args, words):
    """A CI script that parses stdout gets the error document for every failure, and the error is
    not printed a second time on stderr."""
    done = cli(*args, cwd=folder)
    assert done.returncode == 2, (done.stdout, done.stderr)
    document = json.loads(done.stdout)
    assert document == {"status": "error", "error": document["error"], "exit_code": 2} and words in document["error"]
    assert done.stderr == "", done.stderr


def test_text_format_keeps_stdout_empty_on_a_flag_error(folder):
    done = cli("run", "hello.mk", "--max-tokens", "abc", "--format", "text", cwd=folder)
    assert done.returncode == 2 and done.stdout == ""


def _on_a_terminal(args: list[str], folder: Path, **env: str) -> str:
    """What a command shows on a terminal (a real pseudo-terminal), both streams."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "mklang", *args],
        cwd=folder,
        env=cli_env(**env, COLUMNS="100"),
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize(
    "args",
    [["check", "bad.mk"], ["fmt", "bad.mk"], ["run", "hello.mk", "--script", "s.yaml"], ["show", "cp.json"]],
    ids=["check", "fmt", "run", "show"],
)
def test_no_color_is_honoured_by_every_command(folder, args):
    """Item 11: colours on a terminal, none at all with NO_COLOR."""
    (folder / "bad.mk").write_text(HELLO.replace("prompt", "promt"), encoding="utf-8")
    styled = re.compile(r"\x1b\[[0-9;]*m")  # colour and bold; moving the cursor is no style
    assert styled.search(_on_a_terminal(args, folder))
    plain = _on_a_terminal(args, folder, NO_COLOR="1")
    assert not styled.search(plain), plain


def test_a_utf8_bom_is_accepted_in_machines_and_scripts(folder):
    (folder / "bom.mk").write_bytes(b"\xef\xbb\xbf" + HELLO.encode())
    (folder / "bom.yaml").write_bytes(b"\xef\xbb\xbf" + SCRIPT.encode())
    assert cli("check", "bom.mk", cwd=folder).returncode == 0
    done = cli("test", "bom.mk", "--script", "bom.yaml", cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_misspelled_keyword_gets_a_did_you_mean(folder):
    (folder / "typo.mk").write_text(HELLO.replace("prompt", "promt"), encoding="utf-8")
    done = cli("check", "typo.mk", cwd=folder)
    assert done.returncode == 2
    assert 'not "promt"; did you mean "prompt"? [syntax]' in done.stderr


def test_the_root_cause_comes_before_its_consequences(folder):
    (folder / "lost.mk").write_text(HELLO.replace("otherwise -> END", "otherwise -> ENDD"), encoding="utf-8")
    done = cli("check", "lost.mk", "--format", "json", cwd=folder)
    codes = [d["code"] for d in json.loads(done.stdout) if d["severity"] == "error"]
    assert codes == ["unknown-target", "no-path-to-end"]


def test_fmt_check_names_the_files_and_the_command_that_fixes_them(folder):
    (folder / "ugly.mk").write_text(HELLO.replace("  prompt", "      prompt"), encoding="utf-8")
    done = cli("fmt", "--check", "ugly.mk", "hello.mk", cwd=folder)
    assert done.returncode == 1
    assert done.stdout == "ugly.mk\n"
    assert "1 file would be reformatted; fix with: mklang fmt --write ugly.mk" in done.stderr


def test_fmt_keeps_an_explicit_tier(folder):
    text = HELLO.replace("budget 3\n", "budget 3\ntier balanced\n")
    (folder / "tiered.mk").write_text(text, encoding="utf-8")
    assert cli("fmt", "tiered.mk", cwd=folder).stdout == text


def test_show_on_a_machine_file_says_it_is_not_a_checkpoint(folder):
    """Item 12."""
    done = cli("show", "hello.mk", "--format", "text", cwd=folder)
    assert done.returncode == 2
    assert "hello.mk is a machine file, not a checkpoint" in done.stderr


def test_graph_refuses_a_trace_of_another_machine(folder):
    done = cli("graph", str(APPROVAL / "approval.mk"), "--trace", "cp.json", cwd=folder)
    assert done.returncode == 2
    assert "cp.json is a run of machine 'hello', not of 'approval'" in done.stderr
    assert cli("graph", "hello.mk", "--trace", "cp.json", cwd=folder).returncode == 0


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--config", "broken.toml"], "cannot be combined with --provider, --model, --config"),
        (["--max-cost", "1"], "--max-cost needs model prices"),
    ],
    ids=["config", "max-cost"],
)
def test_options_a_scripted_run_would_ignore_are_refused(folder, extra, words):
    done = cli("run", "hello.mk", "--script", "s.yaml", *extra, "--format", "text", cwd=folder)
    assert done.returncode == 2
    assert words in done.stderr


def test_readme_shows_how_to_provide_tools_next_to_the_first_machine_that_declares_one():
    """Item 13."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_tool = readme.index("\ntool ")
    next_section = readme.index("\n## ", first_tool)
    near = readme[first_tool:next_section]
    assert "--plugin" in near and '"mklang.tools"' in near and "TOOLS" in near
    scenarios = readme[readme.index("## Scenario scripts") :]
    assert "reasoning" in scenarios and "<data-" in scenarios and "resumes:" in scenarios
    assert "mklang --install-completion" in readme


def test_shell_completion_completes_commands_and_options(folder):
    """The script is the named shell's, whatever shell (if any) runs the command."""
    shown = cli("--show-completion", "bash", cwd=folder)
    assert shown.returncode == 0 and "_MKLANG_COMPLETE=complete_bash" in shown.stdout
    assert "compdef _mklang_completion mklang" in cli("--show-completion", "zsh").stdout
    refused = cli("--show-completion", "tcsh")
    assert (refused.returncode, refused.stderr) == (
        2,
        "mklang: error: unknown shell 'tcsh' (choose from bash, zsh, fish, powershell, pwsh)\n",
    )
    env = cli_env(_MKLANG_COMPLETE="complete_bash", COMP_WORDS="mklang run hello.mk --max-t", COMP_CWORD="3")
    assert cli(cwd=folder, env=env).stdout.split() == ["--max-tokens", "--max-time"]


@pytest.mark.parametrize("option", ["--budget", "--max-tokens"])
def test_resume_refuses_a_negative_budget_before_reading_the_checkpoint(tmp_path, option):
    done = cli("resume", str(tmp_path / "missing.json"), option, "-1", cwd=tmp_path)
    line = refused(done, option)
    assert "missing.json" not in line


def test_a_checkpoint_or_store_in_a_folder_that_is_not_there_is_one_line_and_writes_nothing(folder):
    (folder / "in.jsonl").write_text('{"name": "Ada"}\n', encoding="utf-8")
    ran = cli(
        "run", "hello.mk", "--script", "s.yaml", "--checkpoint", "missing/cp.json", "--format", "text", cwd=folder
    )
    refused(ran, "missing/cp.json: no folder missing to keep the run in: make it first")
    batch = ["batch", "hello.mk", "--script", "s.yaml", "--inputs", "in.jsonl", "--store", "missing/runs"]
    refused(cli(*batch, cwd=folder), "missing/runs: cannot make the checkpoint store (a folder): No such file")
    assert not (folder / "missing").exists()
