"""The web console (`mklang serve`) in process: its token, CSRF and escaping, its pages, and an
inbox reply that resumes a parked run to its end (the real browser: test_console_browser.py)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support.commands import cli
from support.console import SCRIPT_OUTPUT, make_runs
from support.examples import EXAMPLES, HITL

pytest.importorskip("starlette", reason="the console extra is not installed")
from starlette.testclient import TestClient

from mklang.checkpoint.envelope import load
from mklang.console import reading
from mklang.console.events import Change, StorePoller
from mklang.console.web import Console, create_app
from mklang.host.settings import given
from mklang.stores import locate, open_store

TOKEN = "the-token"


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a SQLite store holding a parked approval run `ask` and a finished run `echo`
    whose output is a script (made once; each test gets a copy)."""
    tmp_path = tmp_path_factory.mktemp("console")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        make_runs(tmp_path)
    return tmp_path


@pytest.fixture
def store(stored: Path, tmp_path: Path) -> str:
    shutil.copytree(stored, tmp_path, dirs_exist_ok=True)
    return f"sqlite:///{tmp_path}/runs.db"


@pytest.fixture
def console(store: str):
    opened = open_store(store, create=False)
    yield Console(opened, store, TOKEN, interval=0.05)
    opened.close()


@pytest.fixture
def client(console: Console):
    with TestClient(create_app(console), follow_redirects=False) as browser:
        yield browser


def signed_in(client: TestClient) -> TestClient:
    assert client.get(f"/?token={TOKEN}").status_code == 303
    return client


@pytest.mark.parametrize("path", ["/", "/inbox", "/runs/ask", "/events", "/static/console.js", "/?token=wrong"])
def test_every_request_without_the_token_is_refused(client, path):
    answer = client.get(path)
    assert answer.status_code == 401
    assert "token" in answer.text and "ask" not in answer.text


def test_the_token_moves_into_a_strict_http_only_cookie(client):
    answer = client.get(f"/inbox?token={TOKEN}")
    assert answer.status_code == 303 and answer.headers["location"].endswith("/inbox")  # out of the address bar
    cookie = answer.headers["set-cookie"].lower()
    assert TOKEN in answer.headers["set-cookie"] and "httponly" in cookie and "samesite=strict" in cookie
    assert client.get("/inbox").status_code == 200


@pytest.mark.parametrize("path", ["/", "/runs/echo", "/nothing-here"])
def test_every_answer_carries_the_security_headers(client, path):
    for answer in (client.get(path), signed_in(client).get(path)):
        policy = answer.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "unsafe-inline" not in policy
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_a_model_output_holding_a_script_shows_as_text(client):
    page = signed_in(client).get("/runs/echo")
    assert page.status_code == 200
    assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;" in page.text
    assert SCRIPT_OUTPUT not in page.text
    assert "<script" not in page.text.replace('<script src="/static/console.js" defer></script>', "")


def test_the_runs_list_shows_every_run_newest_first(client, monkeypatch):
    page = signed_in(client).get("/").text
    assert page.index('href="/runs/echo"') < page.index('href="/runs/ask"')
    assert "Publish this announcement?" in page and "approval" in page and "suspended" in page
    monkeypatch.setattr(reading, "PAGE", 1)
    second = client.get("/?page=2&fragment=1").text
    assert 'href="/runs/ask"' in second and 'href="/runs/echo"' not in second and "<html" not in second
    assert 'rel="next"' in client.get("/?fragment=1").text  # older runs follow the first page
    assert 'rel="prev"' in second and 'rel="next"' not in second  # and none the last


def test_a_run_page_shows_budgets_the_trace_and_the_graph(client):
    page = signed_in(client).get("/runs/ask").text
    assert "Publish this announcement?" in page and "approval.answer" in page
    assert "steps of approval" in page and "draft" in page and "escalate" in page
    assert '<img class="graph" src="/runs/ask/graph.svg?steps=1"' in page
    assert client.get("/runs/no-such-run").status_code == 404


