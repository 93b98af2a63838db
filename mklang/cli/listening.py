"""A listening socket for the servers the command line starts (`mklang serve`, `mklang mcp --http`)."""

from __future__ import annotations

import socket

from mklang.errors import UsageError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (port 0: a free one), or a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as error:
        listening.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    listening.listen(128)
    listening.set_inheritable(True)
    return listening
