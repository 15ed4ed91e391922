"""`ddp_comm_hook(model, pub)`: a Communication window per DDP bucket all-reduce.

Registers the built-in trainer's hook (harvest/comm_hook.py `make_comm_hook`): the maths of torch's
`allreduce_hook` (divide the bucket [n] by the world size, all-reduce the sum) plus a window from
the bucket's launch to its completion (closed on gloo's / NCCL's completion callback), predicted
from the end of the step's first bucket launch plus this bucket's recent lag (harvest/window_history.py).
The windows' channel is `dp-bucket-<bucket index>` (+ `prefix`).

A NoopPublisher registers nothing: DDP keeps its own C++ all-reduce. Both sum the same bucket
divided by the world size, so the gradients are bitwise equal for a world size that is a power
of two (division by it is exact); for other sizes torch multiplies by 1/world and the hook
divides, which can differ in the last bit.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from spectrain_workloads.harvest.comm_hook import make_comm_hook
from spectrain_workloads.hooks.errors import HookError
from spectrain_workloads.hooks.publisher import NoopPublisher, Publisher


def ddp_comm_hook(model: DistributedDataParallel, pub: Publisher | NoopPublisher, *, prefix: str = "") -> None:
    """Register the windowed all-reduce on `model` (call before the first backward)."""
    if not isinstance(model, DistributedDataParallel):
        raise HookError(f"ddp_comm_hook takes a DistributedDataParallel model, got {type(model).__name__}")
    if not isinstance(pub, Publisher):
        return
    pub.require_kind("Communication", "ddp_comm_hook")
    group: Any = model.process_group
    model.register_comm_hook(group, make_comm_hook(pub.instrument, f"{prefix}dp-bucket-"))
