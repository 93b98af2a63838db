"""Real `mklang` processes without an interpreter's start-up each, for the tests that kill them.

`Forks` starts this file as a factory once: it imports what a run and a resume
use, then forks one child per command it is sent. The child takes the
command's folder and environment (MKLANG_KILL_AT included), runs the CLI's
entry function and exits with its code, so it is a real process: it can be
killed with SIGKILL at a crash point, by a test's server or by the test, and
what it wrote survives as it would for `python -m mklang`. It costs a tenth
of the CPU of a new interpreter importing the same modules.

What a module reads from the environment as it is imported is the test
process's (the child re-reads MKLANG_KILL_AT): the colours of terminal output
(NO_COLOR) are not for a forked command to test.

`Forks.piped` starts a command whose stdout and stderr are pipes the test
reads as it runs (named pipes the factory opens before it forks), as
`subprocess.Popen` gives them: the Celery workers and batches of the fleet
tests (ADR 0046), which the factory's imports of Celery and kombu spare an
interpreter's start-up too. No connection is opened before a fork: each
child opens its own, as a new process does.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

# Imported by the factory before it forks: what `mklang run` and `mklang resume` load.
PRELOADED = (
    "genai_prices.data",
    "mklang.checker",
    "mklang.checkpoint.compat",
    "mklang.checkpoint.envelope",
    "mklang.checkpoint.journal",
    "mklang.checkpoint.segments",
    "mklang.checkpoint.trust",
    "mklang.cli.app",
    "mklang.cli.run_cmds",
    "mklang.host.plugins",
    "mklang.providers.cassette",
    "mklang.providers.factory",
    "mklang.providers.openai",
    "mklang.scenarios",
    "mklang.runs",
    "mklang.session",
    "mklang.stores.file",
    "mklang.syntax.build",
    "mklang.yaml_composer",
    # `mklang worker` and `mklang batch --executor celery`: Celery's worker and the transports.
    "amqp",
    "celery",
    "celery.apps.worker",
    "celery.concurrency.thread",
    "celery.worker.consumer",
    "kombu.transport.pyamqp",
    "kombu.transport.redis",
    "mklang.cli.scale_cmds",
    "mklang.distributed",
    "mklang.stores.postgres",
    "psycopg",
)


class Forked:
    """One forked `mklang` command: its pid at once, its exit code and output once it ends; as
    much of `subprocess.Popen` as the tests that signal a run use."""

    def __init__(self, forks: Forks, pid: int, output: Path):
        self._forks, self.pid, self._output = forks, pid, output
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the command ended (a negative one: the signal that killed it), else None."""
        if self.returncode is None:
            code = self._forks.ask({"poll": self.pid}).strip()
            self.returncode = int(code) if code else None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        assert self.pid > 0, f"no process to signal: pid {self.pid} would be this process group"
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stderr_line(self, containing: str, timeout: float = 30) -> str:
        """The first whole line the command wrote to stderr that holds `containing` ('' when none
        came in time): a batch says other things first (its preflight)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = Path(f"{self._output}.err").read_text().splitlines(keepends=True)
            found = [line for line in lines if line.endswith("\n") and containing in line]
            if found or time.monotonic() >= deadline:
                return found[0].rstrip("\n") if found else ""
            time.sleep(0.002)

    def communicate(self, timeout: float = 120) -> tuple[str, str]:
        """Wait for the command to end; its stdout and stderr. It is killed, and the test fails,
        after `timeout` seconds."""
        self._wait(timeout)
        stdout, stderr = (Path(f"{self._output}.{name}").read_text() for name in ("out", "err"))
        return stdout, stderr

    def _wait(self, timeout: float) -> int:
        """Its exit code once it ended; it is killed, and the test fails, after `timeout` seconds."""
        code = self._forks.ask({"wait": self.pid, "timeout": timeout}).strip()
        assert code != "timeout", f"forked command {self.pid} ran longer than {timeout} s"
        self.returncode = int(code)
        return self.returncode

    def wait(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Wait for the command to end, as `communicate` does: its code and output."""
        stdout, stderr = self.communicate(timeout)
        assert self.returncode is not None
        return subprocess.CompletedProcess([str(self.pid)], self.returncode, stdout, stderr)


class Piped(Forked):
    """A forked command whose `stdout` and `stderr` are pipes read while it runs: as much of
    `subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)` as the fleet tests use."""

    def __init__(self, forks: Forks, pid: int, output: Path, stdout: IO[str], stderr: IO[str]):
        super().__init__(forks, pid, output)
        self.stdout, self.stderr = stdout, stderr

    def wait(self, timeout: float = 120) -> int:  # type: ignore[override]
        """Wait for the command to end (its pipes unread, as `Popen.wait`): its exit code."""
        return self._wait(timeout)

    def communicate(self, timeout: float = 120) -> tuple[str, str]:
        """Read both pipes to their end while the command runs, then wait for it: its stdout and stderr."""
        read: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda name=name, pipe=pipe: read.update({name: pipe.read()}), daemon=True)
            for name, pipe in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            self.kill()
        self.wait(max(1.0, deadline - time.monotonic()))
        for reader in readers:
            reader.join(30)
        return read.get("out", ""), read.get("err", "")


