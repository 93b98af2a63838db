"""Suite-wide fixtures and hooks; the helpers test modules share are in `support/`.

`checkpoints_match_the_schema` (autouse) holds the published schema,
docs/checkpoint.schema.json, to everything the suite writes: every envelope
serialized in the test process, and every checkpoint file a test leaves in
its `tmp_path` (so those written by `mklang` subprocesses too). A
checkpoint the schema rejects fails the test that wrote it.

Every test, and every `mklang` process a test starts, signs checkpoints with
a key of its own: the per-user checkpoint key lives under XDG_CONFIG_HOME
(ADR 0014), which points at a temporary folder before any test module is
imported, away from the real user's key; the generations seen of each run live
under XDG_STATE_HOME (ADR 0022), a temporary folder of each test's own.
"""

from __future__ import annotations

import compileall
import fnmatch
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support import ROOT
from support.fakeserver import FakeServer
from support.services import postgres_schema

from mklang.checkpoint.envelope import FORMAT, Envelope, load
from mklang.errors import MklangError

_CONFIG_HOME = tempfile.mkdtemp(prefix="mklang-tests-xdg-")
# Tests write and rename thousands of small files (checkpoints, journals, stores): on a
# tmpfs that costs no disk I/O. A crash test kills processes, which no file system loses data to.
MEMORY = "/dev/shm"


def _rewrite_test_modules_ahead(config: pytest.Config) -> None:
    """Write pytest's cache of the assert-rewritten test modules before the xdist workers start (ADR 0046).

    Where PYTHONDONTWRITEBYTECODE is set (the machines this suite runs on set it), pytest reads that
    cache but never writes it, and where it is not, a fresh clone's workers all rewrite at once:
    each worker rewrote and compiled every test module, 2.6 s of CPU each. Two processes write it
    here, halves apart; a worker reads it as pytest always does (a module changed since is
    rewritten by the worker, as before). Built on pytest's own rewriting functions: where a pytest
    release renames them, the workers rewrite as they did."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
        )
    except ImportError:
        return
    if config.getoption("assertmode") != "rewrite" or assertstate_key not in config.stash:
        return
    state = config.stash[assertstate_key]
    asked = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    modules = [
        (path, get_cache_dir(path) / f"{path.stem}{PYC_TAIL}")
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name == "conftest.py"
        or (
            any(fnmatch.fnmatch(path.name, pattern) for pattern in config.getini("python_files"))
            and any(path == folder or folder in path.parents for folder in asked)  # only what the run collects
        )
    ]
    stale = [(path, pyc) for path, pyc in modules if _read_pyc(path, pyc) is None]
    if not stale:
        return
    child = os.fork()  # no thread runs yet: xdist starts its workers after pytest_configure
    try:
        for path, pyc in stale[child == 0 :: 2]:
            try:
                source_stat, code = _rewrite_test(path, config)
                pyc.parent.mkdir(exist_ok=True)
            except (OSError, SyntaxError, ValueError):  # the worker that imports it reports it, as before
                continue
            _write_pyc(state, code, source_stat, pyc)
    finally:
        if child == 0:
            os._exit(0)
    os.waitpid(child, 0)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # once, in the process that starts the xdist workers
        # Where PYTHONDONTWRITEBYTECODE is set, every `mklang` process a test starts would
        # compile the package anew: about 0.2 s of CPU each, hundreds of times a run.
        compileall.compile_dir(ROOT / "mklang", quiet=1)
        if getattr(config.option, "numprocesses", None):  # xdist's workers will import every test module
            _rewrite_test_modules_ahead(config)
    os.environ["XDG_CONFIG_HOME"] = _CONFIG_HOME
    os.environ["XDG_CACHE_HOME"] = os.path.join(_CONFIG_HOME, "cache")  # machine texts run from a store
    os.environ.pop("MKLANG_CHECKPOINT_KEY", None)
    if config.option.basetemp is None and os.access(MEMORY, os.W_OK):
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", MEMORY)  # where pytest makes its tmp_path folders


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: none without it (`-p no:xdist`)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than cores (ADR 0045). A third of the suite's wall time on two cores
    is spent waiting (processes starting and killed, servers answering, fixed waits), not computing."""
    return (os.cpu_count() or 1) + 1


