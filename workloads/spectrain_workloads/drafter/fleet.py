"""The drafters of a job as one fleet: samples reach every rank, and one model is made of all.

Ranks are the target's: rank r is pipeline stage r % P of data-parallel replica r // P.

Samples. Only the last stage's ring carries hidden states. Its drafter forwards every sequence it
reads (already a uniform sample of each microbatch, `SPECTRAIN_PUBLISH_FRACTION`) to the drafters
of the other P - 1 stages of its replica, so every stage trains on a uniform sample of the global
batch. For an EAGLE-3 drafter the other stages' rings carry feature parts; their drafters send
each part to the last stage's drafter (`send_part`), which assembles the samples
(drafter.eagle3_assembly) and forwards them as above. Frames are droppable: past the bandwidth cap or a slow receiver's queue they are dropped
(counted), never queued without bound; a receiver keeps at most `inbox_bytes` not yet taken.

Weights: every `combine_every_s` each drafter's parameters are averaged into one combined version
by the coordinator (the exporting rank) and sent back to every rank (drafter.fleet_weights, which
says how).

Engine AllReduce (spec.drafter.exchange.engine): the weights go through drafter.allreduce instead
(drafter.ring_replicas); this fleet then carries samples only, and neither sends nor takes the
star's weight frames (contrib, combined, hello).

Trust: every connection is authenticated with the job's key and the pod's own identity (drafter.auth:
a peer speaks only as its own pod's ranks) and everything received is checked before use
(drafter.checks): samples against the target (`expect`), weights against the local model, claimed
work against wall time, a combined version only from the coordinator, signed by the coordinator's
pod, and at most a few versions ahead (further only as the answer to this drafter's own hello). A
rejected item is dropped and counted by cause (`stats.rejected()`); a bad frame never ends a thread.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.auth import Identity, Session
from spectrain_workloads.drafter.eagle3_assembly import SAMPLE_WIDTH
from spectrain_workloads.drafter.fleet_records import (
    Combined,
    Contribution,
    Credit,
    FleetConfig,
    raw_bytes,
)
from spectrain_workloads.drafter.fleet_weights import HELLO_NONCES, StarWeights
from spectrain_workloads.drafter.links import Frame, Link, Rejected, Stats, TokenBucket
from spectrain_workloads.drafter.listener import Server

WEIGHT_KINDS = ("contrib", "combined", "hello")   # the star's weight frames
WEIGHTS_CAP_UNKNOWN = 1 << 34    # before the local model exists weights are read past (never kept): a length sanity bound


class _Inbox:
    """Received frames not yet taken, at most `cap` payload bytes (the oldest go first). Callers hold
    the fleet's lock."""

    def __init__(self, cap: int) -> None:
        self.cap, self.bytes = cap, 0
        self.frames: collections.deque[tuple[Frame, int]] = collections.deque()

    def push(self, f: Frame, rank: int) -> int:
        """Append; returns how many older frames were dropped to stay under the cap."""
        dropped = 0
        while self.frames and self.bytes + len(f.payload) > self.cap:
            old, _ = self.frames.popleft()
            self.bytes -= len(old.payload)
            dropped += 1
        self.frames.append((f, rank))
        self.bytes += len(f.payload)
        return dropped

    def __len__(self) -> int:
        return len(self.frames)

    def pop(self) -> tuple[Frame, int] | None:
        if not self.frames:
            return None
        f, rank = self.frames.popleft()
        self.bytes -= len(f.payload)
        return f, rank