def test_only_a_run_that_may_still_run_follows_the_answers_being_written(client):
    parked, finished = signed_in(client).get("/runs/ask").text, client.get("/runs/echo").text
    assert 'data-answers="/runs/ask/answers"' in parked  # it may resume: its page asks for its answers
    assert "data-answers" not in finished  # done: nothing more is written, the page watches nothing


def test_the_graph_is_an_svg_drawn_without_graphviz_with_the_path_taken(client, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    answer = signed_in(client).get("/runs/ask/graph.svg")
    assert answer.headers["content-type"] == "image/svg+xml"
    svg = "{http://www.w3.org/2000/svg}"
    groups = list(ET.fromstring(answer.text).iter(f"{svg}g"))
    visited = {g.findtext(f"{svg}title") for g in groups if "visited" in g.attrib["class"].split()}
    taken = {g.findtext(f"{svg}title") for g in groups if "taken" in g.attrib["class"].split()}
    assert visited == {"draft"} and taken == {"start → draft", "draft → decide"}
    assert client.get("/runs/no-such-run/graph.svg").status_code == 404


def test_a_reply_without_the_forms_csrf_token_is_refused(client, console, store):
    signed_in(client)
    for form in ({"reply": "yes"}, {"reply": "yes", "csrf": "forged"}):
        assert client.post("/inbox/ask", data=form).status_code == 403
    assert load(locate(f"{store}#ask")).status == "suspended"


def test_an_inbox_reply_resumes_the_run_to_its_end(client, console, store):
    inbox = signed_in(client).get("/inbox").text
    assert "Publish this announcement?" in inbox and "Maintenance on Saturday" in inbox  # the ask and its context
    assert 'name="csrf" value="' + console.csrf in inbox and "/inbox/echo" not in inbox
    answer = client.post("/inbox/ask", data={"reply": "yes, ship it", "csrf": console.csrf})
    assert answer.status_code == 303 and answer.headers["location"] == "/runs/ask"
    console.replies.wait(timeout=30)
    assert console.replies.failures == {}
    done = load(locate(f"{store}#ask"))
    assert (done.status, done.result) == ("done", "https://status.example.com/posts/118")
    assert done.frames[0]["context"]["approval"]["answer"] == "yes, ship it"
    assert "approval" in done.frames[0]["tainted"]  # the reply is untrusted data, as with --set
    page = client.get("/runs/ask").text
    assert "https://status.example.com/posts/118" in page and "status-done" in page
    assert "Nothing waits for a reply." in client.get("/inbox").text
    again = client.post("/inbox/ask", data={"reply": "yes", "csrf": console.csrf})
    assert again.status_code == 409


def test_a_run_the_console_resumes_is_followed_by_its_events_not_by_looking_at_the_store(store):
    opened = open_store(store, create=False)
    console = Console(opened, store, TOKEN, interval=3600)  # the store is looked at once, on the first follow

    async def follow() -> list[Change]:
        changes = console.changes.follow(quiet=30)
        seen: list[Change] = []
        first = asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.1)  # following (the first look only notes what is there)
        await asyncio.to_thread(console.replies.reply, "ask", "approval.answer", "yes, ship it")
        seen.append(await asyncio.wait_for(first, 30))
        await asyncio.to_thread(console.replies.wait, 30)
        while True:  # what the run's thread told, in order
            try:
                seen.append(await asyncio.wait_for(anext(changes), 0.5))
            except TimeoutError:
                break
        await changes.aclose()
        await console.changes.stop()
        return seen

    try:
        seen = asyncio.run(follow())
    finally:
        opened.close()
    assert console.replies.failures == {}
    assert load(locate(f"{store}#ask")).status == "done"
    # each state the resumed run entered, its end, and the reply's own: told as they happened
    assert len(seen) >= 3 and set(seen) == {Change(frozenset({"ask"}))}


def test_the_store_poller_tells_followers_which_runs_changed(store):
    opened = open_store(store, create=False)
    poller = StorePoller(opened, 0.02)

    async def follow() -> Change:
        changes = poller.follow(quiet=5)
        first = asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.1)  # the poller has looked once
        opened.write("echo", opened.read("echo") or b"", generation=9)
        change = await asyncio.wait_for(first, 5)
        await changes.aclose()
        await poller.stop()
        return change

    try:
        assert asyncio.run(follow()) == Change(frozenset({"echo"}))
    finally:
        opened.close()


