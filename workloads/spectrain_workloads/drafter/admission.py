"""Admitting the drafters' connections: what a peer without the key can hold, and for how long.

A connection is *pending* from its accept until its handshake (drafter.auth) completes, and an
authenticated *session* after that. Pending connections are read by one thread with a selector
(no thread, no buffer past the hello's bytes, until they authenticate), under their own budget
(`Limits`, derived from the job's size):

    pending_total       = 2 x (world - 1)     every other rank connecting at once, each once more
                                              (a reconnect while its timed-out predecessor still counts)
    pending_per_source  = min(pending_total, 2 x ranks_per_host)
                          ranks_per_host: the most ranks listed at one host of SPECTRAIN_DRAFTER_PEERS
                          (LOCAL_WORLD_SIZE on a cluster, the world in a local run)
    leg_s               = max(rtt_bound_s, srtt + 4 x rttvar)   per connection: one round trip, the
                          declared bound (`FleetConfig.rtt_bound_s`) or the kernel's own measure of that
                          connection's (TCP_INFO, the RTO formula of RFC 6298), whichever is longer
    handshake deadline  = the hello within leg_s of the accept, the tag within leg_s of the reply
    idle_s              = IDLE_ROUNDS x combine_every_s + 2 x leg      (authenticated, drafter.listener)

When a new connection would put its source address or the total over budget, the pending connection
that got least far (bytes of the handshake received; the oldest among equals) is closed, the new one
included: a peer that holds connections open and sends nothing loses them to the first real peer,
whose hello is already in the socket when it is accepted. One session per rank is drafter.listener's.
What is refused is counted by cause (`evicted`, `stalled`, `descriptors` and the handshake's own).
"""

from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from spectrain_workloads.drafter.auth import AuthError, Identity, ServerHandshake, Session
from spectrain_workloads.drafter.links import Stats

RTT_BOUND_S = 0.1        # declared round trip: a pod network's (< 2 ms) plus a busy peer's scheduling delay
IDLE_ROUNDS = 3          # a weights link sends every round: three quiet rounds is a parked connection
_FD_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TCP_INFO_RTT = struct.Struct("=II")      # tcpi_rtt, tcpi_rttvar (microseconds), at offset 68 of struct tcp_info
_TCP_INFO_RTT_AT = 68


@dataclass(frozen=True)
class Limits:
    pending_total: int
    pending_per_source: int
    rtt_bound_s: float
    idle_s: float

    @classmethod
    def for_job(cls, *, world: int, ranks_per_host: int, combine_every_s: float, rtt_bound_s: float = RTT_BOUND_S) -> Limits:
        total = 2 * max(world - 1, 1)
        return cls(total, min(total, 2 * max(ranks_per_host, 1)), rtt_bound_s,
                   IDLE_ROUNDS * combine_every_s + 2 * rtt_bound_s)

    @staticmethod
    def ranks_per_host(addresses: list[tuple[str, int]]) -> int:
        return max(Counter(h for h, _ in addresses).values(), default=1)

    @property
    def handshake_s(self) -> float:
        """How long the connecting side waits for the whole handshake (two legs)."""
        return 2 * self.rtt_bound_s

    def leg_s(self, sock: socket.socket) -> float:
        """One round trip on `sock`: the declared bound, or the kernel's RTO estimate if longer."""
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_RTT_AT + _TCP_INFO_RTT.size)
            rtt_us, var_us = _TCP_INFO_RTT.unpack_from(info, _TCP_INFO_RTT_AT)
        except (OSError, AttributeError, struct.error):    # not Linux, or not TCP
            return self.rtt_bound_s
        return max(self.rtt_bound_s, (rtt_us + 4 * var_us) / 1e6)


@dataclass
class _Pending:
    sock: socket.socket
    source: str
    opened: float
    deadline: float
    leg: float
    hs: ServerHandshake = field(repr=False)

    @property
    def order(self) -> tuple[int, float]:
        """Who is closed first when the budget is full: the least far, then the oldest."""
        return self.hs.received, self.opened


