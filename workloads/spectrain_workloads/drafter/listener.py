"""The listening side of the drafters' links: authenticated frames in, to one receiver.

Built to survive its peers: connections are admitted by drafter.admission (a budget of pending
connections per source address and in total, the least far closed first, a handshake deadline of
one round trip per message, descriptors freed when they run out); after the handshake one session
per rank (a new authenticated connection of a rank replaces its older one, counted `replaced`), a
session quiet for `Limits.idle_s` closed (`sessions_idle`, not a refusal), a started frame
finished within FRAME_STALL_S, a per-kind payload cap checked (with the header's MAC) before the
payload is buffered, frames the receiver does not take read past without keeping (or hashing)
them, and payload MACs of the kinds the receiver defers checked only when it uses the payload.
What fails is counted by cause (`Stats.reject`) and ends at most its own connection; nothing a
frame does leaves its reader thread.
"""

from __future__ import annotations

import functools
import json
import socket
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from spectrain_workloads.drafter.admission import Admission, Limits
from spectrain_workloads.drafter.auth import KIND_NAMES, PREFIX, AuthError, Identity, Session
from spectrain_workloads.drafter.links import CHUNK, Frame, Rejected, Stats

MAX_HEADER_BYTES = 1 << 20       # JSON headers: a combined version's `included` holds every rank
FRAME_STALL_S = 5.0              # a frame started but not finished within this is dropped, its connection closed


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
    session: Session


class Server:
    """Accepts peers' connections on every address of `binds` (one port); each authenticated
    frame goes to `receiver`."""

    def __init__(self, binds: list[tuple[str, int]], receiver: Receiver, stats: Stats, *, ident: Identity,
                 rank: int, world: int, limits: Limits) -> None:
        self.receiver, self.stats, self.limits = receiver, stats, limits
        self.socks = [socket.create_server(b, family=socket.AF_INET6 if ":" in b[0] else socket.AF_INET)
                      for b in binds]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sessions: dict[int, _Conn] = {}              # by the peer's rank: one each
        self.admission = Admission(self.socks, ident=ident, rank=rank, world=world, limits=limits, stats=stats,
                                   on_session=self._session)

    @property
    def port(self) -> int:
        return int(self.socks[0].getsockname()[1])

    def _session(self, conn: socket.socket, session: Session) -> None:
        """A peer authenticated: its rank's older session (a restarted peer, or one parked by whoever
        holds the key) is closed, and a reader takes this one."""
        entry = _Conn(conn, session)
        with self.lock:
            old = self.sessions.get(session.peer_rank)
            self.sessions[session.peer_rank] = entry
        if old is not None:
            self.stats.reject("replaced")
            try:
                old.sock.shutdown(socket.SHUT_RDWR)      # its reader closes it
            except OSError:
                pass
        self.stats.add(sessions=1)
        threading.Thread(target=self._serve, args=(entry,), name="drafter-reader", daemon=True).start()

    def _serve(self, entry: _Conn) -> None:
        conn, session = entry.sock, entry.session
        try:
            self._frames(conn, session)
        except (AuthError, Rejected) as exc:
            self.stats.reject(exc.cause)
        except TimeoutError:
            self.stats.reject("stalled")
        except (OSError, ConnectionError):
            pass            # a broken peer: its frames stop here, nothing else does
        except Exception:   # anything else a peer's bytes cause ends its connection, counted, never the thread
            self.stats.reject("malformed")
        finally:
            with self.lock:
                if self.sessions.get(session.peer_rank) is entry:
                    del self.sessions[session.peer_rank]
            conn.close()

    def _frames(self, conn: socket.socket, session: Session) -> None:
        prefix = bytearray(PREFIX.size)
        while not self.stop.is_set():
            conn.settimeout(self.limits.idle_s)        # between frames: a few rounds at most
            try:
                if conn.recv_into(prefix, 1) == 0:
                    return
            except TimeoutError:               # not a refusal: its link reconnects when it has a frame again
                self.stats.add(sessions_idle=1)
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
        self.admission.close()
        for s in self.socks:
            s.close()
        with self.lock:
            conns = list(self.sessions.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