def test_serve_without_the_console_extra_says_how_to_install_it(tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name.startswith(("mklang.console", "starlette"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "starlette", None)
    done = cli("serve", "--store", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mklang: error: mklang serve needs the console extra (starlette is missing): pip install 'mklang[console]>=2'"
    ]


@pytest.mark.parametrize("kind", ["file", "postgresql"])
def test_the_pages_read_a_folder_and_a_postgresql_store_too(kind, tmp_path, request):
    make_runs(tmp_path)
    (tmp_path / "runs").mkdir()
    uri = str(tmp_path / "runs") if kind == "file" else request.getfixturevalue("postgres_uri")
    where = f"{uri}/ask" if kind == "file" else f"{uri}#ask"
    parked = cli(
        "run", "approval/approval.mk", "--script", "approval/fenced.yaml", "--scenario", "fenced",
        "--hitl", "--checkpoint", where, cwd=tmp_path,
    )  # fmt: skip
    assert parked.returncode == 3, parked.stderr
    opened = open_store(uri, create=False)
    try:
        # The host the console was started with answers the resumed run (a PostgreSQL run's relative
        # host files are relative to the folder the console runs in, not where the run started).
        hosting = given(script=tmp_path / "approval" / "fenced.yaml", scenario="fenced")
        console = Console(opened, uri, TOKEN, hosting)
        with TestClient(create_app(console), follow_redirects=False) as client:
            signed_in(client)
            assert 'href="/runs/ask"' in client.get("/").text
            assert "steps of approval" in client.get("/runs/ask").text
            assert "Publish this announcement?" in client.get("/inbox").text
            assert client.post("/inbox/ask", data={"reply": "yes", "csrf": console.csrf}).status_code == 303
            console.replies.wait(timeout=30)
            assert console.replies.failures == {}
            assert "status-done" in client.get("/runs/ask").text
    finally:
        opened.close()


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("0.0.0.0", True)])
def test_serve_prints_the_url_with_its_token_and_warns_when_it_listens_beyond_this_machine(
    host, warned, tmp_path, monkeypatch
):
    from mklang.console import server

    monkeypatch.setattr(server.Server, "run", lambda self, sockets: None)  # bound, then stops at once
    done = cli("serve", "--store", str(tmp_path), "--host", host, "--port", "0")
    assert done.returncode == 0, done.stderr
    url = re.fullmatch(
        rf"mklang console of {re.escape(str(tmp_path))}: http://127\.0\.0\.1:(\d+)/\?token=(\S+)\n", done.stdout
    )
    assert url and int(url.group(1)) > 0 and len(url.group(2)) >= 40
    if warned:
        assert done.stderr.startswith(f"mklang: warning: listening on 0.0.0.0:{url.group(1)}: anyone who can reach")
    else:
        assert done.stderr == ""


def test_serve_on_a_port_in_use_is_a_one_line_usage_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("serve", "--store", str(tmp_path), "--port", str(port))
    assert done.returncode == 2
    assert (
        done.stderr.startswith(f"mklang: error: cannot listen on 127.0.0.1:{port}: ") and done.stderr.count("\n") == 1
    )


