"""Every private torch name the adapters touch, in one place, checked before use.

Tested with torch 2.13 (`TESTED_TORCH`). A torch that lacks one of these names gets a `HookError`
naming it, the adapter that needs it and the tested versions, at the adapter's setup call (never
mid-step). Public names (`PipelineStage.forward_one_chunk`, `FSDPModule.set_custom_all_gather`,
`DistributedDataParallel.register_comm_hook`) are used directly where they are called.

- torch.distributed.pipelining.schedules `_batch_p2p(ops, desc)` -> list[Work] and
  `_wait_batch_p2p(works)`: every receive of Schedule1F1B, ScheduleGPipe and
  ScheduleInterleaved1F1B goes through the first and is waited on by the second (module globals,
  looked up at call time, so replacing them reaches all three);
- a schedule's `_stage` (single-stage schedules), `_stages` (multi-stage), `_n_microbatches`,
  `_num_stages`; the `_Action` entries of `pipeline_order` (`computation_type`, `stage_index`,
  `microbatch_index`) and `_ComputationType.FORWARD` / `FULL_BACKWARD`;
- torch.distributed.fsdp._fully_shard._fsdp_collectives `DefaultAllGather` / `DefaultReduceScatter`:
  the collectives FSDP2 runs when none is set, which the timed wrappers delegate to.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from spectrain_workloads.hooks.errors import HookError

TESTED_TORCH = ("2.13",)
_SCHEDULES = "torch.distributed.pipelining.schedules"
_FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


def _missing(adapter: str, what: str) -> HookError:
    return HookError(f"{adapter} needs the torch internal {what}, which torch {torch.__version__} does not have "
                     f"(tested with torch {', '.join(TESTED_TORCH)}); use a tested torch or drop the adapter "
                     "and mark the windows with pub.idle()")


def _attr(obj: Any, name: str, adapter: str, owner: str) -> Any:
    if not hasattr(obj, name):
        raise _missing(adapter, f"{owner}.{name}")
    return getattr(obj, name)


def schedules_module() -> ModuleType:
    """torch.distributed.pipelining.schedules, checked for the two p2p helpers."""
    try:
        mod = importlib.import_module(_SCHEDULES)
    except ImportError:
        raise _missing("instrument_schedule", _SCHEDULES) from None
    for name in ("_batch_p2p", "_wait_batch_p2p"):
        _attr(mod, name, "instrument_schedule", _SCHEDULES)
    return mod


def schedule_stages(schedule: Any) -> list[Any]:
    """The pipeline stages this rank runs in `schedule` (one, or one per model chunk)."""
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    return [_attr(schedule, "_stage", "instrument_schedule", type(schedule).__name__)]


def schedule_shape(schedule: Any) -> tuple[int, int]:
    """(number of virtual stages, microbatches per step) of `schedule`."""
    name = type(schedule).__name__
    return (int(_attr(schedule, "_num_stages", "instrument_schedule", name)),
            int(_attr(schedule, "_n_microbatches", "instrument_schedule", name)))


def compute_types() -> tuple[Any, Any]:
    """(FORWARD, FULL_BACKWARD) of the schedule IR's `_ComputationType`."""
    mod = schedules_module()
    ct = _attr(mod, "_ComputationType", "instrument_schedule", _SCHEDULES)
    return (_attr(ct, "FORWARD", "instrument_schedule", "_ComputationType"),
            _attr(ct, "FULL_BACKWARD", "instrument_schedule", "_ComputationType"))


def rank_actions(schedule: Any, rank: int) -> list[tuple[Any, int, int] | None]:
    """`schedule.pipeline_order[rank]` as (computation type, stage index, microbatch) or None (an
    idle step); [] when the schedule has no pipeline_order."""
    order = getattr(schedule, "pipeline_order", None) or {}
    out: list[tuple[Any, int, int] | None] = []
    for a in order.get(rank, []):
        if a is None:
            out.append(None)
            continue
        for field in ("computation_type", "stage_index", "microbatch_index"):
            _attr(a, field, "instrument_schedule", "_Action")
        out.append((a.computation_type, int(a.stage_index),
                    -1 if a.microbatch_index is None else int(a.microbatch_index)))
    return out


def fsdp_default_comms() -> tuple[type, type]:
    """(DefaultAllGather, DefaultReduceScatter): FSDP2's own collectives."""
    try:
        mod = importlib.import_module(_FSDP_COLLECTIVES)
    except ImportError:
        raise _missing("instrument_fsdp", _FSDP_COLLECTIVES) from None
    return (_attr(mod, "DefaultAllGather", "instrument_fsdp", _FSDP_COLLECTIVES),
            _attr(mod, "DefaultReduceScatter", "instrument_fsdp", _FSDP_COLLECTIVES))
