"""An HTTP proxy on 127.0.0.1 for tests: CONNECT tunnels (HTTPS) and absolute-URL requests (plain HTTP);
`FakeProxy(tls=True)` is reached over TLS itself (an `https://` proxy, the fake server's certificate).

    with FakeProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        ...
        assert proxy.requests == [("CONNECT", "127.0.0.1:8443", None)]

Each request is recorded as (method, target, its Proxy-Authorization header).
"""

from __future__ import annotations

import socket
import ssl
import threading
import urllib.parse
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from support.fakeserver import CERTIFICATE, TLS


class FakeProxy:
    def __init__(self, *, tls: bool = False) -> None:
        self.requests: list[tuple[str, str, str | None]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._httpd.daemon_threads = True
        self._tls = tls
        if tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(CERTIFICATE, TLS / "key.pem")
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, name="fakeproxy", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{'https' if self._tls else 'http'}://{host}:{port}"

    def __enter__(self) -> FakeProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _handler_class(proxy: FakeProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_CONNECT(self) -> None:
            proxy.requests.append(("CONNECT", self.path, self.headers.get("Proxy-Authorization")))
            host, port = self.path.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            self.send_response(200, "Connection established")
            self.end_headers()
            back = threading.Thread(target=_pipe, args=(upstream, self.connection), daemon=True)
            back.start()
            _pipe(self.connection, upstream)
            back.join(timeout=5)
            self.close_connection = True

        def do_POST(self) -> None:
            proxy.requests.append(("POST", self.path, self.headers.get("Proxy-Authorization")))
            url = urllib.parse.urlsplit(self.path)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = {key: value for key, value in self.headers.items() if not key.lower().startswith("proxy-")}
            upstream = HTTPConnection(url.hostname or "", url.port)
            upstream.request("POST", url.path, body, headers)
            response = upstream.getresponse()
            data = response.read()
            upstream.close()
            self.send_response(response.status)
            self.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes until `source` ends, then end `sink`'s side."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass
