"""The web console in a real browser: `mklang serve` as a process, the system's Chromium driven by
Playwright. Opened with its token, the console shows a parked run in the inbox; a reply resumes it
and the page sees it finish; "fork from here" previews what the fork may run again, then forks it; a model output holding `<script>` shows as text; the runs list follows
a new run live; a request without the token gets 401."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.commands import cli, cli_env
from support.console import serving

pytestmark = pytest.mark.slow


@pytest.fixture
def console_url(tmp_path: Path) -> Iterator[str]:
    """`mklang serve` on a free port of 127.0.0.1 over a store with a parked and a finished run, with
    no program on its PATH (no Graphviz: the console draws graphs itself)."""
    pytest.importorskip("starlette", reason="the console extra is not installed")
    from support.console import make_runs

    make_runs(tmp_path)
    host = ("--script", "approval/fenced.yaml", "--scenario", "fenced")  # the host of what it resumes and forks
    env = cli_env(PATH=str(tmp_path / "no-programs"))
    with serving(tmp_path, f"sqlite:///{tmp_path}/runs.db", *host, env=env) as url:
        yield url


def test_the_console_in_a_browser(browser, console_url, tmp_path):
    from playwright.sync_api import expect

    base = console_url.split("/?", 1)[0]
    context = browser.new_context()
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))

    page.goto(console_url)
    assert "token" not in page.url  # moved into the cookie
    expect(page.locator("table.runs")).to_contain_text("Publish this announcement?")

    page.goto(f"{base}/runs/echo")
    expect(page.locator("ol.trace pre.value").first).to_have_text("<script>alert('owned')</script>")
    assert dialogs == []

    page.goto(f"{base}/inbox")
    card = page.locator("article.question-card")
    expect(card).to_contain_text("Publish this announcement? Answer yes, or say what to change.")
    card.locator("textarea").fill("yes, ship it")
    card.locator("button[type=submit]").click()
    page.wait_for_url(f"{base}/runs/ask")
    try:
        expect(page.locator(".summary .status")).to_have_text("done", timeout=20_000)
    except AssertionError as error:  # say what the page said instead (a reply that could not resume the run)
        raise AssertionError(page.locator(".summary").inner_text()) from error
    expect(page.locator(".summary")).to_contain_text("https://status.example.com/posts/118")
    expect(page.locator("img.graph")).to_be_visible()  # and drawn: loaded, as wide as a graph is
    page.wait_for_function("() => document.querySelector('img.graph').complete")
    assert page.locator("img.graph").evaluate("image => image.naturalWidth") > 200

    page.locator("ol.trace a.fork").nth(2).click()  # fork from step 3: first what it may run again
    page.wait_for_url(f"{base}/runs/ask/fork?at=3")
    expect(page.locator(".effects")).to_contain_text("approval:publish (publish)")
    page.locator("form button[type=submit]").click()
    page.wait_for_url(f"{base}/runs/ask-fork-3")
    expect(page.locator(".summary .status")).to_have_text("done", timeout=20_000)
    expect(page.locator("ul.lineage")).to_contain_text("at step 3")

    page.goto(base + "/")  # the list follows the store: a run written now appears without a reload
    later = cli(
        "run", "echo.mk", "--script", "echo.yaml", "--checkpoint", f"sqlite:///{tmp_path}/runs.db#later", cwd=tmp_path
    )
    assert later.returncode == 0, later.stderr
    expect(page.locator("table.runs")).to_contain_text("later", timeout=10_000)

    stranger = browser.new_context().new_page()
    answer = stranger.goto(base + "/inbox")
    assert answer is not None and answer.status == 401
    assert "Publish" not in stranger.content()
    context.close()


def test_a_reply_typed_while_the_live_refresh_is_on_its_way_is_kept(browser, console_url):
    """The inbox's first refresh (the event stream opening) is held until a reply is typed, then let
    through: the page keeps what was typed, and the reply it sends is that one."""
    from playwright.sync_api import expect

    base = console_url.split("/?", 1)[0]
    page = browser.new_context().new_page()
    page.goto(console_url)
    held: list[object] = []
    page.route("**/inbox?*fragment=1*", lambda route: held.append(route))  # the live part, fetched by script
    page.goto(f"{base}/inbox")
    for _ in range(100):
        if held:
            break
        page.wait_for_timeout(50)
    assert held, "the inbox never refreshed itself"
    card = page.locator("article.question-card")
    card.locator("textarea").fill("yes, ship it")
    for route in held:
        route.continue_()  # type: ignore[attr-defined]
    page.unroute("**/inbox?*fragment=1*")
    page.wait_for_timeout(500)  # the refresh's answer has arrived and was looked at
    expect(card.locator("textarea")).to_have_value("yes, ship it")
    card.locator("button[type=submit]").click()
    page.wait_for_url(f"{base}/runs/ask")
    expect(page.locator(".summary .status")).to_have_text("done", timeout=20_000)


SHOTS = os.environ.get("MKLANG_CONSOLE_SHOTS")  # a folder (docs/console) the screenshots are kept in


@pytest.fixture
def thousand(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`mklang serve --sweep 0.5` over a store of 1,000 runs parked on the approval decision and one
    more (`due-soon`) whose decision times out six seconds after it parked: its URL and the store."""
    pytest.importorskip("starlette", reason="the console extra is not installed")
    from support.console import park_many, park_soon

    uri = park_many(tmp_path, 1_000)
    park_soon(tmp_path, f"{uri}#due-soon", within="6s")
    # Named from its folder, so the page header (and a screenshot) shows no temporary path.
    env = cli_env(PATH=str(tmp_path / "no-programs"))
    with serving(tmp_path, "sqlite:///parked.db", "--sweep", "0.5", env=env) as url:
        yield url, uri


