"""`mklang serve`: the console on a socket, its token printed as a URL to open (as Jupyter does)."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

import uvicorn

from mklang.cli.listening import LOOPBACK, bind
from mklang.console.web import Console, create_app
from mklang.errors import UsageError, redacted
from mklang.runs.pooling import require_pool
from mklang.stores import open_store

EVERYWHERE = ("0.0.0.0", "::", "")


def serve(uri: str, *, host: str, port: int, hosting: Mapping[str, Any]) -> None:
    """Serve the console of the store `uri` until interrupted; `hosting` holds the host settings chosen."""
    store = open_store(uri, create=False)
    try:
        require_pool(store, hosting)
    except UsageError:
        store.close()
        raise
    listening = bind(host, port)
    token = secrets.token_urlsafe(32)
    console = Console(store, uri, token, hosting)
    bound = listening.getsockname()[1]
    shown = "127.0.0.1" if host in EVERYWHERE else host
    if ":" in shown:
        shown = f"[{shown}]"
    if host not in LOOPBACK:
        print(
            f"mklang: warning: listening on {host or '0.0.0.0'}:{bound}: anyone who can reach this machine on that "
            f"port and has the token can read every run of {redacted(uri)} (outputs, context, questions) and answer "
            "its questions, which resumes runs with this console's host",
            file=sys.stderr,
        )
    print(f"mklang console of {redacted(uri)}: http://{shown}:{bound}/?token={token}", flush=True)
    config = uvicorn.Config(create_app(console), log_level="warning", access_log=False, lifespan="on")
    try:
        Server(config, console).run(sockets=[listening])
    finally:
        console.replies.wait(timeout=5)
        store.close()


class Server(uvicorn.Server):
    """uvicorn's server, which ends the console's event streams as it starts to stop (Ctrl-C)."""

    def __init__(self, config: uvicorn.Config, console: Console):
        super().__init__(config)
        self.console = console

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.console.changes.close()
        self.console.stopping.set()
        super().handle_exit(sig, frame)
