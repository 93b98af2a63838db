"""What mklang 1.x users type: `lint`, `init`, `doctor`, a machine run by its library name, and
the 1.x commands and flags this release does without, each pointed to the way it is done here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import ROOT
from support.commands import cli, cli_env, mklang, refused

BROKEN = "machine broken\nentry nowhere\nbudget 1\n"


def test_lint_runs_check_and_says_so(tmp_path):
    (tmp_path / "broken.mk").write_text(BROKEN)
    linted = mklang("lint", "broken.mk", cwd=tmp_path)
    checked = mklang("check", "broken.mk", cwd=tmp_path)
    assert linted.returncode == checked.returncode == 2
    note, *rest = linted.stderr.splitlines()
    assert note == "mklang: lint is mklang check in mklang 2: running mklang check"
    assert rest == checked.stderr.splitlines()


@pytest.mark.parametrize(
    ("args", "pointer"),
    [
        (["resume", "cp.json", "--max-steps", "3"], '--max-steps is a mklang 1.x option: it is "--budget"'),
        (
            ["run", "m.mk", "--max-steps", "3"],
            "--max-steps is a mklang 1.x option: a run's step budget is its machine's",
        ),
        (["run", "m.mk", "--strict"], "--strict is a mklang 1.x option: it is the default"),
        (["run", "m.mk", "--max-step", "3"], "--max-steps is a mklang 1.x option: a run's step budget"),  # a typo
        (["run", "m.mk", "--colour"], "--color is a mklang 1.x option: colours appear only on a terminal"),
        (["run", "m.mk", "--workspace", "w"], "--workspace is a mklang 1.x option: there are no built-in file tools"),
        (["machines"], "mklang machines is a mklang 1.x command: the standard library's machines are the .mk files"),
        (
            ["console"],
            "mklang console is a mklang 1.x command: the console is a web console of a store's runs: mklang serve",
        ),
    ],
)
def test_a_1x_flag_or_command_is_pointed_to_the_way_here_not_to_a_lookalike(tmp_path, args, pointer):
    done = cli(*args, "--format", "text", cwd=tmp_path) if args[0] != "machines" else cli(*args, cwd=tmp_path)
    line = refused(done, pointer)
    assert "did you mean" not in line, line
    assert args[0] == "resume" or '"--budget"' not in line, line  # named only where the command has it


@pytest.mark.parametrize(
    "args",
    [["test", "m.mk", "--config", "c.toml"], ["run", "m.mk", "--version"], ["test", "m.mk", "--max-tokens", "3"]],
)
def test_an_option_merely_like_a_1x_name_gets_no_1x_pointer(tmp_path, args):
    """`--config` is no `--continue`, `--version` no `--session`, `--max-tokens` no `--max-steps`."""
    assert "is a mklang 1.x option" not in refused(cli(*args, "--format", "text", cwd=tmp_path), "unknown option")


def test_a_typo_that_is_no_1x_name_still_gets_did_you_mean(tmp_path):
    done = cli("run", "m.mk", "--max-token", "3", "--format", "text", cwd=tmp_path)
    assert done.returncode == 2 and 'did you mean "--max-tokens"?' in done.stderr


def test_a_machine_of_the_library_runs_by_its_name_from_any_folder(tmp_path):
    script = ROOT / "machines" / "chain_of_thought.scenarios.yaml"
    done = mklang("run", "chain_of_thought", "--script", str(script), "--scenario", "answer-follows", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"status": "done"' in done.stdout


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("std_cot", "std_cot is a machine of mklang 1.x's standard library; its nearest here is chain_of_thought"),
        ("std_tot", "std_tot is a machine of mklang 1.x's standard library; it has none here"),
        ("chain_of_thouht", 'no file chain_of_thouht and no machine of that name; did you mean "chain_of_thought"?'),
    ],
)
def test_a_name_that_is_no_file_and_no_library_machine_says_what_there_is(tmp_path, name, said):
    done = cli("run", name, "--format", "text", cwd=tmp_path)
    assert done.returncode == 2 and said in done.stderr and "cannot read the file" not in done.stderr, done.stderr


def test_init_makes_a_project_whose_tests_pass_and_keeps_files_that_exist(tmp_path):
    made = mklang("init", "project", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert sorted(path.name for path in (tmp_path / "project").iterdir()) == ["hello.mk", "hello.scenarios.yaml"]
    tested = mklang("test", "hello.mk", "--script", "hello.scenarios.yaml", cwd=tmp_path / "project")
    assert tested.returncode == 0 and "2 passed, 0 failed" in tested.stdout, tested.stdout + tested.stderr
    checked = mklang("check", "hello.mk", cwd=tmp_path / "project")
    assert "0 errors, 0 warnings" in checked.stderr
    (tmp_path / "project" / "hello.mk").write_text("# mine\n")
    again = mklang("init", "project", cwd=tmp_path)
    assert again.returncode == 0 and "kept project/hello.mk (it exists)" in again.stderr
    assert (tmp_path / "project" / "hello.mk").read_text() == "# mine\n"


def doctor(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return mklang("doctor", *args, cwd=tmp_path, env=cli_env(XDG_CONFIG_HOME=str(tmp_path / "home"), **env))


def test_doctor_says_what_is_set_and_what_to_do_about_what_is_not(tmp_path):
    done = doctor(tmp_path, OPENAI_API_KEY="sk-test")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(line.split()[0] in ("ok", "missing", "error") for line in lines)
    assert "ok      OPENAI_API_KEY: set (provider openai)" in lines
    assert any(line.startswith("missing ANTHROPIC_API_KEY: not set: export it") for line in lines)
    assert any(line.startswith("ok      config: none found") for line in lines)
    assert any(
        line.startswith("ok      checkpoint key: ") and "is made on the first checkpoint" in line for line in lines
    )
    assert any(line.startswith("ok      store .: reachable, 0 runs") for line in lines)
    assert [line.split(":")[0].split()[-1] for line in lines if " extra " in line] == [
        "console",
        "otel",
        "lsp",
        "distributed",
    ]


def test_doctor_fails_on_a_store_it_cannot_reach_or_a_broken_config(tmp_path):
    unreachable = doctor(tmp_path, "--store", "sqlite:///missing/runs.db")
    assert unreachable.returncode == 2
    (line,) = [line for line in unreachable.stdout.splitlines() if " store " in line]
    assert line.startswith("error   store sqlite:///missing/runs.db: ") and line.count("missing/runs.db") == 2, line
    refused = doctor(tmp_path, "--store", "postgresql://u:secret@127.0.0.1:1/test")  # nothing listens on port 1
    (line,) = [line for line in refused.stdout.splitlines() if " store " in line]
    assert refused.returncode == 2 and line.count("postgresql://u:***@127.0.0.1:1/test") == 1, line
    assert "secret" not in refused.stdout + refused.stderr
    (tmp_path / "mklang.toml").write_text("[tiers\n")
    broken = doctor(tmp_path)
    assert broken.returncode == 2
    assert any(line.startswith("error   config: ") for line in broken.stdout.splitlines()), broken.stdout


BLOCK_STARLETTE = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "starlette":
            raise ImportError(name)
sys.meta_path.insert(0, Blocked())
from mklang.cli import main
main(["doctor"])
"""


def test_doctor_names_the_install_of_a_missing_extra(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_STARLETTE], cwd=tmp_path, env=cli_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "missing extra console: not installed: pip install 'mklang[console]>=2' for mklang serve" in done.stdout
