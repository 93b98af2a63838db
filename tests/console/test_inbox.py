"""The console's inbox and runs list over many parked runs, at the HTTP level: cards from the
store's summaries (no envelope read), grouped, paged and filtered; answers bound to each run's
question and the digest of the value its card showed, one or many at once, each under its own
lock; and what is refused: a form without the CSRF token, a forged run name, a question no longer
pending, a card whose summary was tampered with (the browser: test_console_browser.py)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from support.console import park_many

pytest.importorskip("starlette", reason="the console extra is not installed")
from starlette.testclient import TestClient

from mklang.checkpoint.envelope import load
from mklang.console import reading
from mklang.console.web import Console, create_app
from mklang.stores import RunQuery, RunSummary, locate, open_store

TOKEN = "the-token"
RUNS = 40


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store of 40 runs parked on the approval decision, made once (each test gets a copy)."""
    tmp_path = tmp_path_factory.mktemp("inbox")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        park_many(tmp_path, RUNS)
    return tmp_path


@pytest.fixture
def store(stored: Path, tmp_path: Path) -> str:
    shutil.copytree(stored, tmp_path, dirs_exist_ok=True)
    return f"sqlite:///{tmp_path}/parked.db"


@pytest.fixture
def console(store: str):
    opened = open_store(store, create=False)
    yield Console(opened, store, TOKEN, interval=0.05)
    opened.close()


@pytest.fixture
def client(console: Console):
    with TestClient(create_app(console), follow_redirects=False) as browser:
        assert browser.get(f"/?token={TOKEN}").status_code == 303
        yield browser


def card_of(client: TestClient, run: str) -> str:
    """The inbox page that shows `run`'s card: its machine's (every other run's is `approval-1`)."""
    return client.get(f"/inbox?machine=approval{'-1' * (int(run[-4:]) % 2)}").text


def binding(page: str, run: str) -> str:
    """The `pick` a card of `run` posts (its run, question id and digest), as the page wrote it."""
    start = page.index(f'name="pick" value="{run} ')
    return page[start:].split('value="', 1)[1].split('"', 1)[0]


def status_of(store: str, run: str) -> str:
    return load(locate(f"{store}#{run}")).status


def test_the_inbox_lists_cards_from_summaries_grouped_paged_and_filtered(client, console):
    reads: list[str] = []
    read = console.store.read
    console.store.read = lambda run: reads.append(run) or read(run)
    page = client.get("/inbox").text
    assert reads == []  # every card came from the store's summaries
    assert f"{RUNS} waiting" in page and page.count('class="question-card') == reading.INBOX_PAGE
    assert "Maintenance on Saturday\nOn Saturday from 02:00" in page  # the value shown as text, not JSON
    assert "\\n" not in page.split("<main>", 1)[1]
    assert '<button type="submit" name="choice" value="approve">' in page and "1d 23h left" in page
    assert page.count('<section class="question-group">') == 2  # approval and approval-1, in order
    assert 'href="/inbox?page=2"' in page and "select all" in page
    second = client.get("/inbox?page=2").text
    assert second.count('class="question-card') == RUNS - reading.INBOX_PAGE
    only = client.get("/inbox?machine=approval-1").text
    assert f"{RUNS // 2} waiting" in only and "parked-0000" not in only and "parked-0001" in only
    assert "Nothing waits" in client.get("/inbox?due=1h").text  # due in 48h, not within the hour
    assert "Nothing waits" in client.get("/inbox?older=1h").text  # parked just now
    assert f"{RUNS} waiting" in client.get("/inbox?due=3d&older=0s").text
    assert "&#39;soon&#39; is not a duration" in client.get("/inbox?due=soon").text


