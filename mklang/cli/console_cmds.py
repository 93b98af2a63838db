"""`mklang serve`: the web console of a store (docs/console.md). Its libraries are the `console`
extra, imported only here."""

from __future__ import annotations

import typer

from mklang import exitcodes
from mklang.cli.app import app, fail, handle_errors
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.scale_cmds import StoreOpt, SweepOpt, sweeping

CONSOLE_LIBRARIES = ("starlette", "uvicorn", "jinja2", "markupsafe", "anyio", "h11")


@app.command()
@hosted("record")
def serve(
    store: str = StoreOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port to listen on (0: a free one, printed)."),
    sweep: float | None = SweepOpt,
    hosting: Hosting = Hosting(),
) -> None:
    """Serve a web console of a store: runs, traces, graphs, and an inbox whose replies resume runs
    (with --sweep, it also takes the deadlines of the store's parked decisions)."""
    with handle_errors():
        try:
            from mklang.console.server import serve as serve_console
        except ImportError as error:
            missing = (error.name or "").split(".")[0]
            if missing in CONSOLE_LIBRARIES:
                raise fail(
                    f"mklang serve needs the console extra ({missing} is missing): pip install 'mklang[console]>=2'",
                    exitcodes.USAGE,
                ) from None
            raise
        with sweeping(store, sweep, hosting.settings):
            serve_console(store, host=host, port=port, hosting=hosting.settings)