# What a test's code names that shows what it needs, for the markers of pyproject.toml.
NEEDS_SERVICES = {"require_server", "require_postgres", "postgres_schema", "postgres_uri", "RABBITMQ", "REDIS"}
KILLS = {"MKLANG_KILL_AT", "kill", "SIGKILL", "SIGINT", "SIGTERM", "send_signal"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `services` the tests that need PostgreSQL, RabbitMQ or Redis and `crash` those that kill a process
    (and the crash modules), from the names their code uses, so a new test is marked as it is written."""
    for item in items:
        code = getattr(getattr(item, "function", None), "__code__", None)
        used = set(getattr(item, "fixturenames", ()))
        if code is not None:  # the globals and attributes it names, and its keyword argument names
            used |= set(code.co_names) | {
                name for names in code.co_consts if isinstance(names, tuple) for name in names
            }
        if used & NEEDS_SERVICES or "postgres" in getattr(getattr(item, "callspec", None), "id", ""):
            item.add_marker("services")
        if used & KILLS or "crash" in item.path.name:
            item.add_marker("crash")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CONFIG_HOME, ignore_errors=True)


SCHEMA_PATH = ROOT / "docs" / "checkpoint.schema.json"
SCHEMA_VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
NOT_CHECKPOINTS = {".journal", ".lock", ".mk", ".mkl", ".yaml", ".yml", ".toml", ".py", ".txt", ".log"}


def schema_violations(document: Any) -> list[str]:
    """Each way `document` breaks the checkpoint schema, as `path: message`."""
    return [
        f"{'/'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in SCHEMA_VALIDATOR.iter_errors(document)
    ]


def _documents_in_current_format(folder: Path) -> Iterator[tuple[Path, Any]]:
    """Files under `folder` holding a JSON object in the current checkpoint format, with that object
    (older formats are migrated on load, not described)."""
    for path in sorted(folder.rglob("*")):
        if path.suffix in NOT_CHECKPOINTS or path.is_symlink() or not path.is_file():
            continue
        raw = path.read_bytes()
        if not raw.startswith(b"{"):
            continue
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than any checkpoint mklang loads
            continue
        if isinstance(document, dict) and document.get("format") == FORMAT:
            yield path, document


def _loads_as_a_checkpoint(path: Path) -> bool:
    """Whether mklang itself loads `path` as a checkpoint: a file it refuses is not one (nor a run
    name), or one a test broke on purpose."""
    try:
        load(path)
    except MklangError:
        return False
    return True


@pytest.fixture(autouse=True)
def no_power_cuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests kill processes but never cut the power, so what fsync adds to a write is invisible to them:
    in the test process it returns at once (a test that counts fsyncs still sees each call)."""
    monkeypatch.setattr(os, "fsync", lambda descriptor: None)


@pytest.fixture(autouse=True)
def mklang_logger_restored() -> Iterator[None]:
    """A `mklang worker` run in process sends the `mklang` logger's run lines to stderr (`log_runs`);
    later tests in the process must not see them."""
    logger = logging.getLogger("mklang")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture(scope="session")
def state_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state", numbered=False)


@pytest.fixture(autouse=True)
def own_state_folder(state_folders: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test remembers run generations of its own (ADR 0022): tests reuse run ids such as "r".
    Made beside each other with mkdtemp: a numbered `mktemp` lists every folder made before it, a
    cost that grew with each test a worker ran (a second of CPU per worker over the suite)."""
    monkeypatch.setenv("XDG_STATE_HOME", tempfile.mkdtemp(dir=state_folders))


@pytest.fixture(autouse=True)
def checkpoints_match_the_schema(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    found: list[str] = []
    folder = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None

    def check(document: Any) -> None:
        found.extend(f"serialized envelope: {problem}" for problem in schema_violations(document))

    def model_dump(self: Envelope, *args: Any, **kwargs: Any) -> Any:
        document = dump_python(self, *args, **kwargs)
        if kwargs.get("mode") == "json" and not kwargs.get("exclude") and not kwargs.get("include"):
            check(document)
        return document

    def model_dump_json(self: Envelope, *args: Any, **kwargs: Any) -> str:
        text = dump_json(self, *args, **kwargs)
        if not kwargs.get("exclude") and not kwargs.get("include"):
            check(json.loads(text))
        return text

    dump_python, dump_json = Envelope.model_dump, Envelope.model_dump_json
    monkeypatch.setattr(Envelope, "model_dump", model_dump)
    monkeypatch.setattr(Envelope, "model_dump_json", model_dump_json)
    yield
    if folder is not None:
        for path, document in _documents_in_current_format(folder):
            problems = schema_violations(document)  # the load that tells a checkpoint, only for those rejected
            if problems and _loads_as_a_checkpoint(path):
                found.extend(f"{path.name}: {problem}" for problem in problems)
    if found:
        pytest.fail("checkpoints that docs/checkpoint.schema.json rejects:\n" + "\n".join(found[:20]), pytrace=False)


@pytest.fixture
def postgres_uri() -> Iterator[str]:
    with postgres_schema() as uri:
        yield uri


@pytest.fixture
def server() -> Iterator[FakeServer]:
    """A fake model server on a free port (files that script their own replies define their own)."""
    with FakeServer() as running:
        yield running


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The random order's seed, last, so a failure that depends on the order can be replayed."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(f"random order seed {seed}; replay it with -p randomly --randomly-seed={seed}")
