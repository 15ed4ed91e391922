"""`instrument_fsdp(model, pub)`: a Communication window per FSDP2 all-gather and reduce-scatter.

FSDP2 (`torch.distributed.fsdp.fully_shard`) lets a module replace its collectives through the
public `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`. Every FSDP module of
`model` gets wrappers around FSDP2's own collectives (`DefaultAllGather` / `DefaultReduceScatter`,
torch_internals.py) that open a window when the collective is launched and close it when it
completes: at once for a synchronous call, on the Work's completion callback for an asynchronous
one. The collectives themselves are FSDP2's, with the same arguments, so the maths is unchanged.

Channels: `fsdp-ag-<i>` / `fsdp-rs-<i>` (i: the module's index among `model`'s FSDP modules), so
that each module's transfers keep their own history (harvest/window_history.py predicts per channel and size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from spectrain_workloads.harvest.instrument import Instrument
from spectrain_workloads.hooks import torch_internals as ti
from spectrain_workloads.hooks.errors import HookError
from spectrain_workloads.hooks.publisher import NoopPublisher, Publisher


class _Timed:
    """A collective with a Communication window around it; `allocate` is the inner one's."""

    def __init__(self, inner: Any, instr: Instrument, channel: str) -> None:
        self.inner, self.instr, self.channel = inner, instr, channel

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _timed(self, nbytes: int, call: Any) -> Any:
        w = self.instr.comm_open(self.channel, nbytes)
        work = call()
        if w is None:
            return work
        if work is None:
            self.instr.comm_close(w)
            return None
        instr = self.instr
        work.get_future().then(lambda _f: instr.comm_close(w))
        return work


class _TimedAllGather(_Timed):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        return self._timed(output_tensor.numel() * output_tensor.element_size(),
                           lambda: self.inner(output_tensor, input_tensor, group, async_op))


class _TimedReduceScatter(_Timed):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        return self._timed(input_tensor.numel() * input_tensor.element_size(),
                           lambda: self.inner(output_tensor, input_tensor, group, op, async_op))


def instrument_fsdp(model: torch.nn.Module, pub: Publisher | NoopPublisher) -> int:
    """Wrap the collectives of every FSDP2 module in `model` (after `fully_shard`); returns how many
    modules were wrapped (0 for a NoopPublisher)."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise HookError(f"instrument_fsdp: {type(model).__name__} has no FSDP2 module; call fully_shard first")
    if not isinstance(pub, Publisher):
        return 0
    pub.require_kind("Communication", "instrument_fsdp")
    all_gather, reduce_scatter = ti.fsdp_default_comms()
    for i, m in enumerate(mods):
        m.set_custom_all_gather(_TimedAllGather(all_gather(), pub.instrument, f"fsdp-ag-{i}"))  # type: ignore[arg-type]
        m.set_custom_reduce_scatter(_TimedReduceScatter(reduce_scatter(), pub.instrument,  # type: ignore[arg-type]
                                                        f"fsdp-rs-{i}"))
    return len(mods)
