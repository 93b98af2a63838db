"""The answers a running run's model is writing, on the console's run page (ADR 0070): a run in a
process of its own streams its produce calls only while a page watches it, the page reads the
answer so far from a signed note of the store, and notes nobody this user trusts wrote count for
nothing. Against `mklang serve` and `mklang run` as processes and a model server that streams."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from urllib.request import HTTPCookieProcessor, build_opener

import pytest
from support.commands import cli_env, model_config
from support.console import serving
from support.fakeserver import answer

from mklang.runs import live
from mklang.stores import Location, locate

ANSWER = "one two three four five six seven eight nine ten"
WAITS = """\
mklang 0.4
machine waits
entry wait
budget 4
result text

tool hold read_only "Wait until the test lets the run go on."

state wait {
  tool hold {}
  output held
  otherwise -> write
}

state write {
  structure "The words of the numbers, in one line."
  prompt "Count to ten."
  output text
  otherwise -> END
}
"""
HOLD = """\
import os, time
from pathlib import Path


def hold(args):
    go = Path(os.environ["MKLANG_TEST_GO"])
    for _ in range(600):
        if go.exists():
            return "go"
        time.sleep(0.05)
    raise RuntimeError("never let go")


TOOLS = {"hold": hold}
"""


@pytest.fixture
def folder(tmp_path: Path, server) -> Path:
    """A folder with the machine, its host (the counting server answers slowly when asked to
    stream) and a folder store `runs`."""
    (tmp_path / "waits.mk").write_text(WAITS)
    (tmp_path / "tools.py").write_text(HOLD)
    model_config(server.openai_url, tmp_path / "mklang.toml")
    server.handler = lambda request: answer(ANSWER, stream_pause=0.4)
    (tmp_path / "runs").mkdir()
    return tmp_path


def _start_run(folder: Path, run: str) -> subprocess.Popen[str]:
    """`mklang run` of the machine into `runs/RUN`, held in its tool state until `go_<run>` exists."""
    env = {**cli_env(), "MKLANG_TEST_GO": str(folder / f"go_{run}")}
    command = [sys.executable, "-m", "mklang", "run", "waits.mk", "--checkpoint", f"runs/{run}"]
    command += ["--config", "mklang.toml", "--plugin", "tools.py", "--format", "json"]
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(400):  # the run is in the store once its first snapshot is written
        if (folder / "runs" / run).exists() or process.poll() is not None:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()
    return process


def _finish(process: subprocess.Popen[str]) -> dict:
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return json.loads(out)


@pytest.fixture
def console(folder: Path) -> Iterator[str]:
    """`mklang serve` over the folder store on a free port: its URL with the token."""
    pytest.importorskip("starlette", reason="the console extra is not installed")
    with serving(folder, "runs") as url:
        yield url


def _follow(url: str, run: str, seen: list[dict], stop: threading.Event) -> None:
    """Read the run page's answer stream, each `answers` event's data into `seen`, until `stop`."""
    base, token = url.split("/?token=")
    opener = build_opener(HTTPCookieProcessor(CookieJar()))  # the token's redirect sets the console's cookie
    with opener.open(f"{base}/runs/{run}/answers?token={token}", timeout=30) as stream:
        event = None
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: ") and event == "answers":
                seen.append(json.loads(line[len("data: ") :]))
            if stop.is_set():
                return


def _wait_for_watch(folder: Path, run: str) -> None:
    """Until the page's stream has asked `run` to stream: the store's watch note names it."""
    store = locate(folder / "runs" / run).store
    for _ in range(200):
        if run in live._watched(store):
            return
        time.sleep(0.05)
    raise AssertionError(f"no page watches {run}")


def test_a_watched_run_streams_its_answer_to_the_run_page_as_the_model_writes_it(folder, console, server):
    process = _start_run(folder, "counting")
    seen: list[dict] = []
    stop = threading.Event()
    reader = threading.Thread(target=_follow, args=(console, "counting", seen, stop), daemon=True)
    reader.start()
    for _ in range(100):  # the page has asked the run to stream: its watch note is in the store
        if seen:
            break
        time.sleep(0.05)
    assert seen and seen[0] == {"calls": []}  # nothing is being written yet: the run waits in its tool
    (folder / "go_counting").touch()
    result = _finish(process)
    time.sleep(1.0)  # the page's next looks see the call ended
    stop.set()
    assert result["result"] == ANSWER
    (request,) = server.requests
    assert request.body.get("stream") is True  # watched: the provider streamed the call
    partial = [call["text"] for shown in seen for call in shown["calls"]]
    assert partial, seen
    assert all(ANSWER.startswith(text) for text in partial)
    assert any(0 < len(text) < len(ANSWER) for text in partial)  # shown while it was still being written
    assert seen[-1] == {"calls": []}  # and gone once the call ended: the page shows the step from the store
    assert live.read(locate(folder / "runs" / "counting").store, "counting") is None  # the run dropped its note


@pytest.mark.slow
def test_the_run_page_in_a_browser_shows_the_answer_as_it_is_written_then_the_step(browser, folder, console):
    from playwright.sync_api import expect

    process = _start_run(folder, "shown")
    page = browser.new_context().new_page()
    page.goto(console)
    base = console.split("/?", 1)[0]
    page.goto(f"{base}/runs/shown")
    answering = page.locator("section.answering")
    expect(answering).to_be_hidden()  # nothing is being written: the run waits in its tool
    _wait_for_watch(folder, "shown")
    (folder / "go_shown").touch()
    expect(answering.locator("pre.answer")).to_contain_text("one two three", timeout=10_000)
    written = answering.locator("pre.answer").inner_text()
    assert ANSWER.startswith(written) and written != ANSWER  # shown while the model was still writing
    assert _finish(process)["result"] == ANSWER
    expect(answering).to_be_hidden(timeout=10_000)
    expect(page.locator(".summary .status")).to_have_text("done", timeout=10_000)
    expect(page.locator(".summary")).to_contain_text(ANSWER)


def test_a_run_nobody_watches_does_not_stream(folder, server):
    process = _start_run(folder, "alone")
    (folder / "go_alone").touch()
    assert _finish(process)["result"] == ANSWER
    (request,) = server.requests
    assert not request.body.get("stream")


@pytest.fixture(params=["file", "sqlite", "postgres"])
def place(request, tmp_path: Path) -> Iterator[Callable[[str], Location]]:
    """What opens run RUN of one store (a folder, SQLite, a fresh PostgreSQL schema), each call
    with a store object of its own, as two processes have."""
    uri = {"file": None, "sqlite": f"sqlite:///{tmp_path}/runs.db"}.get(request.param)
    if request.param == "postgres":
        uri = request.getfixturevalue("postgres_uri")
    opened: list[Location] = []

    def at(run: str) -> Location:
        opened.append(locate(tmp_path / run if uri is None else f"{uri}#{run}"))
        return opened[-1]

    yield at
    for location in opened:
        location.store.close()


def test_a_watch_note_not_signed_with_the_checkpoint_key_watches_nothing(place):
    forged = {"runs": {"x": time.time() + 3600}}
    place("x").store.write_note(live.WATCHING, json.dumps(forged).encode())
    assert live.LiveAnswers(place("x")).deltas("k") is None  # forged (or another fleet's): not streamed
    live.watch(place("x").store, "x")
    assert live.LiveAnswers(place("x")).deltas("k") is not None
    assert live.LiveAnswers(place("y")).deltas("k") is None  # the note names the runs watched


def test_the_runs_of_a_process_on_one_store_share_one_look_a_second_at_the_watch_note(place, monkeypatch):
    location = place("x")
    store = location.store
    live.watch(store, "x")
    reads: list[str] = []
    read_note = store.read_note
    monkeypatch.setattr(store, "read_note", lambda key: reads.append(key) or read_note(key))
    runs = [live.LiveAnswers(location) for _ in range(50)]  # a batch's runs, each at its produce call
    assert all(run.deltas("k") is not None for run in runs)
    assert reads == [live.WATCHING]
    time.sleep(live.LOOK_EVERY)
    assert runs[0].deltas("k") is not None and reads == [live.WATCHING] * 2


def test_the_answers_so_far_are_a_signed_note_kept_until_the_call_ends(place):
    location = place("x")
    store = location.store
    live.watch(store, "x")
    answers = live.LiveAnswers(location)
    tell = answers.deltas("1/produce")
    assert tell is not None
    tell(0, "Hel")
    assert live.read(store, "x") == {
        "calls": [{"key": "1/produce", "text": "Hel"}],
        "written": pytest.approx(time.time(), abs=5),
    }
    tell(3, "lo")  # within a quarter second of the last write: kept, not written yet
    assert live.read(store, "x")["calls"][0]["text"] == "Hel"
    time.sleep(live.WRITE_EVERY)
    tell(5, " there")
    assert live.read(store, "x")["calls"][0]["text"] == "Hello there"
    time.sleep(live.WRITE_EVERY)
    tell(0, "Again")  # a cut stream, retried: its answer starts over
    assert live.read(store, "x")["calls"][0]["text"] == "Again"
    answers.ended("1/produce")
    assert live.read(store, "x")["calls"] == []
    raw = store.read_note(live.live_key("x"))
    assert raw is not None and b'"calls":[]' in raw
    store.write_note(live.live_key("x"), raw.replace(b'"calls":[]', b'"calls":[{"key":"k","text":"<b>forged</b>"}]'))
    assert live.read(store, "x") is None  # changed after it was signed: nothing is shown
    answers.close()
    assert store.read_note(live.live_key("x")) is None


def test_pages_watching_runs_at_once_keep_each_others_runs(place):
    store = place("x").store
    pages = [threading.Thread(target=live.watch, args=(store, f"run{n}")) for n in range(8)]
    for page in pages:
        page.start()
    for page in pages:
        page.join()
    assert set(live._watched(store)) == {f"run{n}" for n in range(8)}
