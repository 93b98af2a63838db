"""The console's web application: pages, the event stream and the inbox's replies, behind a token.

Safe by default (ADR 0031): every request carries the token `mklang serve` printed, first in the
URL, then in an HttpOnly, SameSite=Strict cookie; a form carries the server's CSRF token; every
text is escaped by Jinja2; the Content-Security-Policy allows no inline script or style.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, parse_qsl, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import URL, MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mklang.console import reading
from mklang.console.answers import Delivery, Raised, Replies
from mklang.console.events import Change, StorePoller
from mklang.errors import CheckpointError, MklangError, UsageError, first_line, redacted
from mklang.forking import step_path
from mklang.host.settings import given
from mklang.limits import NestingError, parse_assignments
from mklang.stores import NoteStore, RunStore, run_name

HERE = Path(__file__).parent
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
MAX_FORM = 64 * 1024  # bytes of a reply form
HEARTBEAT = 15.0  # seconds between keep-alive comments of the event stream
ANSWERS_EVERY = 0.2  # seconds between two looks at the answers a watched run is writing
VERDICT_WAIT = 30.0  # seconds an answer waits to be taken or refused under its run's lock
UNAUTHORIZED = "401: open the console with the URL `mklang serve` printed (it carries the token)\n"


@dataclass
class Console:
    """What every request of one console shares."""

    store: RunStore
    uri: str
    token: str
    hosting: Mapping[str, Any] = field(default_factory=given)  # the host settings chosen (`host.settings.given`)
    interval: float = 0.5  # seconds between looks at the store
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    stopping: threading.Event = field(default_factory=threading.Event)  # the server stops: streams end

    def __post_init__(self) -> None:
        self.changes = StorePoller(self.store, self.interval)
        self.replies = Replies(
            self.store, self.uri, self.hosting, lambda run: self.changes.tell(Change(frozenset({run})))
        )
        self.templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
        self.templates.globals.update(csrf=self.csrf, store=redacted(self.uri))
        self.templates.filters["shown"] = shown
        self.templates.filters["when"] = reading.when
        # One console's cookie does not replace another's on the same host (cookies ignore ports).
        self.cookie = "mklang-" + hashlib.sha256(self.token.encode()).hexdigest()[:12]

    def page(self, name: str, code: int = 200, **values: Any) -> HTMLResponse:
        return HTMLResponse(self.templates.get_template(name).render(**values), code)


def shown(value: Any) -> str:
    """A value of a run as text: itself when it is text, else its JSON (escaped by the template)."""
    return value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False, default=str)


class Guard:
    """Lets through requests that carry the token; adds the security headers to every response."""

    def __init__(self, app: ASGIApp, console: Console):
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        request = Request(scope)
        given = request.query_params.get("token")
        response: Response | None = None
        if given is not None and _same(given, self.console.token):
            # The token moves into a cookie and out of the address bar (and of history).
            response = RedirectResponse(str(_without_token(request.url)), 303)
            response.set_cookie(self.console.cookie, self.console.token, httponly=True, samesite="strict", path="/")
        elif not _same(request.cookies.get(self.console.cookie, ""), self.console.token):
            response = PlainTextResponse(UNAUTHORIZED, 401)
        if response is not None:
            await response(scope, receive, secured)
        else:
            await self.app(scope, receive, secured)


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def _without_token(url: URL) -> URL:
    kept = [(key, value) for key, value in parse_qsl(url.query, keep_blank_values=True) if key != "token"]
    return url.replace(query=urlencode(kept))


def create_app(console: Console) -> ASGIApp:
    """The console as an ASGI application."""

    def runs_page(request: Request) -> Response:
        number = _page_number(request)
        page = reading.runs_page(console.store, number, request.query_params)
        name = "runs_table.html" if "fragment" in request.query_params else "runs.html"
        return console.page(name, page=page, here="runs", query=_query(page.filters))

    def run_page(request: Request) -> Response:
        run = _run(request, console)
        view = reading.run_view(console.store, console.uri, run)
        drawn = reading.drawing(console.store, console.uri, run, view.get("last_steps") or [])
        values = dict(
            view=view,
            failure=console.replies.failures.get(run),
            notes=console.replies.notes.get(run, []),
            drawn=drawn,
        )
        name = "run_body.html" if "fragment" in request.query_params else "run.html"
        return console.page(name, here="runs", **values)

    def graph_svg(request: Request) -> Response:
        run = _run(request, console)
        view = reading.run_view(console.store, console.uri, run)
        drawn = reading.drawing(console.store, console.uri, run, view.get("last_steps") or [])
        if isinstance(drawn, str):
            return PlainTextResponse("404: no diagram of this run\n", 404)
        from mklang.diagram import to_svg

        return Response(to_svg(drawn), media_type="image/svg+xml")

    def fork_page(request: Request) -> Response:
        """What forking the run at `?at=STEP` would run again, before anything is paid, and the form
        that forks it."""
        run = _run(request, console)
        try:
            preview = reading.fork_preview(console.store, console.uri, run, request.query_params.get("at", ""))
        except (UsageError, CheckpointError) as error:
            return console.page("error.html", 400, message=redacted(first_line(error)), here="runs")
        return console.page("fork.html", fork=preview, here="runs")

    async def fork(request: Request) -> Response:
        """A fork of the run at the step the form names, into a new run of the store (`name`), with
        the form's `K.PATH=VALUE` lines set there; the page of the fork once its prefix replayed."""
        run = await run_in_threadpool(_run, request, console)
        form = await _form(request, console)
        if isinstance(form, Response):
            return form
        try:
            at = step_path(_one(form, "at"))
            name = run_name(_one(form, "name").strip(), "the fork's name")
            values = parse_assignments([line.strip() for line in _one(form, "set").splitlines() if line.strip()])
        except UsageError as error:
            return PlainTextResponse(f"400: {first_line(error)}\n", 400)
        if await run_in_threadpool(console.store.read, name) is not None:
            taken = f"a run named {name!r} is in this store already: give the fork another name"
            return console.page("error.html", 409, message=taken, here="runs")
        delivery = console.replies.fork(run, at, name, values)
        await run_in_threadpool(_verdicts, [delivery], "begin")
        if delivery.verdict is not None:
            return console.page("error.html", 409, message=delivery.verdict, here="runs")
        return RedirectResponse(f"/runs/{name}", 303)

    async def cancel(request: Request) -> Response:
        """Cancel the run (`mklang runs cancel`): a parked one halts `cancelled` now, a running one
        at its next loop-top; the run's page, or the line that refused it."""
        from mklang.runs import location
        from mklang.runs.cancelling import cancel

        run = await run_in_threadpool(_run, request, console)
        form = await _form(request, console)
        if isinstance(form, Response):
            return form
        done = await run_in_threadpool(cancel, location(console.store, console.uri, run), "console")
        console.changes.tell(Change(frozenset({run})))
        if done.outcome == "refused":
            return console.page("error.html", 409, message=redacted(done.why or "not cancelled"), here="runs")
        return RedirectResponse(f"/runs/{run}", 303)

    async def raise_budget(request: Request) -> Response:
        """Resume a run parked on a budget with the form's raised budgets (new totals, blank ones
        kept), as `mklang resume --budget --max-tokens --max-cost --max-time` does."""
        run = await run_in_threadpool(_run, request, console)
        form = await _form(request, console)
        if isinstance(form, Response):
            return form
        try:
            raised = _raised(form)
        except UsageError as error:
            return PlainTextResponse(f"400: {first_line(error)}\n", 400)
        delivery = console.replies.raise_budget(run, raised)
        await run_in_threadpool(_verdicts, [delivery], "take the raised budgets")
        if delivery.verdict is not None:
            return console.page("error.html", 409, message=delivery.verdict, here="runs")
        return RedirectResponse(f"/runs/{run}", 303)

    def inbox_page(request: Request) -> Response:
        page = reading.inbox_page(console.store, console.uri, _page_number(request), request.query_params)
        name = "inbox_list.html" if "fragment" in request.query_params else "inbox.html"
        return console.page(name, inbox=page, here="inbox", query=_query(page.filters))

    async def reply(request: Request) -> Response:
        """A free-text reply to the question a run parked on (`--set REPLY_TO=REPLY`)."""
        run = await run_in_threadpool(_run, request, console)
        form = await _form(request, console)
        if isinstance(form, Response):
            return form
        summary = await run_in_threadpool(reading.run_view, console.store, console.uri, run)
        if not summary["waiting"] or summary.get("question") is not None:
            return console.page("answered.html", 409, run=run, status=summary["status"], here="inbox")
        try:
            console.replies.reply(run, summary["reply_to"], _one(form, "reply"))
        except NestingError as error:
            return PlainTextResponse(f"400: the reply is {error}\n", 400)
        return RedirectResponse(f"/runs/{run}", 303)

    async def answer(request: Request) -> Response:
        """A choice (and note) answering the decisions of one or more runs (`pick`: each a run, the
        question its card showed and the digest of the value shown): each is delivered under its own
        lock, bound to its own question and digest; the page says which were taken."""
        form = await _form(request, console)
        if isinstance(form, Response):
            return form
        picks = [_pick(text) for text in form.get("pick", [])]
        if not picks or None in picks:
            return PlainTextResponse("400: the answer names no run, or a run by a name no run has\n", 400)
        choice, note = _one(form, "choice").strip(), _one(form, "note").strip() or None
        deliveries = [
            console.replies.answer(
                run, {"choice": choice, "note": note, "question": question, "digest": digest, "by": "human"}
            )
            for run, question, digest in (pick for pick in picks if pick is not None)
        ]
        await run_in_threadpool(_verdicts, deliveries)
        refused = [delivery for delivery in deliveries if delivery.verdict is not None]
        if len(deliveries) == 1 and not refused:
            return RedirectResponse(f"/runs/{deliveries[0].run}", 303)
        code = 409 if len(refused) == len(deliveries) else 200
        return console.page("answers.html", code, choice=choice, deliveries=deliveries, here="inbox")

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            yield "retry: 2000\n\n"
            async for change in console.changes.follow(HEARTBEAT):
                yield ": ping\n\n" if change is None else f"event: runs\ndata: {change.to_json()}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})

    async def answers(request: Request) -> Response:
        run = await run_in_threadpool(_run, request, console)
        return StreamingResponse(
            _live_answers(console, run), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await console.changes.stop()

    routes = [
        Route("/", runs_page),
        Route("/runs/{run}", run_page),
        Route("/runs/{run}/graph.svg", graph_svg),
        Route("/runs/{run}/fork", fork_page),
        Route("/runs/{run}/fork", fork, methods=["POST"]),
        Route("/runs/{run}/cancel", cancel, methods=["POST"]),
        Route("/runs/{run}/budget", raise_budget, methods=["POST"]),
        Route("/runs/{run}/answers", answers),
        Route("/inbox", inbox_page),
        Route("/inbox/answer", answer, methods=["POST"]),
        Route("/inbox/{run}", reply, methods=["POST"]),
        Route("/events", events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={MklangError: _store_error(console)})
    return Guard(app, console)


async def _live_answers(console: Console, run: str) -> AsyncIterator[str]:
    """The answers `run` is writing, as server-sent events, while the page that asked stays open
    and the server runs: the run is asked to stream them (`live.watch`, written again before it
    goes stale) and each change of what it wrote is sent (`{"calls": [...]}`, none once its calls
    ended)."""
    from mklang.runs import live

    store = console.store if isinstance(console.store, NoteStore) else None  # a store without notes shows none
    yield "retry: 2000\n\n"
    sent: dict[str, Any] | None = None
    watch_at = pinged = 0.0
    while not console.stopping.is_set():
        now = time.monotonic()
        if now >= watch_at and store is not None:
            with contextlib.suppress(MklangError):  # display only: the run page shows the store anyway
                await run_in_threadpool(live.watch, store, run)
            watch_at = now + live.WATCH_FOR / 3
        written = await run_in_threadpool(live.read, store, run) if store is not None else None
        shown = {"calls": written["calls"] if written is not None else []}
        if shown != sent:
            sent, pinged = shown, now
            yield f"event: answers\ndata: {json.dumps(shown)}\n\n"
        elif now - pinged >= HEARTBEAT:
            pinged = now
            yield ": ping\n\n"
        await asyncio.sleep(ANSWERS_EVERY)


def _store_error(console: Console) -> Any:
    async def handle(request: Request, error: Exception) -> Response:
        status = 404 if isinstance(error, NoSuchRun) else 503  # else the store could not be read
        return console.page("error.html", status, message=redacted(str(error).splitlines()[0]), here="")

    return handle


def _page_number(request: Request) -> int:
    text = request.query_params.get("page", "1")
    return int(text) if text.isdigit() and 0 < int(text) < 10**9 else 1


def _query(filters: Mapping[str, str]) -> str:
    """The filters of a page as the query its links to other pages carry (`&` first)."""
    return "".join(f"&{urlencode({name: value})}" for name, value in filters.items())


async def _form(request: Request, console: Console) -> dict[str, list[str]] | Response:
    """A posted form's fields, or the response refusing it: too long, or without the CSRF token."""
    body = await request.body()
    if len(body) > MAX_FORM:
        return PlainTextResponse("413: the reply is too long\n", 413)
    form = parse_qs(body.decode("utf-8", "replace"))
    if not _same(_one(form, "csrf"), console.csrf):
        return PlainTextResponse("403: the form's CSRF token is missing or wrong: reload the page\n", 403)
    return form


def _one(form: Mapping[str, list[str]], name: str) -> str:
    return form.get(name, [""])[0]


def _raised(form: Mapping[str, list[str]]) -> Raised:
    """The budgets a run page's form raises (blank fields are left out): whole steps and tokens,
    dollars and seconds above 0; UsageError for a field that is none, or when every one is blank."""
    raised: dict[str, float] = {}
    for name, kind in (("budget", int), ("max_tokens", int), ("max_cost", float), ("max_time", float)):
        text = _one(form, name).strip()
        if not text:
            continue
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < 10**15:
            raise UsageError(f"{name} must be a {'whole ' if kind is int else ''}number above 0, not {text[:40]!r}")
        raised[name] = value
    if not raised:
        raise UsageError("the form raises no budget: give a step budget, tokens, dollars or seconds")
    return cast(Raised, raised)


QUESTION_ID = re.compile(r"[0-9a-f]{1,64}")
DIGEST = re.compile(r"[0-9a-f]{64}|-")


def _pick(text: str) -> tuple[str, str, str | None] | None:
    """A run picked on a card (`RUN QUESTION DIGEST`, as `reading.card` binds it), its parts
    checked; None when it is not one (a forged name is refused before anything is looked up)."""
    parts = text.split(" ")
    if len(parts) != 3 or not QUESTION_ID.fullmatch(parts[1]) or not DIGEST.fullmatch(parts[2]):
        return None
    try:
        run = run_name(parts[0])
    except MklangError:
        return None
    return run, parts[1], None if parts[2] == "-" else parts[2]


def _verdicts(deliveries: list[Delivery], waited: str = "take the answer") -> None:
    """Wait until each answer was taken or refused under its run's lock, or each fork began or was
    refused (a run that did not `waited` within `VERDICT_WAIT` is told as such)."""
    for delivery in deliveries:
        if not delivery.decided.wait(VERDICT_WAIT) and delivery.verdict is None:
            delivery.verdict = f"run {delivery.run} did not {waited} within {VERDICT_WAIT:g}s: look at it again"


class NoSuchRun(MklangError):
    """A page asked for a run the store does not hold."""


def _run(request: Request, console: Console) -> str:
    """The run a path names; a name no run can have, or no run of the store has, is a 404 page."""
    text = request.path_params["run"]
    try:
        run = run_name(text)
    except MklangError:
        raise NoSuchRun(f"no run named {text!r} in this store") from None
    if console.store.read(run) is None:
        raise NoSuchRun(f"no run named {text!r} in this store")
    return run