def test_a_bulk_answer_resumes_each_run_picked_under_its_own_lock(client, console, store):
    page = card_of(client, "parked-0000")
    picked = ["parked-0000", "parked-0002", "parked-0004"]
    form = {"csrf": console.csrf, "choice": "approve", "note": "ship", "pick": [binding(page, run) for run in picked]}
    answer = client.post("/inbox/answer", data=form)
    assert answer.status_code == 200 and answer.text.count("taken; the run goes on") == 3
    console.replies.wait(timeout=60)
    assert console.replies.failures == {}
    for run in picked:
        done = load(locate(f"{store}#{run}"))
        assert (done.status, done.result) == ("done", "https://status.example.com/posts/118")
        assert done.frames[0]["context"]["approval"] == {"choice": "approve", "note": "ship"}
    assert status_of(store, "parked-0006") == "suspended"  # not picked: left alone
    assert f"{RUNS - 3} waiting" in client.get("/inbox").text


def test_an_answer_without_the_csrf_token_is_refused_and_changes_nothing(client, console, store):
    page = card_of(client, "parked-0000")
    for token in ("", "forged"):
        form = {"csrf": token, "choice": "approve", "pick": binding(page, "parked-0000")}
        answer = client.post("/inbox/answer", data=form)
        assert answer.status_code == 403 and "CSRF" in answer.text
    console.replies.wait(timeout=30)
    assert status_of(store, "parked-0000") == "suspended"


@pytest.mark.parametrize(
    "pick",
    ["../parked-0000 0123456789abcdef -", "parked-0000", "parked-0000 not-hex -", "parked-0000 0123 <script>"],
)
def test_a_forged_pick_is_refused_before_any_run_is_looked_at(client, console, store, pick):
    answer = client.post("/inbox/answer", data={"csrf": console.csrf, "choice": "approve", "pick": pick})
    assert answer.status_code == 400 and "names no run" in answer.text
    assert status_of(store, "parked-0000") == "suspended"


def test_an_answer_to_a_run_the_store_does_not_hold_is_refused(client, console):
    form = {"csrf": console.csrf, "choice": "approve", "pick": "no-such-run 0123456789abcdef -"}
    answer = client.post("/inbox/answer", data=form)
    assert answer.status_code == 409 and "refused: " in answer.text and "no such checkpoint" in answer.text


def test_an_answer_to_a_question_no_longer_pending_is_refused_saying_so(client, console, store):
    page = card_of(client, "parked-0001")
    form = {"csrf": console.csrf, "choice": "reject", "pick": binding(page, "parked-0001")}
    first = client.post("/inbox/answer", data=form)
    assert first.status_code == 303 and first.headers["location"] == "/runs/parked-0001"
    console.replies.wait(timeout=30)
    assert status_of(store, "parked-0001") == "halted"
    again = client.post("/inbox/answer", data={**form, "choice": "approve"})  # the same card, answered twice
    assert again.status_code == 409
    assert "#parked-0001: the run already halted (gate-fail); a finished run cannot be resumed" in again.text
    assert status_of(store, "parked-0001") == "halted"
    other = binding(page, "parked-0003").split(" ")  # a card bound to another run's question
    stale = {**form, "pick": f"parked-0011 {other[1]} {other[2]}"}
    refused = client.post("/inbox/answer", data=stale)
    assert refused.status_code == 409 and f"question {other[1]} was never asked by this run" in refused.text
    assert status_of(store, "parked-0011") == "suspended"


def test_a_choice_that_is_not_offered_is_refused_listing_the_choices(client, console, store):
    page = card_of(client, "parked-0003")
    form = {"csrf": console.csrf, "choice": "maybe", "pick": binding(page, "parked-0003")}
    answer = client.post("/inbox/answer", data=form)
    assert answer.status_code == 409 and "approve, revise, reject" in answer.text
    assert status_of(store, "parked-0003") == "suspended"


def test_a_card_whose_summary_was_tampered_with_cannot_approve_what_it_shows(client, console, store, tmp_path):
    """The summary is display only: someone who can write the store's summaries can make a card show
    another text, but an answer made on it is bound to that text's digest, which the signed
    question does not have."""
    with sqlite3.connect(tmp_path / "parked.db") as db:
        (asks,) = db.execute("SELECT asks FROM mklang_runs WHERE run = 'parked-0005'").fetchone()
        forged = {**json.loads(asks), "shown": "Everything is fine, nothing to see."}
        db.execute("UPDATE mklang_runs SET asks = ? WHERE run = 'parked-0005'", (json.dumps(forged),))
    page = card_of(client, "parked-0005")
    assert "Everything is fine, nothing to see." in page
    form = {"csrf": console.csrf, "choice": "approve", "pick": binding(page, "parked-0005")}
    answer = client.post("/inbox/answer", data=form)
    assert answer.status_code == 409 and "made on a value that is not the one it shows" in answer.text
    console.replies.wait(timeout=30)
    assert status_of(store, "parked-0005") == "suspended"


