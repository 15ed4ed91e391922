"""What a drafter worker reads from its ring: window events for the gate, sequences for the buffer.

Window events update the WindowTracker (the gate's view of open windows and of each kind's
history) and close windows in the metrics' harvest accounting. Data is copied out of the shared
slot at once (the target overwrites it) and checked afterwards (a record overwritten while being
copied is dropped). A sequence arrives as tokens [T] (int64) and, from a last-stage ring, hidden
[T, H] in the target's dtype (bf16 travels as an int16 view); the worker keeps hidden as float32,
forwards the sequence to the fleet's stages without data, and cuts it into Samples of seq_cap
positions, the unit of work the gate schedules. Sequences the fleet forwarded from other ranks
join the buffer the same way. An EAGLE-3 drafter reads parts instead (the feature layers a stage
holds, and on the last stage the final hidden state): the last stage's drafter assembles them into
samples of hidden [T, 4H] (drafter.eagle3_assembly), the others send theirs to it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from spectrain_api.names import EAGLE3
from spectrain_workloads.drafter.combiner import Sample, SampleBuffer
from spectrain_workloads.drafter.eagle3_assembly import FeatureAssembler, part_meta
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.gating import Gate, WindowTracker
from spectrain_workloads.drafter.metrics import Metrics
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.train import DrafterTrainer


def _tensor(arr: np.ndarray, dtype: str | None) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr, copy=True))    # copy out of the shared slot
    if dtype == "bfloat16" and t.dtype == torch.int16:
        t = t.view(torch.bfloat16)                    # the ring carries bf16 as an int16 view
    return t


class Intake:
    """The worker's ring input (a part of drafter.worker.Worker, which sets these attributes)."""

    s: DrafterSettings
    consumer: Any                        # ring.RingConsumer, None before the ring is open
    fleet: Fleet | None
    gate: Gate
    tracker: WindowTracker
    metrics: Metrics
    buffer: SampleBuffer
    trainer: DrafterTrainer | None
    calibrated: bool
    ready_ns: int
    data_seen: int
    assembler: FeatureAssembler | None   # EAGLE-3, once the drafter knows its feature layers
    parts_early: int
    parts_malformed: int

    def _on_events(self, events: list[Any]) -> None:
        if not events:
            return
        unit = self.gate.unit_ns()
        threshold = (unit or 0) + self.gate.margin_ns
        for cw in self.tracker.update(events):
            # Windows that began before the drafter could work feed the history, not the accounting
            # (unless it did work in them: that work is accounted with its window).
            if cw.start_ns >= self.ready_ns or cw.window_id in self.metrics.pending:
                self.metrics.window_closed(cw, threshold)

    def _could_start(self) -> bool:
        """Would the gate let work start in an open window now (data permitting)?"""
        return self.calibrated and self.gate.allows(self.gate.budget(time.monotonic_ns()), None, starting=True)

    def _wait_input(self, timeout_s: float) -> tuple[list[Any], int]:
        """Block up to timeout_s for window events or data; apply both; -> (events, sequences added)."""
        events: list[Any] = []
        added = 0

        def read() -> bool:
            nonlocal added
            got = self.consumer.poll_windows()
            self._on_events(got)
            events.extend(got)
            added += self._drain_data()
            return bool(got) or added > 0

        self.consumer.wait_until(read, timeout_s)
        return events, added

    def _drain_data(self, limit: int = 64) -> int:
        """Copy up to `limit` published sequences out of the ring; -> how many joined the buffer."""
        added = 0
        for _ in range(limit):
            rec = self.consumer.next_data()
            if rec is None:
                break
            arrays, meta = rec.arrays, rec.meta
            if "tokens" not in arrays:
                continue
            tokens = _tensor(arrays["tokens"], None).long()
            hidden = _tensor(arrays["hidden"], meta.get("dtype")) if "hidden" in arrays else None
            features = _tensor(arrays["features"], meta.get("dtype")) if "features" in arrays else None
            if not rec.valid():
                continue   # overwritten while copying
            step = int(meta.get("step", -1))
            if self.s.arch == EAGLE3:
                parsed = part_meta(meta)
                if parsed is None:               # a malformed record: dropped and counted, never a crash
                    self.parts_malformed += 1
                    continue
                added += self._feature_part(tokens, features, parsed[0], hidden, step, parsed[1])
                continue
            if self.fleet is not None:
                self.fleet.share(tokens, hidden, step)
            added += self._add_sequence(tokens, None if hidden is None else hidden.float(), step)
        if self.fleet is not None:
            if self.assembler is not None:
                for tok, feat, layers, step, seq in self.fleet.take_parts(max(0, limit - added)):
                    added += self._feature_part(tok, feat, layers, None, step, seq)
            for tok, hid, step, _src in self.fleet.take_samples(max(0, limit - added)):
                added += self._add_sequence(tok, None if hid is None else hid.float(), step)
        return added

    def _feature_part(self, tokens: torch.Tensor, features: torch.Tensor | None, layers: tuple[int, ...],
                      final: torch.Tensor | None, step: int, seq_index: int) -> int:
        """An EAGLE-3 part (drafter.eagle3_assembly): the replica's last stage assembles it into a
        sample [T, 4H] (then trained here and forwarded as any sample); the other stages send it there.
        Parts that reach the last stage before its drafter knows its layers are dropped (counted)."""
        fleet = self.fleet
        if fleet is not None and fleet.cfg.rank != fleet.cfg.assembler:
            if features is not None:
                fleet.send_part(tokens, features, layers, step, seq_index)
            return 0
        if self.assembler is None:
            self.parts_early += 1
            return 0
        full = self.assembler.add(step, seq_index, tokens, features=None if features is None else features.float(),
                                  layers=layers if features is not None else (),
                                  final=None if final is None else final.float())
        if full is None:
            return 0
        if fleet is not None:
            fleet.share(tokens, full, step)
        return self._add_sequence(tokens, full, step)

    def _add_sequence(self, tokens: torch.Tensor, hidden: torch.Tensor | None, step: int) -> int:
        chunks = self._chunks(tokens, hidden, step)
        if not chunks or (self.trainer is not None and not self.trainer.usable(chunks[0])):
            return 0
        self.data_seen += 1
        self.buffer.add_sequence(chunks)
        return 1

    def _chunks(self, tokens: torch.Tensor, hidden: torch.Tensor | None, step: int) -> list[Sample]:
        """A published sequence cut into chunks of seq_cap positions (the unit of work is one chunk:
        the smaller it is, the shorter the windows the drafter can use). A tail shorter than a
        chunk is dropped, unless the whole sequence is (then it is one chunk of its own)."""
        T, c = tokens.numel(), self.s.seq_cap
        if T < 4:
            return []
        bounds = [(0, T)] if T <= c else [(i, i + c) for i in range(0, T - c + 1, c)]
        return [Sample(tokens=tokens[a:b].clone(), hidden=None if hidden is None else hidden[a:b].clone(), step=step)
                for a, b in bounds]
