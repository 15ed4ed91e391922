"""A fault-injecting HTTP proxy between the operator and the real kube-apiserver.

The operator gets a kubeconfig naming the proxy (plain HTTP on loopback, the admin token); the
proxy forwards every request to the apiserver over TLS and records it. Per request, `decide`
(set by the test) may answer it instead: 429 with a Retry-After, 500, or 409 AlreadyExists (the
object is then not created), all as Kubernetes Status bodies. Watch requests are forwarded as
streams and, with `drop_watches_after_s`, cut after that many seconds, as a load balancer or an
apiserver restart would.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from tests.integration.kubeapi import KubeAPI, free_port

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes: never copied across.
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host", "upgrade"}


@dataclass(frozen=True)
class Fault:
    status: int                      # 429, 500 or 409
    retry_after: float | None = None


@dataclass(frozen=True)
class Seen:
    at: float                        # time.monotonic() on arrival
    method: str
    path: str
    query: str
    name: str                        # metadata.name of a POST body, else ""
    watch: bool
    fault: int | None                # the status injected, or None when forwarded


Decide = Callable[[str, str, str, dict[str, Any] | None], Fault | None]


class FaultProxy:
    def __init__(self, kube: KubeAPI, root: Path):
        self.kube, self.root = kube, root
        self.port = free_port()
        self.decide: Decide = lambda method, path, query, body: None
        self.drop_watches_after_s: float | None = None
        self.seen: list[Seen] = []
        self.watches_dropped = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, name="faultproxy", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            await self._session.close()   # ends the forwarded watch streams first
            if self._runner is not None:
                await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def kubeconfig(self) -> Path:
        """A kubeconfig for the admin through the proxy."""
        admin = yaml.safe_load(self.kube.kubeconfig.read_text())
        admin["clusters"][0]["cluster"] = {"server": f"http://127.0.0.1:{self.port}"}
        path = self.root / "proxy.kubeconfig"
        path.write_text(yaml.safe_dump(admin))
        path.chmod(0o600)
        return path

    def requests(self, since: float = 0.0) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.at >= since]

    # ------------------------------------------------------------ serving

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._setup())
        self._ready.set()
        self._loop.run_forever()

    async def _setup(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.kube.pki / "ca.crt"))
        self._session = ClientSession(connector=TCPConnector(ssl=ctx, limit=0), auto_decompress=False,
                                      timeout=ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: dict[str, Any] | None = None
        if raw and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        watch = request.query.get("watch") in ("true", "1")
        fault = None if watch else self.decide(request.method, request.path, request.query_string, body)
        name = str(((body or {}).get("metadata") or {}).get("name") or "")
        with self._lock:
            self.seen.append(Seen(time.monotonic(), request.method, request.path, request.query_string, name,
                                  watch, fault.status if fault else None))
        if fault is not None:
            return self._fault(fault, request.path, name)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        upstream = await self._session.request(request.method, f"{self.kube.server}{request.path_qs}",
                                               data=raw or None, headers=headers)
        try:
            out = web.StreamResponse(status=upstream.status,
                                     headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            cut = time.monotonic() + self.drop_watches_after_s if watch and self.drop_watches_after_s else None
            while True:
                timeout = None if cut is None else max(0.0, cut - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), timeout)
                except asyncio.TimeoutError:
                    with self._lock:
                        self.watches_dropped += 1
                    # Cut the client's connection mid-stream, no terminating chunk: a dropped watch.
                    if request.transport is not None:
                        request.transport.close()
                    return out
                if not chunk:
                    break
                await out.write(chunk)
            await out.write_eof()
            return out
        finally:
            upstream.release()

    @staticmethod
    def _fault(fault: Fault, path: str, name: str) -> web.Response:
        reason = {429: "TooManyRequests", 500: "InternalError", 409: "AlreadyExists"}.get(fault.status, "")
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": f"injected by the fault proxy: {fault.status} on {path} {name}".strip(),
                  "reason": reason, "code": fault.status}
        headers = {"Content-Type": "application/json"}
        if fault.retry_after is not None:
            headers["Retry-After"] = f"{fault.retry_after:g}"
        return web.Response(status=fault.status, body=json.dumps(status).encode(), headers=headers)


def per_second(seen: list[Seen]) -> list[int]:
    """Requests in each 1-s window starting at each request (the densest windows show bursts)."""
    times = sorted(s.at for s in seen)
    out, j = [], 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + 1.0:
            j += 1
        out.append(j - i)
    return out
