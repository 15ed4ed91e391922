"""A drafter's side of combining the replicas (drafter.fleet): what it sends each round, how it
applies a combined version, and how much of its work reached the exported model.

`Replicas.round(...)` runs between windows (the worker's housekeeping): every `combine_every_s`
it snapshots the trainable parameters and sends them with the window work done since the last
contribution; the coordinator averages instead and tells the worker to export. A combined version
is applied keeping the local progress made since the contribution it holds (`ModelSync`). Work
(seconds, samples) counts as reaching the export once a combined version holds it.

Engine AllReduce (spec.drafter.exchange.engine): drafter.ring_replicas.RingReplicas, the same
interface over drafter.allreduce; `make_replicas` picks by the fleet's configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import Combined
from spectrain_workloads.drafter.robust_combine import COMBINE_ADJUSTMENTS

FINAL_ROUND_S = 3.0              # at shutdown: how long the last round of combining may take


class ModelSync:
    """The worker's side of averaging: snapshots at each contribution, local progress kept on apply."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.anchor = self.snapshot()         # parameters at the last combined version (or start)
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        self.seq = 0

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def contribution(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.seq += 1
        snap = self.snapshot()
        self.sent[self.seq] = snap
        while len(self.sent) > 4:                   # rounds are seconds apart: older ones never come back
            del self.sent[min(self.sent)]
        return self.seq, snap

    @torch.no_grad()
    def apply(self, c: Combined, rank: int) -> None:
        base = self.sent.get(c.included.get(rank, -1), self.anchor)
        for n, p in self.params.items():
            if n in c.params:
                p.copy_(c.params[n].to(p.device, p.dtype) + (p - base[n]))
        self.anchor = {n: c.params[n].to(p.device, p.dtype).clone() for n, p in self.params.items() if n in c.params}
        for s in [s for s in self.sent if s <= c.included.get(rank, -1)]:
            del self.sent[s]


class Replicas:
    def __init__(self, fleet: Fleet, rank: int, log: Callable[..., None]) -> None:
        self.fleet, self.rank, self.log = fleet, rank, log
        self.sync: ModelSync | None = None
        self.work_ns = 0                      # window work (train, optimizer steps) not yet contributed
        self.work_total_s = 0.0               # window work contributed since this process started
        self.own_uncombined_s = 0.0           # coordinator: its own work no combined version holds yet
        self.own_uncombined_samples = 0
        self.samples_total = 0                # samples of that work
        self.export_samples_by_rank: dict[int, int] = {}   # coordinator: every rank's samples in the exports
        self.samples_at_contribution = 0
        self.pending: dict[int, tuple[float, int]] = {}    # contribution seq -> (work seconds, samples)
        self.version = 0                      # newest combined version applied
        self.work_s = 0.0                     # this rank's work held by a combined version
        self.samples = 0                      # and the samples it trained on
        self.export_work_by_rank: dict[int, float] = {}    # coordinator: every rank's work in the exports
        self._last_round = 0.0

    @property
    def joins_untrained(self) -> bool:
        """The coordinator combines from the start (the members' work reaches the export only through
        it); a member contributes once it has trained."""
        return self.fleet.is_coordinator

    @property
    def is_coordinator(self) -> bool:
        return self.fleet.is_coordinator

    def state_dict(self) -> dict[str, Any]:
        return {}          # the coordinator's versions are the worker's checkpoint versions

    def close(self) -> None:
        pass

    def start(self, model: torch.nn.Module, samples_trained: int, version: int,
              state: dict[str, Any] | None = None) -> None:
        """The trainer exists (fresh or resumed): track its parameters, ask for the newest version."""
        self.sync = ModelSync(model)
        self.fleet.expect(self.sync.params)           # what peers' weights and samples are checked against
        self.samples_at_contribution = samples_trained
        self.version = version if self.fleet.is_coordinator else 0
        self.fleet.hello()

    def round(self, samples_trained: int, next_version: int, *, force: bool = False) -> Combined | None:
        """Contribute when a round is due, apply what arrived; the coordinator's combined version
        (to export as `next_version`) is returned."""
        assert self.sync is not None
        fleet, made = self.fleet, None
        if force or time.monotonic() - self._last_round >= fleet.cfg.combine_every_s:
            self._last_round = time.monotonic()
            work_s, self.work_ns = self.work_ns / 1e9, 0
            samples = samples_trained - self.samples_at_contribution
            self.work_total_s += work_s
            self.samples_total += samples
            seq, params = self.sync.contribution()
            self.pending[seq] = (work_s, samples)
            self.samples_at_contribution = samples_trained
            if fleet.is_coordinator:
                self.own_uncombined_s += work_s       # a round nobody else joined leaves it for the next
                self.own_uncombined_samples += samples
                made = fleet.combine(params, seq, self.own_uncombined_s, next_version, self.own_uncombined_samples)
                if made is not None:
                    self.own_uncombined_s, self.own_uncombined_samples = 0.0, 0
                    self._apply(made)
            else:
                fleet.contribute(seq, params, self.work_total_s, self.samples_total)
        c = fleet.take_combined()
        if c is not None and not fleet.is_coordinator and c.version > self.version:
            if fleet.accept_update(c.params, self.sync.params):
                self._apply(c)
            else:
                fleet.refused_version(self.version)     # the coordinator's real versions are not held back
        fleet.resync()
        return made

    def final_round(self, samples_trained: int, next_version: int) -> Combined | None:
        """The job ended: members send their last work, the coordinator waits a moment for it and
        combines a last version, so the export holds the run's last seconds too."""
        if self.fleet.is_coordinator:
            self.fleet.await_round(FINAL_ROUND_S)
        made = self.round(samples_trained, next_version, force=True)
        if not self.fleet.is_coordinator:
            self.fleet.flush(FINAL_ROUND_S)
        return made

    def _apply(self, c: Combined) -> None:
        assert self.sync is not None
        self.sync.apply(c, self.rank)
        self.version = c.version
        mine = c.included.get(self.rank)
        # contribution `mine` carried every earlier one's progress too (a queued one it replaced)
        for s in [s for s in self.pending if mine is not None and s <= mine]:
            work_s, samples = self.pending.pop(s)
            self.work_s += work_s
            self.samples += samples
        for r, w in c.work_by_rank.items():          # coordinator only: what reached the export, by rank
            self.export_work_by_rank[r] = self.export_work_by_rank.get(r, 0.0) + w
        for r, n in c.samples_by_rank.items():
            self.export_samples_by_rank[r] = self.export_samples_by_rank.get(r, 0) + n
        self.log("combined", version=c.version, ranks=sorted(c.included), work_s=c.work_s)

    def summary(self) -> dict[str, Any]:
        st = self.fleet.stats.snapshot()
        rejected = dict(sorted(self.fleet.stats.rejected().items()))
        return {"fleetRole": "coordinator" if self.fleet.is_coordinator else "member",
                "combinedVersion": self.version, "combinedWorkSeconds": self.work_s, "combinedSamples": self.samples,
                "exportWorkSecondsByRank": {str(r): w for r, w in sorted(self.export_work_by_rank.items())},
                "exportSamplesByRank": {str(r): n for r, n in sorted(self.export_samples_by_rank.items())},
                "samplesShared": st.get("samples_shared", 0), "samplesFromPeers": st.get("samples_received", 0),
                "exchangeBytesSent": st.get("sent_bytes", 0), "exchangeBytesReceived": st.get("received_bytes", 0),
                "exchangeFramesDropped": st.get("dropped", 0) + st.get("inbox_dropped", 0),
                "exchangeRejected": sum(rejected.values()), "exchangeRejectedByCause": rejected,
                "weightFramesSent": st.get("weight_frames_sent", 0),
                "combineAdjustedByCause": {c: st.get(f"combine_{c}", 0) for c in COMBINE_ADJUSTMENTS}}


def make_replicas(fleet: Fleet, rank: int, log: Callable[..., None]) -> Any:
    """The replicas' side for the fleet's engine: Replicas (Star) or ring_replicas.RingReplicas (AllReduce)."""
    if fleet.star:
        return Replicas(fleet, rank, log)
    from spectrain_workloads.drafter.ring_replicas import RingReplicas

    return RingReplicas(fleet, rank, log)


__all__ = ["FINAL_ROUND_S", "ModelSync", "Replicas", "make_replicas"]
