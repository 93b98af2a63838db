"""The docs site keeps its promises: the tutorial runs as written, from its files and commands, the
home page's machine checks clean, and the site's link check finds what is broken (the strict
build itself runs in .ci/run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, cli_env

TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
MARK = "@@@ exit "


def tutorial_files() -> dict[str, str]:
    """The `mk` and `yaml` blocks of the tutorial, by the name their first line gives them."""
    files = {}
    for language, body in FENCE.findall(TUTORIAL):
        named = re.match(r"# ([\w.-]+\.(?:mk|yaml))\b", body)
        if language in ("mk", "yaml"):
            assert named, f"a {language} block of the tutorial names no file on its first line"
            files[named.group(1)] = body
    return files


def tutorial_commands() -> list[tuple[str, list[str]]]:
    """Each `$ command` of the tutorial's console blocks, in order, with the lines shown after it."""
    commands: list[tuple[str, list[str]]] = []
    for language, body in FENCE.findall(TUTORIAL):
        if language != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            elif line.strip():
                commands[-1][1].append(line)
    return commands


def run_in_one_shell(commands: list[str], cwd: Path) -> list[tuple[str, int]]:
    """Run the commands one after the other in one bash, as a reader types them; each one's output
    (stdout and stderr, as a terminal shows them) and exit status."""
    script = "".join(f"{command}\nstatus=$?; printf '\\n{MARK}%d\\n' $status; (exit $status)\n" for command in commands)
    env = cli_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", COLUMNS="200")
    done = subprocess.run(
        ["bash"], input=script, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stderr == "", done.stderr
    pieces = re.split(rf"\n{re.escape(MARK)}(\d+)\n", done.stdout)
    return [(pieces[i], int(pieces[i + 1])) for i in range(0, len(pieces) - 1, 2)]


def test_the_tutorial_runs_as_written(tmp_path):
    """Its files written, its commands run in order in one folder: each prints the lines the page
    shows after it (in that order), and exits 0 unless the page's next command shows its status."""
    files = tutorial_files()
    assert sorted(files) == ["haiku.mk", "haiku.scenarios.yaml"]
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    commands = tutorial_commands()
    assert [command.split()[1] for command, _ in commands if command.startswith("mklang ")] == [
        "check", "test", "run", "run", "show", "resume", "graph",
    ]  # fmt: skip
    # 2>&1: what the page shows is what a terminal shows, both streams.
    results = run_in_one_shell([f"{command} 2>&1" for command, _ in commands], tmp_path)
    assert len(results) == len(commands)
    for number, ((command, shown), (output, status)) in enumerate(zip(commands, results, strict=True)):
        lines = output.splitlines()
        for expected in shown:
            found = next((i for i, line in enumerate(lines) if expected.strip() in line), None)
            assert found is not None, f"`{command}` did not print {expected!r}:\n{output}"
            lines = lines[found + 1 :]
        following = commands[number + 1][0] if number + 1 < len(commands) else ""
        if following == "echo $?":
            assert commands[number + 1][1] == [str(status)], f"`{command}` exited {status}:\n{output}"
        elif command != "echo $?":
            assert status == 0, f"`{command}` exited {status}:\n{output}"
    drawn = (tmp_path / "haiku.svg").read_text(encoding="utf-8")
    assert drawn.startswith("<svg") and 'class="edge gate taken"' in drawn


def test_the_home_pages_machine_checks_clean(tmp_path):
    (machine,) = [
        body for language, body in FENCE.findall((ROOT / "docs" / "index.md").read_text()) if language == "mk"
    ]
    (tmp_path / "greet.mk").write_text(machine, encoding="utf-8")
    done = cli("check", str(tmp_path / "greet.mk"))
    assert (done.returncode, done.stderr) == (0, "0 errors, 0 warnings in 1 file\n")


def write_site(site: Path, pages: dict[str, str]) -> None:
    for name, body in pages.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(f"<!doctype html><html><body>{body}</body></html>", encoding="utf-8")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    write_site(
        tmp_path,
        {
            "index.html": '<a href="docs/a.html#here">a</a> <a href="https://example.com/x">out</a> <a href="#top">top</a>'
            '<p id="top"></p> <img src="_images/g.png"> <a href="docs/">docs</a>',
            "docs/index.html": '<a href="../index.html">up</a>',
            "docs/a.html": '<h2 id="here">here</h2><a href="b.html">b</a><a href="a.html#gone">gone</a>'
            '<a href="../../outside.html">out</a><a href="../_images/none.png">none</a>',
            "docs/b.html": "<p>b</p>",
        },
    )
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "g.png").write_bytes(b"png")
    return tmp_path


def test_the_link_check_names_each_broken_link_and_nothing_else(site):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_site.py"), str(site)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "docs/a.html: a.html#gone (no such anchor)",
        "docs/a.html: ../../outside.html (outside the site)",
        "docs/a.html: ../_images/none.png (no such file)",
    ]
    assert done.stderr == "3 broken links in 4 pages\n"
    write_site(site, {"docs/a.html": '<h2 id="here">here</h2><a href="b.html">b</a>'})  # mended
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_site.py"), str(site)], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (0, "")
