"""The drafter fleet's weights through the star (engine Star): contributions, rounds, combined versions.

Weights (periodic model averaging with local progress kept, as in DiLoCo with an outer learning
rate of 1): every `combine_every_s` each drafter sends its trainable parameters, tagged with a
sequence number and the window work since it started, to the coordinator (the exporting rank). The
coordinator averages its own parameters with the latest contribution of every rank heard from
since the last round, weighted by the work no earlier version holds (each rank's weight and update
bounded by drafter.robust_combine), into combined version v + 1, exports it, and sends it to every rank. A drafter that receives version v keeps what it learnt
after its contribution left:
    params <- combined_v + (params_now - params_at_send)
(or - params_at_last_combined when its contribution was not in the round). A drafter that starts
or restarts says hello and gets the latest combined version. A missing peer costs nothing: the
round goes on with whoever contributed, and the peer is taken back when it sends again.

Every weights frame is checked before use (drafter.checks): a combined version's signature by the
exporting rank's pod (`_signed`: over the job, generation, version and the payload's sha256, so it
holds whatever connection carried the version), the parameters against the local model's table, an
update no larger than checks.UPDATE_NORM_FACTOR allows, claimed work against wall time
(`_new_work`), a combined version only from the coordinator and at most a few versions ahead,
further only as the answer to this drafter's own hello (its nonce). With engine AllReduce none of
this runs: the weights go through drafter.allreduce (drafter.ring_replicas).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from spectrain_api.names import STAR
from spectrain_workloads.drafter import checks, robust_combine
from spectrain_workloads.drafter.auth import Identity, Session
from spectrain_workloads.drafter.fleet_records import (
    Combined,
    Contribution,
    Credit,
    FleetConfig,
    pack_params,
    unpack_params,
)
from spectrain_workloads.drafter.identity import SIG_BYTES, version_digest
from spectrain_workloads.drafter.links import Frame, Link, Rejected, Stats

WORK_SLACK_S = 2.0               # + one round: a contribution may lag the work it holds by a round (queues)
HELLO_REANSWER_S = 1.0           # a new connection of a rank may get the same version again after this
HELLO_NONCES = 4                 # recent hellos whose answers this drafter takes as replies


class StarWeights:
    """The fleet's weight exchange (a part of drafter.fleet.Fleet, which sets these attributes)."""

    cfg: FleetConfig
    ident: Identity
    stats: Stats
    lock: threading.Lock
    contributed: threading.Condition                  # notified on every contribution
    members_seen: set[int]                            # coordinator: ranks that ever contributed
    contributions: dict[int, Contribution]            # coordinator: this round's, by rank
    credited: dict[int, Credit]                       # coordinator: work already in a combined version
    incarnation: str
    combined_in: Combined | None
    newest: int
    latest: Combined | None
    answered: dict[int, tuple[str, int, float]]
    hello_nonces: collections.deque[str]
    want_hello: bool
    last_hello: float
    table: checks.ParamTable | None
    links: dict[int, Link]                            # by peer rank

    if TYPE_CHECKING:
        def _link(self, rank: int) -> Link: ...      # drafter.fleet.Fleet: the link to a peer

    @property
    def is_coordinator(self) -> bool:
        return self.cfg.rank == self.cfg.coordinator

    @property
    def star(self) -> bool:
        """The weights go through this fleet (engine Star), not through drafter.allreduce."""
        return self.cfg.engine == STAR
    def hello(self) -> None:
        """Ask the coordinator for its newest combined version (a drafter that (re)starts)."""
        if self.is_coordinator or not self.star:
            return
        nonce = os.urandom(16).hex()
        self.hello_nonces.append(nonce)
        self.last_hello, self.want_hello = time.monotonic(), False
        self._link(self.cfg.coordinator).send(Frame("hello", {"rank": self.cfg.rank, "nonce": nonce}, b""),
                                              latest_only=True)
        self.stats.add(weight_frames_sent=1)

    def resync(self) -> None:
        """Member, between rounds: a version too far ahead was refused: ask for the newest (once a round)."""
        if self.want_hello and time.monotonic() - self.last_hello >= self.cfg.combine_every_s:
            self.hello()

    def contribute(self, seq: int, params: dict[str, torch.Tensor], work_total_s: float, samples_total: int = 0) -> None:
        """This rank's parameters for the next round, with its window work (and the samples it
        trained on) since it started (the coordinator keeps its own in place)."""
        if self.is_coordinator or not self.star:
            return
        header = {"rank": self.cfg.rank, "seq": seq, "work_total_s": work_total_s, "samples_total": samples_total,
                  "incarnation": self.incarnation}
        self._link(self.cfg.coordinator).send(Frame("contrib", header, pack_params(params)), droppable=False,
                                              latest_only=True)
        self.stats.add(weight_frames_sent=1)

    def accept_update(self, new: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> bool:
        """Weights to apply are no larger an update than checks.UPDATE_NORM_FACTOR allows (counted if not)."""
        if set(new) != set(local):
            self.stats.reject("keys")
            return False
        if not checks.update_ok(new, local):
            self.stats.reject("update_norm")
            return False
        return True

    def refused_version(self, applied: int) -> None:
        """Member: a combined version failed its checks on apply; the newest one held is `applied` again."""
        with self.lock:
            self.newest = applied

    def combine(self, own: dict[str, torch.Tensor], own_seq: int, own_work_s: float,
                version: int, own_samples: int = 0) -> Combined | None:
        """Coordinator: average its own parameters with every contribution of this round into
        `version`, weighted by the window work each holds (a rank that could not train does not
        dilute the others' progress; outliers and weights bounded by drafter.robust_combine), and send it to every rank. None when no other rank
        contributed or nobody worked."""
        with self.lock:
            round_, self.contributions = self.contributions, {}
        round_ = {r: c for r, c in round_.items() if self.accept_update(c.params, own)}
        new = {r: self._new_work(r, c) for r, c in round_.items()}      # not yet in any version
        work = {r: w for r, (w, _) in new.items()}
        total = own_work_s + sum(work.values())
        if not round_ or total <= 0:
            if round_:   # nobody worked: the contributions wait for the next round, nothing is lost
                with self.lock:
                    self.contributions = {**round_, **self.contributions}
            return None
        for r, c in round_.items():
            prev = self.credited.get(r)
            same = prev is not None and prev.incarnation == c.incarnation
            self.credited[r] = Credit(c.incarnation, (prev.work_s if same and prev else 0.0) + new[r][0],
                                       (prev.samples if same and prev else 0) + new[r][1], c.received_at)
        me = self.cfg.rank
        credited = {me: own_work_s, **work}
        parts, clipped = robust_combine.clip_outliers({me: own, **{r: c.params for r, c in round_.items()}},
                                                      credited, trusted=me)
        weights, capped = robust_combine.cap_weights(credited, trusted=me)
        self.stats.add(combine_outlier_clipped=len(clipped), combine_weight_capped=len(capped))
        params = robust_combine.weighted_average(parts, weights, own)
        included = {self.cfg.rank: own_seq, **{r: c.seq for r, c in round_.items()}}
        combined = Combined(version, params, included, total, {self.cfg.rank: own_work_s, **work},
                            {self.cfg.rank: own_samples, **{r: n for r, (_, n) in new.items()}})
        self.latest = combined
        self._broadcast(combined, range(self.cfg.world))
        return combined

    def _new_work(self, rank: int, c: Contribution) -> tuple[float, int]:
        """The part of a contribution's cumulative (work seconds, samples) no combined version holds
        yet, credited at most at the rate of wall time (the rest waits for later rounds)."""
        prev = self.credited.get(rank)
        same = prev is not None and prev.incarnation == c.incarnation
        work = c.work_total_s - (prev.work_s if same and prev else 0.0)
        samples = c.samples_total - (prev.samples if same and prev else 0)
        # the rank's previous credited contribution, whichever process sent it: a fresh incarnation
        # per frame restarts the totals, not the clock
        since = prev.at if prev is not None else c.session_started
        limit = checks.credit_limit_s(c.received_at, since, self.cfg.combine_every_s + WORK_SLACK_S)
        if work > limit:
            self.stats.add(combine_work_capped=1)
            samples, work = int(samples * limit / work), limit
        return max(work, 0.0), max(samples, 0)

    def await_round(self, timeout_s: float) -> None:
        """Coordinator at shutdown: wait (at most `timeout_s`) for a contribution from every rank
        that ever contributed, so the last round holds everyone's last work."""
        with self.contributed:
            self.contributed.wait_for(lambda: self.members_seen <= set(self.contributions), timeout_s)

    def flush(self, timeout_s: float) -> None:
        """Member at shutdown: give the queued frames (its last contribution) time to leave."""
        for link in list(self.links.values()):
            link.drain(timeout_s)

    def _broadcast(self, c: Combined, ranks: Any, reply: str | None = None) -> None:
        if not self.star:
            return
        payload = pack_params(c.params)
        header = {"version": c.version, "included": {str(r): s for r, s in c.included.items()}, "work_s": c.work_s,
                  **self._signature(c.version, payload)}
        frame = Frame("combined", header if reply is None else {**header, "reply": reply}, payload)
        for r in ranks:
            if r != self.cfg.rank:
                # not recorded in `answered`: a round's broadcast is no answer to a hello (a
                # restarted member refuses a version far ahead of its own unless it answers its hello)
                self._link(r).send(frame, droppable=False, latest_only=True)
                self.stats.add(weight_frames_sent=1)

    def _signature(self, version: int, payload: bytes) -> dict[str, str]:
        """The exporting rank's signature of a combined version, a header field (none in the MAC-less
        bench mode): one Ed25519 signature and one sha256 of the payload per version."""
        pod = self.ident.pod
        if pod is None:
            return {}
        return {"signature": pod.sign(version_digest(self.cfg.job_uid, self.cfg.generation, version, payload)).hex()}

    def _signed(self, header: Mapping[str, Any], version: int, payload: bytes | bytearray) -> None:
        """A combined version signed by the exporting rank's pod, else Rejected "signature" (before its
        payload is parsed)."""
        pod = self.ident.pod
        if pod is None:
            return
        sig = header.get("signature")
        if not isinstance(sig, str) or len(sig) != 2 * SIG_BYTES:
            raise Rejected("signature", "no signature of the exporting rank")
        try:
            raw = bytes.fromhex(sig)
        except ValueError:
            raise Rejected("signature", "the signature is not hex") from None
        if not pod.verify(self.cfg.coordinator, raw, version_digest(self.cfg.job_uid, self.cfg.generation, version,
                                                                    payload)):
            raise Rejected("signature", f"not signed by the pod of the exporting rank {self.cfg.coordinator}")

    def take_combined(self) -> Combined | None:
        with self.lock:
            c, self.combined_in = self.combined_in, None
        return c

    def _weights(self, f: Frame) -> dict[str, torch.Tensor]:
        assert self.table is not None
        try:
            params = unpack_params(bytes(f.payload))
        except Exception:           # safetensors' own parser refused it
            raise Rejected("malformed", "weights are not safetensors") from None
        if self.cfg.trust:
            checks.check_weights(params, self.table)
        return params

    def _on_contrib(self, f: Frame, peer: Session) -> None:
        h = f.header
        seq = checks.field(h, "seq", int, low=0)
        work = checks.field(h, "work_total_s", float, low=0.0)
        samples = checks.field(h, "samples_total", int, low=0)
        c = Contribution(seq, self._weights(f), work, checks.incarnation(h), samples, time.monotonic(), peer.started)
        latest = self.latest     # members are pulled back to it every round: refuse a far one now, not at the round
        if latest is not None and not checks.update_ok(c.params, latest.params):
            raise Rejected("update_norm", "too far from the newest combined version")
        with self.lock:
            self.contributions[peer.peer_rank] = c
            self.members_seen.add(peer.peer_rank)
            self.contributed.notify_all()
        self.stats.add(contributions_received=1)

    def _on_combined(self, f: Frame) -> None:
        h = f.header
        included = h.get("included")
        if not isinstance(included, dict) or not all(isinstance(s, int) and str(r).isdigit() for r, s in included.items()):
            raise Rejected("header", "included is not rank -> seq")
        version = checks.field(h, "version", int, low=1)
        self._signed(h, version, f.payload)
        c = Combined(version, self._weights(f), {int(r): s for r, s in included.items()},
                     checks.field(h, "work_s", float, low=0.0))
        with self.lock:
            if not checks.version_ok(c.version, self.newest, reply=h.get("reply") in self.hello_nonces):
                raise Rejected("version", "not newer than what arrived meanwhile")
            self.combined_in, self.newest = c, c.version

    def _on_hello(self, f: Frame, peer: Session) -> None:
        nonce = checks.field(f.header, "nonce", str)
        if len(nonce) > 64:
            raise Rejected("header", "nonce too long")
        latest, r = self.latest, peer.peer_rank
        if latest is None:
            return
        prev = self.answered.get(r)
        # one answer per version per connection of a rank (a hello flood costs one weights frame per
        # version), and a new connection (a restarted drafter) of it at most every HELLO_REANSWER_S
        if prev is not None and prev[1] == latest.version and (
                prev[0] == peer.id or time.monotonic() - prev[2] < HELLO_REANSWER_S):
            self.stats.add(hello_unanswered=1)
            return
        self._broadcast(latest, [r], reply=nonce)
        self.answered[r] = (peer.id, latest.version, time.monotonic())
