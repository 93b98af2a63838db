"""An asyncio web host awaiting runs: a starlette app under uvicorn whose every request awaits
`mklang.arun`, with a ticker in the same loop that records how late it wakes.

    python tests/support/runs_app.py MACHINE CONFIG

prints the port it listens on (127.0.0.1), then serves until stdin closes. `GET /run?topic=T`
runs MACHINE with the host config CONFIG and answers the run's status and result; `GET /stats`
answers, since the last `/stats`, the ticker's latest wake-up beyond its 10 ms (`late_ms`), the
most threads the process had (`threads`) and its CPU seconds (`cpu`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import mklang

TICK = 0.01


class Watch:
    """The ticker's latest wake-up and the most threads seen, since they were last read."""

    def __init__(self) -> None:
        self.late = 0.0
        self.threads = threading.active_count()
        self.cpu = time.process_time()

    def read(self) -> dict[str, Any]:
        now = time.process_time()
        figures = {"late_ms": self.late * 1000, "threads": self.threads, "cpu": now - self.cpu}
        self.late, self.threads, self.cpu = 0.0, threading.active_count(), now
        return figures

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(TICK)
            self.late = max(self.late, loop.time() - asked - TICK)
            self.threads = max(self.threads, threading.active_count())


def app(machine: str, config: str) -> Starlette:
    watch = Watch()
    loaded = mklang.load(machine)  # once, as a host loads its machines: a path given to `arun` is parsed each run

    async def run(request: Request) -> JSONResponse:
        result = await mklang.arun(loaded, {"topic": request.query_params["topic"]}, config=config)
        return JSONResponse({"status": result.status, "result": result.result})

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(watch.read())

    @contextlib.asynccontextmanager
    async def ticking(app: Starlette) -> AsyncIterator[None]:
        ticker = asyncio.create_task(watch.tick())
        yield
        ticker.cancel()

    return Starlette(routes=[Route("/run", run), Route("/stats", stats)], lifespan=ticking)


def main() -> None:
    machine, config = sys.argv[1:3]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    server = uvicorn.Server(uvicorn.Config(app(machine, config), log_level="warning", backlog=1024))
    threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    server.run(sockets=[listener])


if __name__ == "__main__":
    main()
