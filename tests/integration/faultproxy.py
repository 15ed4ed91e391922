"""A fault-injecting HTTP proxy between the operator and the real kube-apiserver.

The operator gets a kubeconfig naming the proxy (plain HTTP on loopback, the admin token); the
proxy forwards every request to the apiserver over TLS and records its arrival. A `FaultPolicy`
(set by the test) may answer a request instead: 429 with a Retry-After, 500, or 409 AlreadyExists
(the object is then not created), all as Kubernetes Status bodies. Watch requests are forwarded as
streams and, with `drop_watches_after_s`, cut after that many seconds, as a load balancer or an
apiserver restart would.

The proxy is a process of its own (`python -m tests.integration.faultproxy`), driven over
`/_faultproxy/` on its own port: its arrival times measure the operator's request rate, so they
must not wait for the test process's GIL (a thread there stalls while the test deserialises a
pod list, then stamps the queued requests in a burst the operator never sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tests.waiting import wait_for

if TYPE_CHECKING:
    from aiohttp import web

    from tests.integration.kubeapi import KubeAPI

ROOT = Path(__file__).resolve().parents[2]
CONTROL = "/_faultproxy"
# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes: never copied across. Bodies pass
# through as they are (gzip included), so Content-Encoding does.
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


@dataclass(frozen=True)
class FaultPolicy:
    """What the proxy injects. Each non-watch request (only namespaced ones with `namespaced_only`)
    draws once from a seeded generator: below `conflict_rate` a POST (unless its path ends in one of
    `no_conflict_suffixes`) gets 409; below `fault_rate / 2` a 429 with `retry_after_s`; below
    `fault_rate` a 500."""

    seed: int = 0
    fault_rate: float = 0.0
    retry_after_s: float = 1.0
    conflict_rate: float = 0.0
    no_conflict_suffixes: tuple[str, ...] = ()
    namespaced_only: bool = True
    drop_watches_after_s: float | None = None

    def decide(self, rng: random.Random, method: str, path: str) -> tuple[int, float | None] | None:
        if self.namespaced_only and "/namespaces/" not in path:
            return None
        draw = rng.random()
        if method == "POST" and not path.endswith(self.no_conflict_suffixes) and draw < self.conflict_rate:
            return 409, None
        if draw < self.fault_rate / 2:
            return 429, self.retry_after_s
        if draw < self.fault_rate:
            return 500, None
        return None


@dataclass(frozen=True)
class Seen:
    at: float                        # time.monotonic() on arrival (CLOCK_MONOTONIC: the same in every process)
    method: str
    path: str
    query: str
    name: str                        # metadata.name of a POST body, else ""
    watch: bool
    fault: int | None                # the status injected, or None when forwarded


# ------------------------------------------------------------------------------ the test's side
class FaultProxy:
    """Starts the proxy process and talks to it."""

    def __init__(self, kube: KubeAPI, root: Path):
        from tests.integration.kubeapi import free_port
        self.kube, self.root = kube, root
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FaultProxy:
        log = open(self.root / "faultproxy.log", "wb")  # noqa: SIM115 - the child keeps it
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.faultproxy", "--port", str(self.port),
             "--upstream", self.kube.server, "--cafile", str(self.kube.pki / "ca.crt")],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        log.close()

        def up() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"fault proxy exited: {(self.root / 'faultproxy.log').read_text()[-2000:]}")
            try:
                self._control("GET", "stats")
                return True
            except OSError:
                return False
        wait_for(up, 30, interval=0.05, what="the fault proxy")
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def set_policy(self, policy: FaultPolicy) -> None:
        self._control("PUT", "policy", asdict(policy))

    def requests(self, since: float = 0.0) -> list[Seen]:
        return [Seen(*row) for row in self._control("GET", f"seen?since={since!r}")]

    @property
    def watches_dropped(self) -> int:
        return int(self._control("GET", "stats")["watches_dropped"])

    def kubeconfig(self) -> Path:
        """A kubeconfig for the admin through the proxy."""
        admin = yaml.safe_load(self.kube.kubeconfig.read_text())
        admin["clusters"][0]["cluster"] = {"server": f"http://127.0.0.1:{self.port}"}
        path = self.root / "proxy.kubeconfig"
        path.write_text(yaml.safe_dump(admin))
        path.chmod(0o600)
        return path

    def _control(self, method: str, what: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{CONTROL}/{what}", data=data, method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())


# ------------------------------------------------------------------------------ the proxy process
class _Proxy:
    def __init__(self, upstream: str, cafile: str) -> None:
        self.upstream, self.cafile = upstream, cafile
        self.policy = FaultPolicy()
        self.rng = random.Random(0)
        self.seen: list[Seen] = []
        self.watches_dropped = 0

    async def serve(self, port: int) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
        self._session = ClientSession(connector=TCPConnector(ssl=ssl.create_default_context(cafile=self.cafile),
                                                             limit=0),
                                      auto_decompress=False, timeout=ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", CONTROL + "/{what}", self._control)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()   # until terminated

    async def _control(self, request: web.Request) -> web.Response:
        from aiohttp import web
        what = request.match_info["what"]
        if what == "policy" and request.method == "PUT":
            raw = await request.json()
            raw["no_conflict_suffixes"] = tuple(raw["no_conflict_suffixes"])
            self.policy = FaultPolicy(**raw)
            self.rng = random.Random(self.policy.seed)
            return web.json_response({})
        if what == "seen":
            since = float(request.query.get("since", "0"))
            return web.json_response([list(asdict(s).values()) for s in self.seen if s.at >= since])
        if what == "stats":
            return web.json_response({"watches_dropped": self.watches_dropped})
        return web.json_response({"error": f"unknown control {request.method} {what}"}, status=404)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web
        at = time.monotonic()
        raw = await request.read()
        body: dict[str, Any] | None = None
        if raw and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        watch = request.query.get("watch") in ("true", "1")
        policy = self.policy
        fault = None if watch else policy.decide(self.rng, request.method, request.path)
        name = str(((body or {}).get("metadata") or {}).get("name") or "")
        self.seen.append(Seen(at, request.method, request.path, request.query_string, name,
                              watch, fault[0] if fault else None))
        if fault is not None:
            return self._fault(fault[0], fault[1], request.path, name)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        upstream = await self._session.request(request.method, f"{self.upstream}{request.path_qs}",
                                               data=raw or None, headers=headers)
        try:
            out = web.StreamResponse(status=upstream.status,
                                     headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            drop = policy.drop_watches_after_s
            cut = time.monotonic() + drop if watch and drop else None
            while True:
                timeout = None if cut is None else max(0.0, cut - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), timeout)
                except asyncio.TimeoutError:
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
    def _fault(status: int, retry_after: float | None, path: str, name: str) -> web.Response:
        from aiohttp import web
        reason = {429: "TooManyRequests", 500: "InternalError", 409: "AlreadyExists"}.get(status, "")
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"injected by the fault proxy: {status} on {path} {name}".strip(),
                "reason": reason, "code": status}
        headers = {"Content-Type": "application/json"}
        if retry_after is not None:
            headers["Retry-After"] = f"{retry_after:g}"
        return web.Response(status=status, body=json.dumps(body).encode(), headers=headers)


def per_second(seen: list[Seen]) -> list[int]:
    """Requests in each 1-s window starting at each request (the densest windows show bursts)."""
    times = sorted(s.at for s in seen)
    out, j = [], 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + 1.0:
            j += 1
        out.append(j - i)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the apiserver's https URL")
    ap.add_argument("--cafile", required=True)
    args = ap.parse_args()
    asyncio.run(_Proxy(args.upstream, args.cafile).serve(args.port))


if __name__ == "__main__":
    main()