def test_the_run_page_of_a_parked_run_answers_it_with_the_whole_value_from_its_envelope(client, console, store):
    page = client.get("/runs/parked-0007").text
    assert "(notice 7)" in page and 'value="revise"' in page
    form = {"csrf": console.csrf, "choice": "approve", "pick": binding(page, "parked-0007")}
    assert client.post("/inbox/answer", data=form).status_code == 303
    console.replies.wait(timeout=30)
    assert status_of(store, "parked-0007") == "done"


def test_the_runs_list_filters_counts_and_flags_runs_over_budget(client, console):
    spent = RunSummary(
        "parked-0009", machine="approval-1", status="halted", reason="cost-exhausted", cost_usd=0.25,
        budget_cost=0.2, over_budget=True,
    )  # fmt: skip
    console.store.summarize("parked-0009", spent)
    page = client.get("/").text
    assert f"{RUNS} runs" in page and "1 over budget" in page and 'class="over-budget"' in page
    assert "$0.2500 / $0.2000" in page
    halted = client.get("/?status=halted").text
    assert "parked-0009" in halted and "parked-0008" not in halted
    assert "parked-0009" in client.get("/?over=1").text and "parked-0008" not in client.get("/?over=1").text
    found = client.get("/?q=PARKED-001").text  # a search of run names and questions, in any case
    assert "parked-0010" in found and "parked-0019" in found and "parked-0020" not in found
    assert f"{RUNS - 1} runs" in client.get("/?q=publish this").text  # the question, not the halted one
    assert "parked-0001" in client.get("/?machine=approval-1").text
    assert "parked-0000" not in client.get("/?machine=approval-1").text
    assert "No run matches" in client.get("/?since=0s&machine=nobody").text
    assert "&#39;yesterday&#39; is not a duration" in client.get("/?since=yesterday").text
    assert 'href="/?page=2&amp;status=suspended"' not in client.get("/?status=suspended").text  # 39 fit a page


def test_a_store_counts_and_filters_summaries_as_python_does(tmp_path):
    """The SQL of a query (`stores.sql`) keeps and counts what `RunQuery.keeps` and `tally` do."""
    summaries = [
        RunSummary("a-1", machine="m", status="suspended", reason="Publish?", deadline=10.0, updated=5.0, cost_usd=1),
        RunSummary("b_2", machine="m", status="suspended", reason="Publish?", deadline=None, updated=6.0),
        RunSummary("c%3", machine="n", status="done", reason=None, updated=7.0, over_budget=True, tokens=4),
    ]
    queries = [
        RunQuery(),
        RunQuery(search="_"),
        RunQuery(search="%"),
        RunQuery(search="publish"),
        RunQuery(due_by=10.0),
        RunQuery(until=6.0),
        RunQuery(over_budget=True),
        RunQuery(reason="Publish?", order="question"),
    ]
    from mklang.stores.sqlite import SqliteStore

    sql = SqliteStore(tmp_path / "s.db")
    try:
        for summary in summaries:
            sql.write(summary.run, b"{}", generation=1)
            sql.summarize(summary.run, summary)
        with sqlite3.connect(tmp_path / "s.db") as db:  # the times the summaries say, not now
            for summary in summaries:
                db.execute("UPDATE mklang_runs SET updated = ? WHERE run = ?", (summary.updated, summary.run))
        listed = sql.summaries(RunQuery())
        assert len(listed) == 3
        for query in queries:
            want = [s.run for s in query.page(listed)]
            assert [s.run for s in sql.summaries(query)] == want, query
            assert sql.tally(query, ("status",)) == query.tally(listed, ("status",)), query
    finally:
        sql.close()