class Forks:
    """The factory of forked commands (one per test process: `start` and `forked` share it)."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="mklang-forks-")
        self._count = 0
        self._asking = threading.Lock()  # a test's threads may ask too (a reader polls, a handler kills)
        self._factory = subprocess.Popen(
            # -P: this folder's modules are not put on the factory's path, where they could hide others.
            [sys.executable, "-P", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, request: dict) -> str:
        assert self._factory.stdin is not None and self._factory.stdout is not None
        with self._asking:
            self._factory.stdin.write(json.dumps(request) + "\n")
            self._factory.stdin.flush()
            answer = self._factory.stdout.readline()
        assert answer, "the factory of forked commands died"
        return answer

    def _next_output(self) -> Path:
        """Where the next command's stdout and stderr go (`.out`, `.err` beside this path)."""
        self._count += 1
        return Path(self._folder) / str(self._count)

    def _fork(self, args: list[str], env: dict[str, str], cwd: Path | None, output: Path) -> int:
        """Have the factory fork `mklang ARGS` with environment `env` in folder `cwd`: its pid."""
        return int(self.ask({"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "output": str(output)}))

    def start(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> Forked:
        """Start `mklang ARGS` in a forked child with environment `env`, in folder `cwd`."""
        output = self._next_output()
        return Forked(self, self._fork(args, env, cwd, output), output)

    def piped(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> Piped:
        """Start `mklang ARGS` as `start` does, its stdout and stderr pipes this process reads."""
        output = self._next_output()
        ends = []
        for name in ("out", "err"):
            os.mkfifo(f"{output}.{name}", 0o600)
            # Opened before the factory opens the other end, which it does before it forks: the
            # command's output has a reader from its first line on, and an end once it exited.
            ends.append(os.open(f"{output}.{name}", os.O_RDONLY | os.O_NONBLOCK))
        pid = self._fork(args, env, cwd, output)
        for end in ends:
            os.set_blocking(end, True)
        stdout, stderr = (open(end, encoding="utf-8", errors="replace") for end in ends)  # noqa: SIM115
        return Piped(self, pid, output, stdout, stderr)

    def close(self) -> None:
        """Stop the factory and remove the commands' output files and pipes (once the test process ends)."""
        assert self._factory.stdin is not None
        self._factory.stdin.close()
        self._factory.wait(timeout=30)
        shutil.rmtree(self._folder, ignore_errors=True)


_shared: Forks | None = None
_owner = 0  # the process that started `_shared`


def factory() -> Forks:
    """This test process's factory, started on first use. A process forked from one that had
    started it (mutmut runs each mutant's tests in a fork) starts its own: two processes asking
    one factory would read each other's answers, an exit code taken for a pid."""
    global _shared, _owner
    if _shared is None or _owner != os.getpid():
        _shared, _owner = Forks(), os.getpid()
        atexit.register(_shared.close)
    return _shared


def start(args: list[str], env: dict[str, str], cwd: Path | None = None) -> Forked:
    """Start `mklang ARGS` in a real process forked by this test process's factory."""
    return factory().start(args, env, cwd)


def piped(args: list[str], env: dict[str, str], cwd: Path | None = None) -> Piped:
    """Start `mklang ARGS` in a forked real process whose stdout and stderr this process reads as pipes."""
    return factory().piped(args, env, cwd)


def forked(
    *args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`mklang ARGS` in a forked real process, to its end: as `commands.mklang` runs it, no traceback."""
    done = start(list(args), env, cwd).wait(timeout)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _outputs(request: dict) -> list[int]:
    """In the factory, before it forks: the command's stdout and stderr, files it creates or the
    named pipes the test made (whose reader is open: the open returns at once)."""
    return [
        os.open(f"{request['output']}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for name in ("out", "err")
    ]


def _child(request: dict, outputs: list[int]) -> None:
    """In the forked child: become the command, run it, exit with its code."""
    from mklang import faults
    from mklang.cli import main

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the factory's requests are not the command's input
    for stream, output in zip((1, 2), outputs, strict=True):
        os.dup2(output, stream)
        os.close(output)
    faults._from_environment()  # as importing mklang does in a new process
    code = 1
    try:
        main(request["args"])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:  # what an interpreter does on its way out, not more: wait for the threads that are not
        # daemons (a worker's pool, a batch's runs), then the exit handlers (they flush telemetry)
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_ENDED: dict[int, str] = {}  # in the factory: exit codes of the children it reaped


def _exit_code(pid: int, timeout: float) -> str:
    """A child's exit code once it ends, "" if it still runs after `timeout` seconds (0: it is
    not waited for), or "timeout" (and the child killed) for a longer wait."""
    deadline = time.monotonic() + timeout
    while pid not in _ENDED:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            _ENDED[pid] = str(os.waitstatus_to_exitcode(status))
        elif not timeout:
            return ""
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        else:
            time.sleep(0.002)
    return _ENDED[pid]


def _serve() -> None:
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            print(_exit_code(request["wait"], request["timeout"]), flush=True)
            continue
        if "poll" in request:
            print(_exit_code(request["poll"], 0), flush=True)
            continue
        outputs = _outputs(request)
        pid = os.fork()
        if pid == 0:
            try:
                _child(request, outputs)
            finally:
                os._exit(1)  # the child never goes back to serving requests
        for output in outputs:  # only the child writes them: their readers see the end once it exited
            os.close(output)
        print(pid, flush=True)


if __name__ == "__main__":
    _serve()
