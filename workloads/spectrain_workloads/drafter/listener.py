"""The listening side of the drafters' links: authenticated frames in, to one receiver.

Built to survive its peers: at most `max_conns` connections (more are closed at once), a
handshake (drafter.auth) within HANDSHAKE_TIMEOUT_S, a started frame finished within
FRAME_STALL_S, a per-kind payload cap checked (with the header's MAC) before the payload is
buffered, frames the receiver does not take read past without keeping (or hashing) them, payload
MACs of the kinds the receiver defers checked only when it uses the payload, and an accept loop
that outlives running out of file descriptors (it frees one held by a connection that never
authenticated, else backs off). What fails is counted by cause (`Stats.reject`) and ends at most
its own connection; nothing a frame does leaves its reader thread.
"""

from __future__ import annotations

import errno
import functools
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from spectrain_workloads.drafter.auth import (
    HANDSHAKE_TIMEOUT_S,
    KIND_NAMES,
    PREFIX,
    AuthError,
    Identity,
    Session,
    server_handshake,
)
from spectrain_workloads.drafter.links import CHUNK, Frame, Rejected, Stats

MAX_HEADER_BYTES = 1 << 20       # JSON headers: a combined version's `included` holds every rank
FRAME_STALL_S = 5.0              # a frame started but not finished within this is dropped, its connection closed
_FD_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Receiver(Protocol):
    """What a Server hands frames to (drafter.fleet.Fleet)."""

    def cap(self, kind: str) -> int: ...                                    # largest payload accepted
    def admit(self, kind: str, header: dict[str, Any], peer: Session) -> str | None: ...   # cause to skip
    def handle(self, frame: Frame, peer: Session) -> None: ...              # may raise Rejected
    def defer(self, kind: str) -> bool: ...       # payload MAC checked by the receiver on use (Frame.verify)


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False when the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            return False
        got += n
    return True


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if not _recv_into(sock, memoryview(buf)):
        raise ConnectionError("closed inside a frame")
    return bytes(buf)


@dataclass
class _Conn:
    sock: socket.socket
    opened: float
    session: Session | None = None


class Server:
    """Accepts peers' connections on every address of `binds` (one port); each authenticated
    frame goes to `receiver`."""

    def __init__(self, binds: list[tuple[str, int]], receiver: Receiver, stats: Stats, *, ident: Identity,
                 rank: int, world: int, max_conns: int) -> None:
        self.receiver, self.stats, self.ident = receiver, stats, ident
        self.rank, self.world, self.max_conns = rank, world, max_conns
        self.socks = [socket.create_server(b, family=socket.AF_INET6 if ":" in b[0] else socket.AF_INET)
                      for b in binds]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.conns: dict[int, _Conn] = {}
        self.threads = [threading.Thread(target=self._accept, args=(s,), name="drafter-server", daemon=True)
                        for s in self.socks]
        for s, t in zip(self.socks, self.threads, strict=True):
            s.settimeout(0.5)
            t.start()

    @property
    def port(self) -> int:
        return int(self.socks[0].getsockname()[1])

    def _accept(self, lsock: socket.socket) -> None:
        backoff = 0.01
        while not self.stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stop.is_set() or lsock.fileno() < 0:
                    return
                if exc.errno in _FD_ERRORS:
                    # out of descriptors: free one held by a connection that never authenticated,
                    # else wait for one to end; either way keep accepting
                    self.stats.reject("descriptors")
                    if not self._evict_pending():
                        self.stop.wait(backoff)
                        backoff = min(backoff * 2, 1.0)
                continue            # ECONNABORTED and the like: that connection only
            backoff = 0.01
            with self.lock:
                full = len(self.conns) >= self.max_conns
                if not full:
                    self.conns[conn.fileno()] = _Conn(conn, time.monotonic())
            if full:
                self.stats.reject("connections")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="drafter-reader", daemon=True).start()

    def _evict_pending(self) -> bool:
        with self.lock:
            pending = [c for c in self.conns.values() if c.session is None]
            oldest = min(pending, key=lambda c: c.opened, default=None)
        if oldest is None:
            return False
        try:
            oldest.sock.shutdown(socket.SHUT_RDWR)      # its reader closes it (and frees the descriptor)
        except OSError:
            pass
        return True

    def _serve(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            session = server_handshake(conn, self.ident, self.rank, self.world)
            with self.lock:
                self.conns[fd].session = session
            self.stats.add(sessions=1)
            self._frames(conn, session)
        except AuthError as exc:
            self.stats.reject(exc.cause)
        except Rejected as exc:
            self.stats.reject(exc.cause)
        except TimeoutError:
            self.stats.reject("stalled")
        except (OSError, ConnectionError):
            pass            # a broken peer: its frames stop here, nothing else does
        except Exception:   # anything else a peer's bytes cause ends its connection, counted, never the thread
            self.stats.reject("malformed")
        finally:
            with self.lock:
                self.conns.pop(fd, None)
            conn.close()

    def _frames(self, conn: socket.socket, session: Session) -> None:
        prefix = bytearray(PREFIX.size)
        while not self.stop.is_set():
            conn.settimeout(None)                      # between frames a link may be quiet for long
            if conn.recv_into(prefix, 1) == 0:
                return
            conn.settimeout(FRAME_STALL_S)             # inside one, a stall is a broken or hostile peer
            if not _recv_into(conn, memoryview(prefix)[1:]):
                return
            _seq, code, n_head, n_payload = PREFIX.unpack(prefix)
            kind = KIND_NAMES.get(code)
            if kind is None:
                raise Rejected("kind", f"unknown frame kind {code}")
            if n_head > MAX_HEADER_BYTES or n_payload > self.receiver.cap(kind):
                raise Rejected("oversize", f"{kind} of {n_head} + {n_payload} bytes")
            head = _recv(conn, n_head)
            tag_h = _recv(conn, session.tag_bytes)
            session.check_header(bytes(prefix), head, tag_h)
            try:
                header = json.loads(head)
            except ValueError:
                raise Rejected("malformed", "header is not JSON") from None
            if not isinstance(header, dict):
                raise Rejected("malformed", "header is not an object")
            skip = self.receiver.admit(kind, header, session)
            if skip is not None:                       # authenticated but unwanted: read past it, keep nothing
                for left in range(n_payload + session.tag_bytes, 0, -CHUNK):
                    _recv(conn, min(left, CHUNK))
                self.stats.reject(skip)
                continue
            payload = bytearray(n_payload)
            if not _recv_into(conn, memoryview(payload)):
                return
            tag_p = _recv(conn, session.tag_bytes)
            frame = Frame(kind, header, payload)
            if self.receiver.defer(kind):              # verified when taken: most samples at the cap never are
                frame.verify = functools.partial(session.payload_ok, tag_h, payload, tag_p)
            elif not session.payload_ok(tag_h, payload, tag_p):
                raise Rejected("mac", "payload MAC does not verify")
            self.stats.add(received=1, received_bytes=n_payload)
            try:
                self.receiver.handle(frame, session)
            except Rejected as exc:
                self.stats.reject(exc.cause)
            except Exception:      # whatever a frame does, it ends here: counted, the reader goes on
                self.stats.reject("malformed")

    def close(self) -> None:
        self.stop.set()
        for s in self.socks:
            s.close()
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(timeout=2.0)