def test_an_inbox_reply_to_a_decision_is_an_answer_refused_unless_it_is_a_choice(tmp_path):
    shutil.copytree(EXAMPLES / "approval", tmp_path / "approval")
    uri = f"sqlite:///{tmp_path}/decisions.db"
    parked = cli(
        "run", "approval/approval.mk", "--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish",
        "--checkpoint", f"{uri}#d", cwd=tmp_path,
    )  # fmt: skip
    assert parked.returncode == 3, parked.stderr
    opened = open_store(uri, create=False)
    try:
        console = Console(opened, uri, TOKEN, interval=0.05)
        shown = reading.run_view(opened, uri, "d")  # what the inbox tells a decision by
        assert shown["waiting"] and shown["question"]["choices"] == ["approve", "revise", "reject"]
        refused = console.replies.answer("d", {"choice": "maybe", "by": "human"})
        console.replies.wait(timeout=30)
        assert refused.verdict is not None and "'maybe' is not a choice of question" in refused.verdict
        assert "'maybe' is not a choice of question" in console.replies.failures["d"]
        assert load(locate(f"{uri}#d")).status == "suspended"
        console.replies.answer("d", {"choice": "approve", "by": "human"})
        console.replies.wait(timeout=30)
        assert console.replies.failures == {}
        done = load(locate(f"{uri}#d"))
        assert (done.status, done.result) == ("done", "https://status.example.com/posts/118")
        assert done.frames[0]["context"]["approval"] == {"choice": "approve"}
    finally:
        opened.close()


TWO_STEPS = """\
mklang 0.5
machine pair
entry one
budget 4
state one {
  structure "A line."
  prompt "Begin."
  output first
  otherwise -> two
}
state two {
  structure "A line."
  prompt "Go on from {{first}}."
  output second
  otherwise -> END
}
"""


def test_a_forked_runs_page_shows_its_parent_and_what_it_inherited(tmp_path: Path):
    """Lineage on the run page, as `show` prints it: the parent, the step, the inherited spend."""
    (tmp_path / "pair.mk").write_text(TWO_STEPS)
    (tmp_path / "pair.yaml").write_text(json.dumps(TIGHT_SCRIPT))
    uri = f"sqlite:///{tmp_path}/runs.db"
    script = ("--script", "pair.yaml", "--scenario", "s")
    assert cli("run", "pair.mk", *script, "--checkpoint", f"{uri}#source", cwd=tmp_path).returncode == 0
    forked = cli("fork", f"{uri}#source", "--at", "2", "--store", f"{uri}#forked", *script, cwd=tmp_path)
    assert forked.returncode == 0, forked.stderr
    shown = json.loads(cli("show", f"{uri}#forked", "--summary", "--format", "json", cwd=tmp_path).stdout)
    (ancestor,) = shown["lineage"]
    assert ancestor["migration"] is False and ancestor["step"] == "2"
    tokens = ancestor["inherited"]["input_tokens"] + ancestor["inherited"]["output_tokens"]
    opened = open_store(uri, create=False)
    try:
        with TestClient(create_app(Console(opened, uri, TOKEN)), follow_redirects=False) as browser:
            page = signed_in(browser).get("/runs/forked").text
            source_page = browser.get("/runs/source").text
    finally:
        opened.close()
    assert "<h2>Lineage</h2>" in page and f"(run <code>{ancestor['run_id']}</code>) at step 2" in page
    assert f"inherited {tokens} tokens, ${ancestor['inherited']['cost_usd']:.4f}" in page
    assert "<h2>Lineage</h2>" not in source_page  # a run of its own has none


