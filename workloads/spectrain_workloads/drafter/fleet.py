"""The drafters of a job as one fleet: samples reach every rank, and one model is made of all.

Ranks are the target's: rank r is pipeline stage r % P of data-parallel replica r // P.

Samples. Only the last stage's ring carries hidden states. Its drafter forwards every sequence it
reads (already a uniform sample of each microbatch, `SPECTRAIN_PUBLISH_FRACTION`) to the drafters
of the other P - 1 stages of its replica, so every stage trains on a uniform sample of the global
batch. Frames are droppable: past the bandwidth cap or a slow receiver's queue they are dropped
(counted), never queued without bound; a receiver keeps at most `inbox_bytes` not yet taken.

Weights (periodic model averaging with local progress kept, as in DiLoCo with an outer learning
rate of 1): every `combine_every_s` each drafter sends its trainable parameters, tagged with a
sequence number and the window work since it started, to the coordinator (the exporting rank). The
coordinator averages its own parameters with the latest contribution of every rank heard from
since the last round, weighted by the work no earlier version holds, into combined version v + 1,
exports it, and sends
it to every rank. A
drafter that receives version v keeps what it learnt after its contribution left:
    params <- combined_v + (params_now - params_at_send)
(or - params_at_last_combined when its contribution was not in the round). A drafter that starts
or restarts says hello and gets the latest combined version. A missing peer costs nothing: the
round goes on with whoever contributed, and the peer is taken back when it sends again.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from spectrain_workloads.drafter.links import Frame, Link, Server, Stats, TokenBucket
from spectrain_workloads.errors import ConfigError

PEERS_ENV = "SPECTRAIN_DRAFTER_PEERS"
BIND_ENV = "SPECTRAIN_DRAFTER_BIND"


def parse_peers(text: str, world: int, local_world: int) -> list[tuple[str, int]]:
    """Address of every rank from `host:port` per node (local rank i listens on port + i)."""
    nodes = [p.strip() for p in text.split(",") if p.strip()]
    if len(nodes) * local_world != world:
        raise ConfigError(f"{PEERS_ENV} lists {len(nodes)} nodes x {local_world} local ranks, but WORLD_SIZE is "
                          f"{world}: one host:port per node (the operator sets it)")
    out = []
    for n in nodes:
        host, _, port = n.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{PEERS_ENV}: {n!r} is not host:port")
        out += [(host, int(port) + i) for i in range(local_world)]
    return out


@dataclass
class Combined:
    version: int
    params: dict[str, torch.Tensor]
    included: dict[int, int]           # rank -> sequence number of the contribution averaged in
    work_s: float                      # window work in this version, over every contribution
    work_by_rank: dict[int, float] = field(default_factory=dict)   # coordinator only: each rank's part
    samples_by_rank: dict[int, int] = field(default_factory=dict)  # coordinator only: the samples of that work


@dataclass
class _Contribution:
    seq: int
    params: dict[str, torch.Tensor]
    work_total_s: float               # the sender's window work since it started (cumulative)
    incarnation: str = ""             # the sender process: a restarted drafter counts from 0 again
    samples_total: int = 0            # the samples that work trained on (cumulative)


@dataclass
class FleetConfig:
    rank: int
    world: int
    pipeline: int
    coordinator: int
    addresses: list[tuple[str, int]]
    bind_host: str = "0.0.0.0"
    bandwidth_bytes_per_s: float = 64e6
    combine_every_s: float = 10.0
    max_queue_bytes: int = 8 << 20
    inbox_bytes: int = 64 << 20
    sample_ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sample_ranks and self.rank % self.pipeline == self.pipeline - 1:
            base = self.rank - self.pipeline + 1
            self.sample_ranks = [base + s for s in range(self.pipeline - 1)]


class Fleet:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.bucket = TokenBucket(cfg.bandwidth_bytes_per_s, max(cfg.bandwidth_bytes_per_s * 0.25, 1 << 16))
        self.lock = threading.Lock()
        self.contributed = threading.Condition(self.lock)
        self.members_seen: set[int] = set()            # coordinator: ranks that ever contributed
        self.inbox: collections.deque[tuple[torch.Tensor, torch.Tensor | None, int, int]] = collections.deque()
        self.inbox_bytes = 0
        self.contributions: dict[int, _Contribution] = {}
        # coordinator: per rank, (incarnation, work total) already counted in a combined version. A
        # contribution carries the sender's cumulative work, so one replaced in a send queue or
        # overwritten by a newer one before a round loses no work: the newer total holds it.
        self.credited: dict[int, tuple[str, float, int]] = {}
        self.incarnation = f"{os.getpid()}-{time.monotonic_ns()}"
        self.combined_in: Combined | None = None       # the newest combined version not yet applied
        self.latest: Combined | None = None            # coordinator: the newest combined version
        self.links: dict[int, Link] = {}
        self.server = Server((cfg.bind_host, cfg.addresses[cfg.rank][1]), self._on_frame, self.stats)

    @property
    def is_coordinator(self) -> bool:
        return self.cfg.rank == self.cfg.coordinator

    def _link(self, rank: int) -> Link:
        if rank not in self.links:
            self.links[rank] = Link(self.cfg.addresses[rank], self.bucket, max_queue_bytes=self.cfg.max_queue_bytes,
                                    stats=self.stats)
        return self.links[rank]

    # ------------------------------------------------------------ samples
    def share(self, tokens: torch.Tensor, hidden: torch.Tensor | None, step: int) -> None:
        """Forward one sequence (tokens [T] int64, hidden [T, H] in the target's dtype, as the ring
        carries it) to the stages without data."""
        if not self.cfg.sample_ranks:
            return
        arrays = [tokens.to(torch.int64).contiguous()]
        if hidden is not None:
            arrays.append(hidden.contiguous())
        header = {"rank": self.cfg.rank, "step": step, "shapes": [list(a.shape) for a in arrays],
                  "dtypes": [str(a.dtype).removeprefix("torch.") for a in arrays]}
        frame = Frame("sample", header, b"".join(_raw(a) for a in arrays))
        for r in self.cfg.sample_ranks:
            self._link(r).send(frame)
        self.stats.add(samples_shared=1)

    def take_samples(self, limit: int) -> list[tuple[torch.Tensor, torch.Tensor | None, int, int]]:
        """Up to `limit` received sequences: (tokens [T], hidden [T, H] or None, step, from rank)."""
        out: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []
        with self.lock:
            while self.inbox and len(out) < limit:
                item = self.inbox.popleft()
                self.inbox_bytes -= _nbytes(item[0], item[1])
                out.append(item)
        return out

    def _on_sample(self, f: Frame) -> None:
        arrays, offset = [], 0
        for shape, dtype in zip(f.header["shapes"], f.header["dtypes"], strict=True):
            dt = getattr(torch, dtype)
            n = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
            arrays.append(torch.frombuffer(bytearray(f.payload[offset:offset + n]), dtype=dt).reshape(shape))
            offset += n
        tokens, hidden = arrays[0], (arrays[1] if len(arrays) > 1 else None)
        size = len(f.payload)
        with self.lock:
            while self.inbox and self.inbox_bytes + size > self.cfg.inbox_bytes:
                old = self.inbox.popleft()     # the oldest goes: fresher samples track the target better
                self.inbox_bytes -= _nbytes(old[0], old[1])
                self.stats.add(inbox_dropped=1)
            self.inbox.append((tokens, hidden, int(f.header["step"]), int(f.header["rank"])))
            self.inbox_bytes += size
        self.stats.add(samples_received=1)

    # ------------------------------------------------------------ weights
    def hello(self) -> None:
        """Ask the coordinator for its newest combined version (a drafter that (re)starts)."""
        if not self.is_coordinator:
            self._link(self.cfg.coordinator).send(Frame("hello", {"rank": self.cfg.rank}, b""), latest_only=True)

    def contribute(self, seq: int, params: dict[str, torch.Tensor], work_total_s: float, samples_total: int = 0) -> None:
        """This rank's parameters for the next round, with its window work (and the samples it
        trained on) since it started (the coordinator keeps its own in place)."""
        if self.is_coordinator:
            return
        header = {"rank": self.cfg.rank, "seq": seq, "work_total_s": work_total_s, "samples_total": samples_total,
                  "incarnation": self.incarnation}
        self._link(self.cfg.coordinator).send(Frame("contrib", header, _pack(params)), droppable=False,
                                              latest_only=True)

    def combine(self, own: dict[str, torch.Tensor], own_seq: int, own_work_s: float,
                version: int, own_samples: int = 0) -> Combined | None:
        """Coordinator: average its own parameters with every contribution of this round into
        `version`, weighted by the window work each holds (a rank that could not train does not
        dilute the others' progress), and send it to every rank. None when no other rank
        contributed or nobody worked."""
        with self.lock:
            round_, self.contributions = self.contributions, {}
        new = {r: self._new_work(r, c) for r, c in round_.items()}      # not yet in any version
        work = {r: w for r, (w, _) in new.items()}
        total = own_work_s + sum(work.values())
        if not round_ or total <= 0:
            if round_:   # nobody worked: the contributions wait for the next round, nothing is lost
                with self.lock:
                    self.contributions = {**round_, **self.contributions}
            return None
        for r, c in round_.items():
            self.credited[r] = (c.incarnation, c.work_total_s, c.samples_total)
        weights = [own_work_s / total, *(work[r] / total for r in round_)]
        parts = [own, *(c.params for c in round_.values())]
        params = {n: torch.stack([w * p[n].to(own[n].device, torch.float32) for w, p in zip(weights, parts, strict=True)])
                  .sum(0).to(own[n].dtype) for n in own}
        included = {self.cfg.rank: own_seq, **{r: c.seq for r, c in round_.items()}}
        combined = Combined(version, params, included, total, {self.cfg.rank: own_work_s, **work},
                            {self.cfg.rank: own_samples, **{r: n for r, (_, n) in new.items()}})
        self.latest = combined
        self._broadcast(combined, range(self.cfg.world))
        return combined

    def _new_work(self, rank: int, c: _Contribution) -> tuple[float, int]:
        """The part of a contribution's cumulative (work seconds, samples) no combined version holds yet."""
        incarnation, work, samples = self.credited.get(rank, ("", 0.0, 0))
        if incarnation != c.incarnation:
            return c.work_total_s, c.samples_total
        return c.work_total_s - work, c.samples_total - samples

    def await_round(self, timeout_s: float) -> None:
        """Coordinator at shutdown: wait (at most `timeout_s`) for a contribution from every rank
        that ever contributed, so the last round holds everyone's last work."""
        with self.contributed:
            self.contributed.wait_for(lambda: self.members_seen <= set(self.contributions), timeout_s)

    def flush(self, timeout_s: float) -> None:
        """Member at shutdown: give the queued frames (its last contribution) time to leave."""
        for link in list(self.links.values()):
            link.drain(timeout_s)

    def _broadcast(self, c: Combined, ranks: Any) -> None:
        frame = Frame("combined", {"version": c.version, "included": {str(r): s for r, s in c.included.items()},
                                   "work_s": c.work_s}, _pack(c.params))
        for r in ranks:
            if r != self.cfg.rank:
                self._link(r).send(frame, droppable=False, latest_only=True)

    def take_combined(self) -> Combined | None:
        with self.lock:
            c, self.combined_in = self.combined_in, None
        return c

    def _on_frame(self, f: Frame) -> None:
        if f.kind == "sample":
            self._on_sample(f)
        elif f.kind == "contrib" and self.is_coordinator:
            with self.lock:
                rank = int(f.header["rank"])
                self.contributions[rank] = _Contribution(int(f.header["seq"]), _unpack(f.payload),
                                                         float(f.header["work_total_s"]), str(f.header["incarnation"]),
                                                         int(f.header.get("samples_total", 0)))
                self.members_seen.add(rank)
                self.contributed.notify_all()
            self.stats.add(contributions_received=1)
        elif f.kind == "combined":
            c = Combined(int(f.header["version"]), _unpack(f.payload),
                         {int(r): int(s) for r, s in f.header["included"].items()}, float(f.header["work_s"]))
            with self.lock:
                if self.combined_in is None or c.version > self.combined_in.version:
                    self.combined_in = c
        elif f.kind == "hello" and self.is_coordinator and self.latest is not None:
            self._broadcast(self.latest, [int(f.header["rank"])])

    def close(self) -> None:
        self.server.close()
        for link in self.links.values():
            link.close()


def _nbytes(tokens: torch.Tensor, hidden: torch.Tensor | None) -> int:
    return tokens.nbytes + (0 if hidden is None else hidden.nbytes)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (bf16 through an int16 view: numpy has no bfloat16)."""
    t = t.detach().to("cpu")
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _pack(params: dict[str, torch.Tensor]) -> bytes:
    return st_save({n: p.detach().to("cpu").contiguous() for n, p in params.items()})


def _unpack(data: bytes) -> dict[str, torch.Tensor]:
    return dict(st_load(data))


__all__ = ["BIND_ENV", "Combined", "Fleet", "FleetConfig", "PEERS_ENV", "parse_peers"]
