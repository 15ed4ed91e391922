"""One rank of the hooks adapter tests (tests/integration/test_hooks_adapters.py), run as a process.

argv: OUT_DIR. Three parts, one after the other, STEPS steps each (part i numbers its steps from
i * STEPS): GPipe and Interleaved1F1B, a 2-rank pipeline of Linear layers (4 microbatches)
instrumented with instrument_schedule, the rank writing its pipeline_order (None: an idle step) to
OUT_DIR/order-<mode>-rank-<r>.json; then fsdp, a 2-rank FSDP2 model instrumented with
instrument_fsdp. After each part the rank prints a digest of its weights (bitwise comparisons with
the hooks off).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spectrain_workloads import hooks

STEPS = 6


MODES = ("GPipe", "Interleaved1F1B", "fsdp")


def _pipeline(mode: str, out: Path, rank: int, pub: hooks.Publisher | hooks.NoopPublisher, first_step: int
              ) -> list[nn.Module]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    chunks = 2 if mode == "Interleaved1F1B" else 1
    torch.manual_seed(rank)
    mods = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(chunks)]
    stages = [PipelineStage(m, c * 2 + rank, 2 * chunks, torch.device("cpu")) for c, m in enumerate(mods)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    sched = (ScheduleInterleaved1F1B(stages, 4, loss_fn=loss_fn) if chunks > 1
             else ScheduleGPipe(stages[0], 4, loss_fn=loss_fn))
    (out / f"order-{mode}-rank-{rank}.json").write_text(json.dumps([None if a is None else str(a)
                                                             for a in sched.pipeline_order[rank]]))
    hooks.instrument_schedule(sched, pub)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
        sched.step(x) if rank == 0 else sched.step(target=y)
        opt.step()
        opt.zero_grad()
        pub.step_end(first_step + step)
    return mods


def _fsdp(rank: int, pub: hooks.Publisher | hooks.NoopPublisher, first_step: int) -> list[nn.Module]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    hooks.instrument_fsdp(model, pub)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(8, 32, generator=g)
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        pub.step_end(first_step + step)
    return [model]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pub = hooks.attach(hidden_dim=32, seq_len=8)
    for i, mode in enumerate(MODES):
        mods = _fsdp(rank, pub, i * STEPS) if mode == "fsdp" else _pipeline(mode, out, rank, pub, i * STEPS)
        local = [p.to_local() if hasattr(p, "to_local") else p for m in mods for p in m.parameters()]
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in local)).hexdigest()
        print(f"{mode} rank {rank} weights {digest}", flush=True)
    pub.close()
    dist.barrier()                                 # no rank tears gloo down while a peer is still in
    dist.destroy_process_group()                   # its last collective (the peer would abort at exit)


if __name__ == "__main__":
    main()