def test_fork_from_here_previews_what_it_may_run_again_then_forks_behind_the_csrf_token(tmp_path: Path):
    """The run page's "fork from here": the preview `fork --dry-run` prints, before anything is paid
    or written; then a POST with the form's CSRF token makes the fork in the store and shows it."""
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    uri = f"sqlite:///{tmp_path}/runs.db"
    script = ("--script", "approval/scenarios.yaml", "--scenario", "approved-answer-given-up-front")
    ran = cli("run", "approval/approval.mk", *script, "--checkpoint", f"{uri}#src", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    source = load(locate(f"{uri}#src"))
    opened = open_store(uri, create=False)
    hosting = given(script=tmp_path / "approval" / "scenarios.yaml", scenario="approved-answer-given-up-front")
    console = Console(opened, uri, TOKEN, hosting)
    try:
        with TestClient(create_app(console), follow_redirects=False) as browser:
            page = signed_in(browser).get("/runs/src").text
            assert 'href="/runs/src/fork?at=2"' in page and "fork from here" in page
            preview = browser.get("/runs/src/fork?at=2")
            assert preview.status_code == 200 and "approval:publish (publish)" in preview.text
            assert f'name="csrf" value="{console.csrf}"' in preview.text and 'value="src-fork-2"' in preview.text
            assert sorted(opened.runs()) == ["src"]  # a preview writes nothing
            assert "the source&#39;s trace has 3 steps" in browser.get("/runs/src/fork?at=9").text
            form = {"at": "2", "name": "src-fork-2", "set": "approval.answer=Yes, ship it.\n"}
            for forged in ({}, {"csrf": "forged"}):
                assert browser.post("/runs/src/fork", data={**form, **forged}).status_code == 403
            assert sorted(opened.runs()) == ["src"]
            made = browser.post("/runs/src/fork", data={**form, "csrf": console.csrf})
            assert made.status_code == 303 and made.headers["location"] == "/runs/src-fork-2"
            console.replies.wait(timeout=30)
            assert console.replies.failures == {}
            fork_page = browser.get("/runs/src-fork-2").text
            assert "<h2>Lineage</h2>" in fork_page and f"(run <code>{source.run_id}</code>) at step 2" in fork_page
            again = browser.post("/runs/src/fork", data={**form, "csrf": console.csrf})
            assert again.status_code == 409 and "in this store already" in again.text
            late = browser.post("/runs/src/fork", data={**form, "name": "late", "at": "9", "csrf": console.csrf})
            assert late.status_code == 409 and "has 3 steps" in late.text and opened.read("late") is None
            assert browser.post("/runs/src/fork", data={**form, "at": "x", "csrf": console.csrf}).status_code == 400
    finally:
        opened.close()
    forked = load(locate(f"{uri}#src-fork-2"))
    assert (forked.status, forked.result) == ("done", "https://status.example.com/posts/118")
    assert [(a.run_id, a.step) for a in forked.lineage] == [(source.run_id, "2")]
    assert forked.frames[0]["context"]["approval"] == {"answer": "Yes, ship it."}
    assert "approval" in forked.frames[0]["tainted"]  # set by the form: untrusted data


TIGHT = """\
mklang 0.4
machine tight
entry first
budget 2
state first {
  structure "Any text."
  prompt "Say something."
  output said
  when "it is done" -> END
  otherwise -> first
}
"""
TIGHT_SCRIPT = {"scenarios": [{"name": "s", "llm": {"produce": ["a", "b", "c"], "judge": ["none", "none", 0]}}]}


def test_cancel_on_a_run_page_halts_a_parked_run_behind_the_csrf_token(client, console, store):
    page = signed_in(client).get("/runs/ask").text
    assert 'action="/runs/ask/cancel"' in page and "Cancel this run" in page
    assert 'action="/runs/echo/cancel"' not in client.get("/runs/echo").text  # a finished run has none
    before = load(locate(f"{store}#ask")).model_dump_json()
    for forged in ({}, {"csrf": "forged"}, {"csrf": console.csrf[:-1]}):
        assert client.post("/runs/ask/cancel", data=forged).status_code == 403
    assert load(locate(f"{store}#ask")).model_dump_json() == before  # a forged form changes nothing
    done = client.post("/runs/ask/cancel", data={"csrf": console.csrf})
    assert done.status_code == 303 and done.headers["location"] == "/runs/ask"
    stopped = load(locate(f"{store}#ask"))
    assert (stopped.status, stopped.error) == ("halted", "cancelled")
    assert [(acted.action, acted.by) for acted in stopped.actions] == [("cancel", "console")]
    page = client.get("/runs/ask").text
    assert "cancelled from the console at" in page and 'action="/runs/ask/cancel"' not in page
    again = client.post("/runs/ask/cancel", data={"csrf": console.csrf})
    assert again.status_code == 409 and "already halted (cancelled): not cancelled" in again.text
    replied = client.post("/inbox/ask", data={"reply": "yes", "csrf": console.csrf})
    assert replied.status_code == 409  # a cancelled run takes no reply
    assert load(locate(f"{store}#ask")).model_dump_json() == stopped.model_dump_json()


def test_a_run_parked_on_its_budget_resumes_with_raised_budgets_from_its_page(client, console, store):
    folder = Path(store.removeprefix("sqlite:///")).parent
    (folder / "tight.mk").write_text(TIGHT, encoding="utf-8")
    (folder / "tight.yaml").write_text(json.dumps(TIGHT_SCRIPT))
    parked = cli(
        "run", "tight.mk", "--script", "tight.yaml", "--scenario", "s", "--checkpoint", f"{store}#tight", cwd=folder
    )
    assert parked.returncode == 3, parked.stderr
    page = signed_in(client).get("/runs/tight").text
    assert 'action="/runs/tight/budget"' in page and 'placeholder="2"' in page
    assert 'action="/runs/ask/budget"' not in client.get("/runs/ask").text  # parked on a question, not a budget
    before = load(locate(f"{store}#tight")).model_dump_json()
    assert client.post("/runs/tight/budget", data={"budget": "5"}).status_code == 403
    for bad in ({"budget": "0"}, {"budget": "x"}, {"max_cost": "nan"}, {"max_cost": "inf"}, {}):
        assert client.post("/runs/tight/budget", data={**bad, "csrf": console.csrf}).status_code == 400, bad
    same = client.post("/runs/tight/budget", data={"budget": "2", "csrf": console.csrf})
    assert same.status_code == 409 and "no budget given is above the run&#39;s" in same.text
    question = client.post("/runs/ask/budget", data={"budget": "9", "csrf": console.csrf})
    assert question.status_code == 409 and "not parked on a budget (escalated)" in question.text
    assert load(locate(f"{store}#tight")).model_dump_json() == before
    raised = client.post("/runs/tight/budget", data={"budget": "5", "csrf": console.csrf})
    assert raised.status_code == 303 and raised.headers["location"] == "/runs/tight"
    console.replies.wait(timeout=30)
    assert "tight" not in console.replies.failures
    done = load(locate(f"{store}#tight"))
    assert (done.status, done.result) == ("done", "c")
    [acted] = done.actions
    assert (acted.action, acted.by, acted.budgets) == ("raise-budget", "console", {"budget": 5})
    assert "budgets raised from the console at" in client.get("/runs/tight").text


def test_a_run_the_console_is_running_is_cancelled_from_its_page_at_its_next_loop_top(client, console, store):
    """The console resumes a run with raised budgets in a thread of its own; its page's cancel finds
    the lock held by that thread, asks the run to stop, and the run halts `cancelled` at a loop-top."""
    folder = Path(store.removeprefix("sqlite:///")).parent
    (folder / "tight.mk").write_text(TIGHT, encoding="utf-8")
    slow = {"scenarios": [{"name": "s", "llm": {"delay_ms": 20, "produce": ["a"], "judge": ["none"]}}]}
    (folder / "slow.yaml").write_text(json.dumps(slow))
    parked = cli(
        "run", "tight.mk", "--script", "slow.yaml", "--scenario", "s", "--checkpoint", f"{store}#spin", cwd=folder
    )
    assert parked.returncode == 3, parked.stderr
    signed_in(client)
    raised = client.post("/runs/spin/budget", data={"budget": "100000", "csrf": console.csrf})
    assert raised.status_code == 303
    opened = open_store(store, create=False)
    try:
        for _ in range(300):
            if b'"status":"running"' in (opened.read("spin") or b"") or console.replies.failures:
                break
            time.sleep(0.01)
    finally:
        opened.close()
    assert "spin" not in console.replies.failures
    assert "Cancelling a running run stops it at its next loop-top" in client.get("/runs/spin").text
    cancelled = client.post("/runs/spin/cancel", data={"csrf": console.csrf})
    assert cancelled.status_code == 303
    console.replies.wait(timeout=30)
    stopped = load(locate(f"{store}#spin"))
    assert (stopped.status, stopped.error) == ("halted", "cancelled")
    assert [(acted.action, acted.by) for acted in stopped.actions] == [
        ("raise-budget", "console"),
        ("cancel", "console"),
    ]
    assert 2 < stopped.frames[0]["steps"] < 100000
