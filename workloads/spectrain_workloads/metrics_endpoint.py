"""A process's Prometheus endpoint (the target's and the drafter's): /metrics on one port, and
the last figures kept up until Prometheus has them.

A training process ends seconds after its last update; a scrape every 30 s would miss the final
counts (the last steps' idle time, the drafters' last combined round), and a run's totals in
Prometheus would fall short of `spectrain report`'s. `final()` therefore keeps the endpoint up
until one scrape that arrived after the call has been served, but only where a scraper is
watching (two scrapes seen, so an interval is known), and at most 1.5 x that interval, capped at
FINAL_SCRAPE_MAX_S: a run nobody scrapes ends at once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from spectrain_workloads.listen import pod_address, require_specific

FINAL_SCRAPE_MAX_S = 45.0    # past the pod's default 30 s termination grace the kubelet stops a sidecar anyway
_INTERVALS_KEPT = 4          # the longest of the last few gaps between scrapes is the interval


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 (the base class's name)
        pass


class _Served:
    """The WSGI body of one scrape: the server calls close() once every byte is written."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self._body, self._done = body, done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def close(self) -> None:
        close = getattr(self._body, "close", None)
        if close is not None:
            close()
        self._done()


class Endpoint:
    """/metrics of `registry` on `port` of `addr`: the pod's own address (listen.pod_address), where
    Prometheus scrapes it, never every interface."""

    def __init__(self, registry: Any, port: int, addr: str | None = None) -> None:
        from prometheus_client import make_wsgi_app

        addr = addr or pod_address()
        require_specific(addr, "metrics address")

        app = make_wsgi_app(registry)
        self._cond = threading.Condition()
        self._arrivals: list[float] = []      # monotonic arrival times of served scrapes (the last few)
        self._served_after = float("-inf")    # arrival of the newest served scrape

        def tracked(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            arrived = time.monotonic()
            return _Served(app(environ, start_response), lambda: self._record(arrived))

        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_FamilyServer", (_Server,), {"address_family": family})
        self.server: WSGIServer = make_server(addr, port, tracked, server_class, handler_class=_Quiet)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"metrics-{port}", daemon=True)
        self._thread.start()

    def _record(self, arrived: float) -> None:
        with self._cond:
            self._arrivals = (self._arrivals + [arrived])[-(_INTERVALS_KEPT + 1):]
            self._served_after = arrived
            self._cond.notify_all()

    def scrape_interval(self) -> float | None:
        """The longest recent gap between scrapes; None until two were served."""
        with self._cond:
            a = self._arrivals
            return max(y - x for x, y in zip(a, a[1:], strict=False)) if len(a) >= 2 else None

    def final(self, max_s: float = FINAL_SCRAPE_MAX_S) -> bool:
        """Call after the last update: wait until a scrape that arrived from now on was served.
        Returns whether one was; False at once where nobody scrapes."""
        interval = self.scrape_interval()
        if interval is None:
            return False
        mark = time.monotonic()
        deadline = mark + min(max_s, 1.5 * interval + 0.5)
        with self._cond:
            while self._served_after < mark:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


__all__ = ["FINAL_SCRAPE_MAX_S", "Endpoint"]
