"""Attacks on "one process per run" (two resumes of one checkpoint must never both pay).

Two `mklang resume` of one suspended checkpoint are started at random
offsets from each other, many times; every completed model call must be
paid exactly once, because the run's lock is taken before the checkpoint is
read and held until the run ends. The lock file is never followed through a
symlink.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
from support.commands import cli, cli_env, model_config, refused
from support.fakeserver import FakeServer, answer

MACHINE = """\
mklang 0.4
machine race
entry one
budget 10

state one {
  structure "One word."
  prompt "first"
  output a
  otherwise -> two
}

state two {
  structure "One word."
  prompt "second"
  output b
  otherwise -> three
}

state three {
  structure "One word."
  prompt "third"
  output c
  otherwise -> END
}
"""
TRIALS = 20
CALLS_LEFT = 2  # a suspended run resumes at `two`


@pytest.fixture(scope="module")
def suspended(tmp_path_factory):
    """A checkpoint suspended on its token budget after the first call, and the server it talks to."""
    folder = tmp_path_factory.mktemp("race")
    with FakeServer() as server:
        server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5, delay=0.02)
        config = model_config(server.openai_url, folder / "mklang.toml")
        (folder / "race.mk").write_text(MACHINE, encoding="utf-8")
        done = cli(
            "run", "race.mk", "--config", str(config), "--checkpoint", "cp.json", "--max-tokens", "1", cwd=folder
        )
        assert done.returncode == 3, done.stderr
        assert server.count == 1
        yield folder, config, server


# A resume factory: it imports what a resume uses once, then for each line "CHECKPOINT OFFSET"
# forks one `mklang resume CHECKPOINT`, waits OFFSET seconds, forks a second,
# and prints both exit codes. Forked after the imports, a resume costs only
# its own work (a tenth of the CPU of one that imports them), so many trials stay
# quick while each resume is a real process.
FACTORY = """
import os, sys, time
import genai_prices.data
import mklang.checker, mklang.cli, mklang.cli.app, mklang.cli.run_cmds, mklang.host.plugins, mklang.runs
import mklang.checkpoint.compat, mklang.checkpoint.envelope, mklang.checkpoint.journal, mklang.checkpoint.segments
import mklang.checkpoint.trust, mklang.providers.cassette, mklang.providers.factory, mklang.providers.openai
import mklang.session, mklang.stores.file, mklang.syntax.build, mklang.yaml_composer

def resume(checkpoint, config):
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the factory's stdout carries only exit codes
        code = 1
        try:
            # Every trial resumes a copy of one suspended run: allowed to roll back to it.
            mklang.cli.main(["resume", checkpoint, "--config", config, "--max-tokens", "1000", "--format", "json",
                             "--allow-rollback"])
        except SystemExit as exit:
            code = exit.code or 0
        finally:
            os._exit(code)
    return pid

config = sys.argv[1]
for line in sys.stdin:
    checkpoint, offset = line.split()
    first = resume(checkpoint, config)
    time.sleep(float(offset))
    second = resume(checkpoint, config)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in (first, second)]
    print(*codes, flush=True)
"""


def test_two_resumes_at_random_offsets_never_pay_a_call_twice(suspended):
    folder, config, server = suspended
    rng = random.Random(10)
    factory = subprocess.Popen(
        [sys.executable, "-c", FACTORY, str(config)],
        cwd=folder,
        env=cli_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    outcomes = []
    try:
        for trial in range(TRIALS):
            shutil.copy(folder / "cp.json", folder / f"cp{trial}.json")
            before = server.count
            # From at once to after the first resume has finished.
            factory.stdin.write(f"cp{trial}.json {rng.uniform(0.0, 0.15):.4f}\n")
            factory.stdin.flush()
            codes = sorted(int(code) for code in factory.stdout.readline().split())
            assert server.count - before == CALLS_LEFT, f"trial {trial}: a completed call was paid twice"
            outcomes.append(codes)
    finally:
        _, stderr = factory.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
    assert outcomes == [[0, 2]] * TRIALS  # one finishes, the other is refused


def test_the_lock_file_is_not_followed_through_a_symlink(suspended, tmp_path):
    folder, config, server = suspended
    shutil.copy(folder / "cp.json", tmp_path / "cp.json")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "cp.json.lock")
    before = server.count
    refused(
        cli("resume", "cp.json", "--config", str(config), "--max-tokens", "1000", cwd=tmp_path),
        "cannot lock the checkpoint",
    )
    assert victim.read_text() == "precious\n"  # neither truncated nor written through the link
    assert server.count == before
