"""The DDP comm hook both trainers register: torch's bucket all-reduce plus a Communication window.

The maths are `torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`'s (divide
the flat bucket [n] by the group's world size, all-reduce the sum), so gradients match DDP's own
all-reduce; around it a window runs from the bucket's launch to its completion (closed on gloo's /
NCCL's completion callback). Its channel is `<channel><bucket index>`, and it is anchored (`anchor="dp"`):
a bucket's all-reduce ends when the slowest replica launches it, so its end is predicted from this
step's first bucket launch (window_history.py), not from bytes / bandwidth.

Users: the built-in trainer (target/trainer.py, one hook per model chunk) and `hooks.ddp_comm_hook`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from spectrain_workloads.harvest.instrument import Instrument


def make_comm_hook(instrument: Instrument, channel: str = "dp-bucket-"
                   ) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """DDP comm hook: bucket all-reduce (mean) with a Communication window per bucket
    (channel + bucket index; one prefix per DDP, e.g. per model chunk)."""

    # No annotations on purpose: DDP checks them against the real classes, and this module's
    # `from __future__ import annotations` turns them into strings.
    def hook(group, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer()                       # flat [n] view of this bucket's gradients
        world = dist.get_world_size(group)
        buf.div_(world)                             # same maths as torch's allreduce_hook
        # anchor "dp": a bucket's all-reduce ends when the slowest replica launches it, so its end is
        # predicted relative to this step's first bucket launch (window_history.py), not from bandwidth
        w = instrument.comm_open(f"{channel}{bucket.index()}", buf.numel() * buf.element_size(), anchor="dp")
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            instrument.comm_close(w)                # runs on completion (gloo's worker thread)
            return f.value()[0]

        return fut.then(done)

    return hook
