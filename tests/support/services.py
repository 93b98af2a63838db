"""The real servers some tests need on 127.0.0.1: PostgreSQL, RabbitMQ and Redis."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

SERVERS = {
    "PostgreSQL": ("127.0.0.1", 5432),
    "RabbitMQ": ("127.0.0.1", 5672),
    "Redis": ("127.0.0.1", 6379),
}


def require_server(name: str) -> None:
    """Skip unless the named real server answers on 127.0.0.1; under CI=true its absence fails."""
    import socket

    host, port = SERVERS[name]
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        message = f"{name} is not reachable on {host}:{port}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (CI must run the tests that need it)")
        pytest.skip(message)


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A store URI into a fresh schema of database `test`, dropped afterwards (parallel runs never collide)."""
    require_server("PostgreSQL")
    import uuid

    import psycopg

    schema = f"mk_{uuid.uuid4().hex[:12]}"
    base = "postgresql://postgres@127.0.0.1:5432/test"
    with psycopg.connect(base, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{base}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(base, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")
