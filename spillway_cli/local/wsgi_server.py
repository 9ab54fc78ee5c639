"""A WSGI app (the router, the CPU fallback) on a local, threaded HTTP/1.1 server.

werkzeug's server is what serverless-wsgi already depends on; threaded, it speaks
HTTP/1.1 with keep-alive, which tritonclient expects. It is meant for 127.0.0.1 and the
tests, not for the internet (on AWS, API Gateway and Lambda stand in front).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    """No access log line per request (the router logs its own decision)."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Log nothing."""
        return None


def server(app: WsgiApp, host: str = "127.0.0.1", port: int = 0) -> BaseWSGIServer:
    """A threaded server bound to ``host:port`` (0: a free port); not started."""
    return make_server(host, port, app, threaded=True, request_handler=_QuietHandler)


@contextmanager
def running(app: WsgiApp, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` in a background thread; yields its base URL, shuts down after."""
    httpd = server(app, host, port)
    thread = threading.Thread(target=httpd.serve_forever, name="wsgi-server", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_forever(app: WsgiApp, host: str, port: int) -> None:
    """Serve in the foreground until interrupted (SIGINT or SIGTERM: a clean exit)."""
    signal.signal(signal.SIGTERM, _interrupt)
    httpd = server(app, host, port)
    logging.getLogger("spillway.serve").info("listening on http://%s:%d", host, httpd.server_port)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