def shot(page: object, tmp_path: Path, name: str) -> None:
    folder = Path(SHOTS) if SHOTS else tmp_path
    page.screenshot(path=folder / name)  # type: ignore[attr-defined]


def test_an_inbox_of_a_thousand_parked_runs_in_a_browser(browser, thousand, tmp_path):
    """The first page of 1,000 parked runs, a bulk answer to a page of one question, and an answer
    racing the sweep that takes a run at its deadline: the sweep wins, the answer is told. Then a
    run cancelled from its page (an answer from a card shown before is refused), forged forms
    refused, and two cancels and two answers racing on one run: one wins each time."""
    from playwright.sync_api import expect

    from mklang.checkpoint.envelope import load
    from mklang.stores import locate

    url, store = thousand
    base = url.split("/?", 1)[0]
    page = browser.new_context(viewport={"width": 1200, "height": 900}).new_page()
    page.goto(url)
    page.goto(f"{base}/runs/due-soon")  # a card read before its deadline, a note being written on it
    card = page.locator("article.question-card")
    expect(card).to_contain_text("Maintenance on Saturday")
    card.locator("input[name=note]").fill("looks good")
    page.wait_for_timeout(500)

    page2 = page.context.new_page()
    page2.goto(f"{base}/inbox")
    expect(page2.locator("p.count").first).to_contain_text("1001 waiting")
    assert page2.locator("article.question-card").count() == 25
    expect(page2.locator("article.question-card pre.shown").first).to_contain_text("On Saturday from 02:00")
    shot(page2, tmp_path, "inbox.png")

    page2.goto(f"{base}/inbox?machine=approval-1")  # one question's page: tick all, approve them
    page2.locator("input.select-all").check()
    assert page2.locator("input[name=pick]:checked").count() == 25
    page2.locator("form.bulk button[value=approve]").click()
    expect(page2.locator("h1")).to_have_text("Answered “approve”")
    expect(page2.locator("ul.answers li")).to_have_count(25)
    assert page2.locator("ul.answers .taken").count() == 25
    shot(page2, tmp_path, "answers.png")
    answered = [text.split(":", 1)[0] for text in page2.locator("ul.answers li").all_inner_texts()]
    for run in answered:
        for _ in range(200):
            if load(locate(f"{store}#{run}")).status == "done":
                break
            page2.wait_for_timeout(100)
        assert load(locate(f"{store}#{run}")).result == "https://status.example.com/posts/118", run

    for _ in range(200):  # the sweep takes the run at its deadline
        if load(locate(f"{store}#due-soon")).status != "suspended":
            break
        page.wait_for_timeout(100)
    taken = load(locate(f"{store}#due-soon"))
    assert taken.status == "halted" and taken.frames[0]["trace"][-1]["decision"]["by"] == "deadline"
    card.locator("button[value=approve]").click()  # the card still shows: the answer is too late
    expect(page.locator("ul.answers .failure")).to_contain_text("due-soon: the run already halted")
    shot(page, tmp_path, "race.png")
    assert load(locate(f"{store}#due-soon")).status == "halted"
    page.goto(f"{base}/inbox")
    expect(page.locator("p.count").first).to_contain_text(f"{1001 - 25 - 1} waiting")

    # Cancel from a run page; the card another tab still shows is then refused.
    stale = page.context.new_page()
    stale.goto(f"{base}/runs/parked-0000")
    stale.wait_for_timeout(1000)  # the page's live part caught up once with the store (the stream opened)
    stale.locator("article.question-card input[name=note]").fill("ship it")  # a card being written on stays
    page.goto(f"{base}/runs/parked-0000")
    expect(page.locator("form.cancel button")).to_be_visible()
    page.evaluate("() => document.querySelector('section.operator').scrollIntoView({block: 'center'})")
    shot(page, tmp_path, "cancel.png")
    page.locator("form.cancel button").click()
    page.wait_for_url(f"{base}/runs/parked-0000")
    expect(page.locator(".summary .status")).to_have_text("halted")
    expect(page.locator(".summary")).to_contain_text("cancelled")
    expect(page.locator("ul.actions-done")).to_contain_text("cancelled from the console at")
    assert page.locator("form.cancel").count() == 0
    shot(page, tmp_path, "cancelled.png")
    stale.locator("article.question-card button[value=approve]").click()
    expect(stale.locator("ul.answers .failure")).to_contain_text("the run already halted (cancelled)")
    assert (load(locate(f"{store}#parked-0000")).status, load(locate(f"{store}#parked-0000")).error) == (
        "halted",
        "cancelled",
    )

    # A forged form (no CSRF token, a wrong one) is refused and changes nothing, though the cookie is sent.
    before = locate(f"{store}#parked-0002").store.read("parked-0002")
    for forged in ({}, {"csrf": "forged"}):
        answer = page.request.post(f"{base}/runs/parked-0002/cancel", form=forged, max_redirects=0)
        assert answer.status == 403
    assert locate(f"{store}#parked-0002").store.read("parked-0002") == before

    # Two cancels, then two answers, racing on one run: exactly one wins each time.
    page.goto(f"{base}/runs/parked-0006")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    pick = page.locator("article.question-card input[name=pick]").first.get_attribute("value")
    assert csrf and pick
    token = url.split("token=", 1)[1]
    cancels = racing(base, token, "/runs/parked-0004/cancel", {"csrf": csrf})
    assert sorted(cancels) == [303, 409], cancels
    assert len(load(locate(f"{store}#parked-0004")).actions) == 1
    answers = racing(base, token, "/inbox/answer", {"csrf": csrf, "pick": pick, "choice": "approve"})
    assert sorted(answers) == [303, 409], answers
    for _ in range(200):
        if load(locate(f"{store}#parked-0006")).status == "done":
            break
        page.wait_for_timeout(100)
    decided = [step for step in load(locate(f"{store}#parked-0006")).frames[0]["trace"] if step.get("decision")]
    assert len(decided) == 1 and decided[0]["decision"]["choice"] == "approve"


def racing(base: str, token: str, path: str, form: dict[str, str]) -> list[int]:
    """The status codes of two POSTs of `form` to `path`, sent at once from two threads with the
    console's cookie (no redirect followed)."""
    import hashlib
    import http.client
    import threading
    from urllib.parse import urlencode, urlsplit

    where = urlsplit(base)
    cookie = f"mklang-{hashlib.sha256(token.encode()).hexdigest()[:12]}={token}"
    body = urlencode(form)
    ready = threading.Barrier(2)
    codes: list[int] = []

    def post() -> None:
        connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=60)
        headers = {"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"}
        ready.wait()
        connection.request("POST", path, body, headers)
        codes.append(connection.getresponse().status)
        connection.close()

    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return codes