class Fleet(StarWeights):
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.ident = Identity(cfg.key if cfg.trust else None, cfg.job_uid, cfg.generation, cfg.pod if cfg.trust else None)
        if self.ident.pod is not None:
            self.ident.pod.check_rank(cfg.rank)
        self.stats = Stats()
        self.bucket = TokenBucket(cfg.bandwidth_bytes_per_s, max(cfg.bandwidth_bytes_per_s * 0.25, 1 << 16))
        self.lock = threading.Lock()
        self.contributed = threading.Condition(self.lock)
        self.members_seen: set[int] = set()            # coordinator: ranks that ever contributed
        self.inbox = _Inbox(cfg.inbox_bytes)          # samples, checked when taken
        self.parts = _Inbox(cfg.inbox_bytes)          # EAGLE-3 parts, likewise
        self.feature_layers: tuple[int, ...] = ()      # EAGLE-3 (`use_features`)
        self.contributions: dict[int, Contribution] = {}
        # coordinator: per rank, the work and samples of its process already in a combined version. A
        # contribution carries the sender's cumulative work, so one replaced in a send queue or
        # overwritten by a newer one before a round loses no work: the newer total holds it.
        self.credited: dict[int, Credit] = {}
        self.incarnation = f"{os.getpid()}-{time.monotonic_ns()}"
        self.combined_in: Combined | None = None       # the newest combined version not yet applied
        self.newest = 0                                 # member: the newest combined version taken
        self.latest: Combined | None = None            # coordinator: the newest combined version
        self.answered: dict[int, tuple[str, int, float]] = {}   # coordinator: rank -> (session, version, when)
        self.hello_nonces: collections.deque[str] = collections.deque(maxlen=HELLO_NONCES)
        self.want_hello = False                         # member: a version too far ahead came: ask for the newest
        self.last_hello = 0.0
        self.table: checks.ParamTable | None = None     # the local model's trainable tensors
        self.target: checks.TargetSpec | None = None
        self.links: dict[int, Link] = {}
        self.links_lock = threading.Lock()              # links are made by the worker and by readers (hello answers)
        port = cfg.addresses[cfg.rank][1]
        self.limits = cfg.limits
        self.server = Server([(h, port) for h in cfg.bind_hosts], self, self.stats, ident=self.ident,
                             rank=cfg.rank, world=cfg.world, limits=self.limits)

    def use_features(self, layers: tuple[int, ...]) -> None:
        """An EAGLE-3 drafter (before `expect`): samples are [T, 4H]; parts of `layers` go to the
        replica's last stage (cfg.assembler)."""
        self.feature_layers = tuple(layers)

    def expect(self, params: Mapping[str, torch.Tensor], target: checks.TargetSpec | None = None) -> None:
        """The local model exists: what received weights and samples are checked against (the
        target from the config, else from its shared model config in run_dir)."""
        spec = target or self.cfg.target
        if spec is None and self.cfg.run_dir is not None:
            spec = checks.TargetSpec.from_run_dir(self.cfg.run_dir)
        if spec is not None and self.feature_layers:
            spec = dataclasses.replace(spec, width=SAMPLE_WIDTH)
        with self.lock:
            self.table, self.target = checks.param_table(params), spec

    def _link(self, rank: int) -> Link:
        with self.links_lock:
            if rank not in self.links:
                self.links[rank] = Link(self.cfg.addresses[rank], self.bucket, max_queue_bytes=self.cfg.max_queue_bytes,
                                        stats=self.stats, ident=self.ident, rank=self.cfg.rank, peer_rank=rank,
                                        handshake_s=self.limits.handshake_s)
            return self.links[rank]

    # ------------------------------------------------------------ receiving (links.Receiver)
    def cap(self, kind: str) -> int:
        if kind == "sample":
            return min(self.cfg.inbox_bytes, self.target.sample_bytes) if self.target else self.cfg.inbox_bytes
        if kind == "part":     # at most 3 feature layers: the width of a sample less its final hidden
            return min(self.cfg.inbox_bytes, self.target.sample_bytes) if self.target else self.cfg.inbox_bytes
        if kind in ("contrib", "combined"):
            return checks.table_bytes(self.table) if self.table is not None else WEIGHTS_CAP_UNKNOWN
        return 0                                        # hello: its header says everything

    def admit(self, kind: str, header: dict[str, Any], peer: Session) -> str | None:
        """Whether this rank takes a frame of `kind` from `peer` (before its payload is read)."""
        if "rank" in header and header["rank"] != peer.peer_rank:
            return "rank"
        if kind in WEIGHT_KINDS and not self.star:
            return "engine"
        if kind == "sample":
            # Taken before this drafter is ready too (peers start in any order; a refused sample is
            # lost): it waits in the bounded inbox and is checked when taken, once `expect` has run.
            # Refused only when `expect` found no target to check samples against.
            if peer.peer_rank not in self.cfg.sample_sources:
                return "role"
            return "not_ready" if self.table is not None and self.target is None else None
        if kind == "part":     # from the other stages of this replica, to its assembler only
            # Taken before this drafter is ready too: the other stages' drafters may start first, and
            # their parts would be lost; they wait in the bounded parts inbox, and each is checked
            # (MAC, part_arrays against the target) when taken, once `expect` has run.
            if self.cfg.rank != self.cfg.assembler or peer.peer_rank not in self.cfg.sample_ranks:
                return "role"
            return "role" if self.target is not None and not self.feature_layers else None
        if kind == "contrib":
            return "role" if not self.is_coordinator else "not_ready" if self.table is None else None
        if kind == "hello":
            return None if self.is_coordinator else "role"
        if kind == "combined":
            if self.is_coordinator or peer.peer_rank != self.cfg.coordinator:
                return "role"
            if self.table is None:
                return "not_ready"
            version = header.get("version")
            if not isinstance(version, int) or isinstance(version, bool):
                return "header"
            if not checks.version_ok(version, self.newest, reply=header.get("reply") in self.hello_nonces):
                if version > self.newest:
                    self.want_hello = True              # far ahead: ask for it as the answer to a hello
                return "version"
            return None
        return "kind"

    def handle(self, f: Frame, peer: Session) -> None:
        if f.kind == "sample":
            self._on_sample(f, peer)
        elif f.kind == "part":
            self._on_part(f, peer)
        elif f.kind == "contrib":
            self._on_contrib(f, peer)
        elif f.kind == "combined":
            self._on_combined(f)
        elif f.kind == "hello":
            self._on_hello(f, peer)

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
        frame = Frame("sample", header, b"".join(raw_bytes(a) for a in arrays))
        for r in self.cfg.sample_ranks:
            self._link(r).send(frame)
        self.stats.add(samples_shared=1)

    def take_samples(self, limit: int) -> list[tuple[torch.Tensor, torch.Tensor | None, int, int]]:
        """Up to `limit` received sequences: (tokens [T], hidden [T, H] or None, step, from rank),
        each checked now (its MAC, drafter.checks): at the cap most arrivals leave a full inbox
        unread, so only what is used pays for the checks."""
        target = self.target
        if target is None:              # nothing to check them against yet: they wait
            return []

        def parse(f: Frame, rank: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
            tokens, hidden = checks.sample_arrays(f.header, f.payload, target, values=self.cfg.trust)
            return tokens, hidden, checks.field(f.header, "step", int), rank
        return self._take(self.inbox, limit, parse)

    def _take(self, box: _Inbox, limit: int, parse: Any) -> list[Any]:
        """Up to `limit` items parsed from `box`'s frames, oldest first; a frame whose MAC or checks
        fail is dropped and counted by cause."""
        out: list[Any] = []
        while len(out) < limit:
            with self.lock:
                got = box.pop()
            if got is None:
                break
            f, rank = got
            try:
                if f.verify is not None and not f.verify():
                    raise Rejected("mac", "payload MAC does not verify")
                out.append(parse(f, rank))
            except Rejected as exc:
                self.stats.reject(exc.cause)
        return out

    def _on_sample(self, f: Frame, peer: Session) -> None:
        with self.lock:
            dropped = self.inbox.push(f, peer.peer_rank)   # the oldest go: fresher samples track the target better
        self.stats.add(samples_received=1, **({"inbox_dropped": dropped} if dropped else {}))

    # ------------------------------------------------------------ EAGLE-3 parts
    def send_part(self, tokens: torch.Tensor, features: torch.Tensor, layers: tuple[int, ...], step: int,
                  seq_index: int) -> None:
        """One stage's part of a sequence (tokens [T] int64, features [T, len(layers) * H] in the
        target's dtype) to the replica's assembler; droppable like a sample."""
        arrays = [tokens.to(torch.int64).contiguous(), features.contiguous()]
        header = {"rank": self.cfg.rank, "step": step, "seq_index": seq_index, "layers": list(layers),
                  "shapes": [list(a.shape) for a in arrays],
                  "dtypes": [str(a.dtype).removeprefix("torch.") for a in arrays]}
        self._link(self.cfg.assembler).send(Frame("part", header, b"".join(raw_bytes(a) for a in arrays)))
        self.stats.add(parts_sent=1)

    def take_parts(self, limit: int) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int, int]]:
        """Up to `limit` received parts: (tokens [T], features [T, n * H], layers, step, seq_index),
        each checked now (MAC, then drafter.checks.part_arrays)."""
        def parse(f: Frame, _rank: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int, int]:
            assert self.target is not None
            tokens, features, layers = checks.part_arrays(f.header, f.payload, self.target, self.feature_layers)
            return (tokens, features, layers, checks.field(f.header, "step", int),
                    checks.field(f.header, "seq_index", int, low=0))
        return self._take(self.parts, limit, parse)

    def _on_part(self, f: Frame, peer: Session) -> None:
        with self.lock:
            dropped = self.parts.push(f, peer.peer_rank)
        self.stats.add(parts_received=1, **({"parts_dropped": dropped} if dropped else {}))

    def defer(self, kind: str) -> bool:
        return kind in ("sample", "part")

    def close(self) -> None:
        self.server.close()
        with self.links_lock:
            links = list(self.links.values())
        for link in links:
            link.close()


__all__ = ["Fleet"]
