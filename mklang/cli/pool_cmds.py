"""`mklang pool` (create, show, list, topup, rm): the budget pools of a store (docs/pools.md, ADR 0067)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.run_cmds import FormatOpt
from mklang.cli.scale_cmds import StoreOpt
from mklang.errors import redacted

pool_app = typer.Typer(help="Budget pools: dollar, token, in-flight and rate caps shared by runs of many processes.")
app.add_typer(pool_app, name="pool")

NameArg = typer.Argument(..., help="The pool's name.")


@contextmanager
def pools_of(uri: str, create: bool = False) -> Iterator[Any]:
    """The store `uri` names, which must keep pools: else a one-line refusal saying that it has none."""
    from mklang.stores import PoolStore, open_store

    store = open_store(uri, create=create)
    try:
        if not isinstance(store, PoolStore):
            raise fail(
                f"{redacted(uri)}: {type(store).__name__} has no budget pools: "
                "pools live in a SQLite or PostgreSQL store (sqlite:///runs.db, postgresql://...)"
            )
        yield store
    finally:
        store.close()


@pool_app.command("create")
def pool_create(
    name: str = NameArg,
    store: str = StoreOpt,
    max_cost: float | None = typer.Option(None, "--max-cost", metavar="USD", help="At most this many dollars in all."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", metavar="N", help="At most this many tokens in all."),
    concurrency: int | None = typer.Option(None, "--concurrency", metavar="N", help="At most N model calls in flight."),
    rpm: int | None = typer.Option(None, "--rpm", metavar="N", help="At most N model calls a minute."),
    tpm: int | None = typer.Option(None, "--tpm", metavar="N", help="At most N tokens a minute (worst cases)."),
    format: OutputFormat = FormatOpt,
) -> None:
    """Make a pool in a store: the runs given `--pool NAME` draw every model call's worst case from it."""
    with handle_errors(wants_json(format)):
        from mklang.stores.pools import Caps, pool_name

        caps = Caps(max_cost, max_tokens, concurrency, rpm, tpm)
        if not caps.any:
            raise fail("a pool needs a cap: --max-cost, --max-tokens, --concurrency, --rpm or --tpm")
        with pools_of(store, create=True) as pools:
            if not pools.create_pool(pool_name(name), caps):
                raise fail(f"pool {name} exists already in {redacted(store)}: `mklang pool topup` raises its caps")
            _print(pools.pool(name), format)


@pool_app.command("show")
def pool_show(name: str = NameArg, store: str = StoreOpt, format: OutputFormat = FormatOpt) -> None:
    """A pool's caps, what it has spent and reserved, its calls in flight and the runs waiting on it."""
    with handle_errors(wants_json(format)), pools_of(store) as pools:
        _print(_existing(pools, name, store), format)


@pool_app.command("list")
def pool_list(store: str = StoreOpt, format: OutputFormat = FormatOpt) -> None:
    """Every pool of a store."""
    with handle_errors(wants_json(format)), pools_of(store) as pools:
        listed = [pool for name in pools.pool_names() if (pool := pools.pool(name)) is not None]
        if wants_json(format):
            print_json({"store": redacted(store), "pools": [pool.to_json() for pool in listed]})
        else:
            for pool in listed:
                print(pool.line())


@pool_app.command("topup")
def pool_topup(
    name: str = NameArg,
    store: str = StoreOpt,
    cost: float = typer.Option(0.0, "--cost", metavar="USD", min=0, help="Raise the dollar cap by this much."),
    tokens: int = typer.Option(0, "--tokens", metavar="N", min=0, help="Raise the token cap by this much."),
    format: OutputFormat = FormatOpt,
) -> None:
    """Raise a pool's caps; runs suspended `pool-exhausted` continue with `mklang resume` (or a batch re-run)."""
    with handle_errors(wants_json(format)), pools_of(store) as pools:
        pool = _existing(pools, name, store)
        if cost == 0 and tokens == 0:
            raise fail("mklang pool topup needs --cost USD or --tokens N")
        if (cost and pool.caps.max_cost is None) or (tokens and pool.caps.max_tokens is None):
            raise fail(f"pool {name} has no {'dollar' if cost else 'token'} cap to raise")
        pools.top_up(name, cost, tokens)
        _print(pools.pool(name), format)


@pool_app.command("rm")
def pool_rm(
    name: str = NameArg,
    store: str = StoreOpt,
    force: bool = typer.Option(False, "--force", help="Remove it even while calls are in flight on it."),
    format: OutputFormat = FormatOpt,
) -> None:
    """Remove a pool; runs that draw from it are then refused until given another."""
    with handle_errors(wants_json(format)), pools_of(store) as pools:
        pool = _existing(pools, name, store)
        if pool.in_flight and not force:
            raise fail(f"pool {name} has {pool.in_flight} call(s) in flight: wait, or pass --force")
        pools.remove_pool(name)
        if wants_json(format):
            print_json({"removed": name})
        else:
            print(f"removed pool {name}")


def _existing(pools: Any, name: str, store: str) -> Any:
    pool = pools.pool(name)
    if pool is None:
        raise fail(f"no pool {name} in {redacted(store)}: `mklang pool list --store ...` lists them")
    return pool


def _print(pool: Any, format: OutputFormat) -> None:
    if wants_json(format):
        print_json(pool.to_json())
    else:
        print(pool.line())