class Admission:
    """Accepts on `socks` (listening, one port), runs every handshake, and hands each authenticated
    connection (blocking again) to `on_session`."""

    def __init__(self, socks: list[socket.socket], *, ident: Identity, rank: int, world: int, limits: Limits,
                 stats: Stats, on_session: Callable[[socket.socket, Session], None]) -> None:
        self.socks, self.ident, self.rank, self.world = socks, ident, rank, world
        self.limits, self.stats, self.on_session = limits, stats, on_session
        self.pending: dict[int, _Pending] = {}
        self.sel = selectors.DefaultSelector()
        for s in socks:
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, None)
        self.paused_until = 0.0                 # out of descriptors: the listeners rest until then
        self.backoff = 0.01
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="drafter-admission", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if self.paused_until and now >= self.paused_until:
                    self.paused_until = 0.0
                    for s in self.socks:
                        self.sel.register(s, selectors.EVENT_READ, None)
                wake = min([p.deadline for p in self.pending.values()] + [now + 0.5]
                           + ([self.paused_until] if self.paused_until else []))
                for key, _ in self.sel.select(max(wake - now, 0.0)):
                    if key.data is None:
                        self._accept(key.fileobj)      # type: ignore[arg-type]
                        continue
                    got = self.pending.get(key.data.sock.fileno())
                    if got is not None and got is key.data:     # not dropped meanwhile
                        self._read(got)
                now = time.monotonic()
                for p in [p for p in self.pending.values() if p.deadline <= now]:
                    self._drop(p, "stalled")
        finally:
            for p in list(self.pending.values()):
                self._drop(p, None)
            self.sel.close()

    def _accept(self, lsock: socket.socket) -> None:
        for _ in range(64):                       # then serve the pending ones' bytes too
            try:
                conn, addr = lsock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _FD_ERRORS:
                    # out of descriptors: free the least far pending one, else rest the listeners a while
                    self.stats.reject("descriptors")
                    if self.pending:
                        self._drop(min(self.pending.values(), key=lambda p: p.order), "evicted")
                    else:
                        self._pause()
                return                            # ECONNABORTED and the like: that connection only
            self.backoff = 0.01
            conn.setblocking(False)
            now = time.monotonic()
            leg = self.limits.leg_s(conn)
            p = _Pending(conn, str(addr[0]), now, now + leg, leg, ServerHandshake(self.ident, self.rank, self.world))
            self.pending[conn.fileno()] = p
            self.sel.register(conn, selectors.EVENT_READ, p)
            self._read(p)                         # a real peer's hello is already here: it counts for the order
            self._make_room(p.source)

    def _make_room(self, source: str) -> None:
        mine = [p for p in self.pending.values() if p.source == source]
        while len(mine) > self.limits.pending_per_source:
            out = min(mine, key=lambda p: p.order)
            mine.remove(out)
            self._drop(out, "evicted")
        while len(self.pending) > self.limits.pending_total:
            self._drop(min(self.pending.values(), key=lambda p: p.order), "evicted")

    def _pause(self) -> None:
        if not self.paused_until:
            for s in self.socks:
                self.sel.unregister(s)
        self.paused_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 1.0)

    def _read(self, p: _Pending) -> None:
        try:
            while p.hs.session is None:
                data = p.sock.recv(p.hs.want)        # no further: what follows the handshake is a frame
                if not data:
                    raise AuthError("handshake", "closed during the handshake")
                reply = p.hs.feed(data)
                if reply:
                    if p.sock.send(reply) != len(reply):     # a fresh socket's buffer holds a hello
                        raise AuthError("handshake", "the reply did not fit the socket's buffer")
                    p.deadline = time.monotonic() + p.leg
        except BlockingIOError:
            return
        except AuthError as exc:
            self._drop(p, exc.cause)
            return
        except OSError:
            self._drop(p, "handshake")
            return
        del self.pending[p.sock.fileno()]
        self.sel.unregister(p.sock)
        p.sock.setblocking(True)
        self.on_session(p.sock, p.hs.session)

    def _drop(self, p: _Pending, cause: str | None) -> None:
        if cause is not None:
            self.stats.reject(cause)
        self.pending.pop(p.sock.fileno(), None)
        try:
            self.sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2.0)
