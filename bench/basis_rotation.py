"""bench-basis_rotation: how much staleness slows training down, per optimizer.

Tiny GPT (byte tokens) on real text (Python stdlib sources), PipeDream with weight stashing via
the single-process simulator (the same maths as the multi-process run), P in {1, 4, 8}.
Optimizers: AdamW, PipeDream-LR (AdamW with the PipeMare staleness lr rescheduling),
BasisRotation with a uniform refresh schedule and with the stage-aware one (same total budget).

Metric: target = the held-out loss synchronous AdamW (P=1) reaches at 60% of the budget.
iterations(opt, P) = first update count at which opt's held-out loss reaches the target
(linear interpolation between evaluations; a run stops there, or at `cap` x the reference's
count, in which case the count is a lower bound, marked '>='). slowdown_<opt>_p<P> =
iterations(opt, P) / iterations(AdamW, P=1): the cost of running P-deep asynchronously instead
of synchronously with the standard optimizer. The table also shows each optimizer against its
own synchronous run (`vs own P=1`), which isolates staleness robustness from the optimizer's
synchronous speed. step_overhead_vs_adamw: time of one full training step (forward, backward,
optimizer) with BasisRotation over AdamW at P=1, interleaved repetitions, median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.common import print_table, write_results
from spectrain_workloads.async_pipeline import delays, simulate, stage_named_params
from spectrain_workloads.config import BasisRotationSpec, OptimizerSpec
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus
from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.optim import PipeDreamLR, build_optimizer, param_groups


@dataclass(kw_only=True)
class Setup:
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    budget: int           # steps of the synchronous AdamW reference; target = its loss at 60%
    eval_every: int
    eval_batches: int
    lr: float
    refresh_every: int
    cap: float            # stop a run at cap x the reference's iteration count
    data_bytes: int
    seeds: tuple[int, ...]
    stages: tuple[int, ...]


QUICK = Setup(dim=32, n_layers=8, n_heads=2, seq_len=32, batch=8, budget=160, eval_every=10, eval_batches=8,
              lr=3e-3, refresh_every=10, cap=2.0, data_bytes=2 << 20, seeds=(0,), stages=(1, 8))
FULL = Setup(dim=48, n_layers=8, n_heads=4, seq_len=64, batch=16, budget=300, eval_every=10, eval_batches=4,
             lr=3e-3, refresh_every=10, cap=2.5, data_bytes=8 << 20, seeds=(0,), stages=(1, 4, 8))
OPTIMIZERS = ("adamw", "pipedream_lr", "basis_rotation", "basis_rotation_stage_aware")


class Task:
    def __init__(self, s: Setup) -> None:
        self.s = s
        corpus = load_corpus("builtin:python-stdlib", max_bytes=s.data_bytes)   # token ids [N]
        cut = int(corpus.size * 0.95)
        self.train, held = corpus[:cut], TokenLoader(corpus[cut:], LoaderSpec(seq_len=s.seq_len, batch_size=s.batch))
        self.eval_set = [held.batch(i) for i in range(s.eval_batches)]   # distinct held-out windows
        self.cfg = ModelConfig(vocab_size=264, dim=s.dim, n_layers=s.n_layers, n_heads=s.n_heads,
                               max_seq_len=s.seq_len)

    def batch(self, seed: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        return TokenLoader(self.train, LoaderSpec(seq_len=self.s.seq_len, batch_size=self.s.batch, seed=seed)).batch

    def eval_loss(self, model: Transformer) -> float:
        return statistics.fmean(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in self.eval_set)

    def model(self, seed: int) -> Transformer:
        m = Transformer(self.cfg)
        m.init_weights(seed)
        return m

    def optimizers(self, name: str, model: Transformer, P: int) -> list[torch.optim.Optimizer]:
        s, out = self.s, []
        for k in range(P):
            named = stage_named_params(model, k, P)
            if name == "adamw":
                out.append(build_optimizer(named, OptimizerSpec(name="AdamW", lr=s.lr), stage=k, n_stages=P))
            elif name == "pipedream_lr":
                groups = param_groups(named)
                for g in groups:
                    g.pop("rotate")
                out.append(PipeDreamLR(groups, delay=delays(P)[k], anneal_steps=s.budget, lr=s.lr,
                                       betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
            else:
                br = BasisRotationSpec(refresh_every=s.refresh_every, stage_aware=name.endswith("stage_aware"))
                spec = OptimizerSpec(name="BasisRotation", lr=s.lr, basis_rotation=br)
                out.append(build_optimizer(named, spec, stage=k, n_stages=P))
        return out

    def lr_at(self, t: int) -> float:
        return min(1.0, (t + 1) / max(1, self.s.budget // 20))           # 5% linear warm-up, then constant

    def curve(self, name: str, P: int, steps: int, seed: int, target: float | None) -> list[tuple[int, float]]:
        """Held-out loss curve [(updates, loss)]; stops once it reaches `target`."""
        model = self.model(seed)
        res = simulate(model, self.optimizers(name, model, P), self.batch(seed), steps, lr_at=self.lr_at,
                       eval_fn=self.eval_loss, eval_every=self.s.eval_every, stop_below=target)
        return res.evals


def iterations_to(curve: list[tuple[int, float]], target: float) -> tuple[float, bool]:
    """(first interpolated update count with loss <= target, reached?)."""
    prev = (0, float("inf"))
    for s, loss in curve:
        if loss <= target:
            if prev[1] == float("inf"):
                return float(s), True
            s0, l0 = prev
            return s0 + (s - s0) * (l0 - target) / (l0 - loss), True
        prev = (s, loss)
    return float(curve[-1][0]), False


def step_overhead(task: Task, reps: int) -> tuple[float, float]:
    """(median full-step time ratio BasisRotation / AdamW, median optimizer-step-only ratio)."""
    models = {n: task.model(0) for n in ("adamw", "basis_rotation")}
    opts = {n: task.optimizers(n, m, 1)[0] for n, m in models.items()}
    batch = task.batch(0)
    full: dict[str, list[float]] = {n: [] for n in models}
    only: dict[str, list[float]] = {n: [] for n in models}
    for r in range(reps):
        for n in models if r % 2 else reversed(list(models)):            # interleaved, alternating order
            x, y = batch(r)
            t0 = time.perf_counter()
            loss = F.cross_entropy(models[n](x).flatten(0, 1), y.flatten())
            loss.backward()
            t1 = time.perf_counter()
            opts[n].step()
            opts[n].zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if r >= 3:                                                   # skip warm-up (first refresh)
                full[n].append(t2 - t0)
                only[n].append(t2 - t1)
    ratio = statistics.median(b / a for a, b in zip(full["adamw"], full["basis_rotation"], strict=True))
    ratio_opt = statistics.median(b / a for a, b in zip(only["adamw"], only["basis_rotation"], strict=True))
    return ratio, ratio_opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="same measurements, smaller sizes (< 60 s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = QUICK if args.quick else FULL
    task = Task(s)
    t_start = time.perf_counter()
    iters: dict[tuple[str, int], list[float]] = {}
    censored: set[tuple[str, int]] = set()
    for seed in s.seeds:
        ref = task.curve("adamw", 1, int(0.6 * s.budget), seed, None)
        target, ref_iters = ref[-1][1], float(ref[-1][0])                # loss at 60% of the budget
        iters.setdefault(("adamw", 1), []).append(ref_iters)
        for name in OPTIMIZERS:
            for P in s.stages:
                if (name, P) == ("adamw", 1) or (P == 1 and name in ("pipedream_lr", "basis_rotation_stage_aware")):
                    continue          # PipeDream-LR at P=1 is AdamW; stage-aware at P=1 is uniform
                curve = task.curve(name, P, int(s.cap * ref_iters), seed, target)
                n, ok = iterations_to(curve, target)
                iters.setdefault((name, P), []).append(n)
                if not ok:
                    censored.add((name, P))
                print(f"seed {seed} {name:<27} P={P}: {n:6.0f} iterations{'' if ok else ' (not reached)'} "
                      f"[{time.perf_counter() - t_start:.0f}s]", flush=True)
    mean = {k: statistics.fmean(v) for k, v in iters.items()}
    mean[("pipedream_lr", 1)] = mean[("adamw", 1)]
    mean[("basis_rotation_stage_aware", 1)] = mean[("basis_rotation", 1)]
    sync = mean[("adamw", 1)]
    overhead, overhead_opt = step_overhead(task, 12 if args.quick else 30)
    results = {
        "slowdown_adamw_p8": mean[("adamw", 8)] / sync,
        "slowdown_pipedream_lr_p8": mean[("pipedream_lr", 8)] / sync,
        "slowdown_basis_rotation_p8": mean[("basis_rotation", 8)] / sync,
        "stage_aware_vs_uniform": mean[("basis_rotation_stage_aware", 8)] / mean[("basis_rotation", 8)],
        "step_overhead_vs_adamw": overhead,
    }
    rows: list[tuple[str, object]] = []
    for name in OPTIMIZERS:
        for P in s.stages:
            ge = ">=" if (name, P) in censored else ""
            n = mean[(name, P)]
            rows.append((f"{name} P={P}", f"{ge}{n:.0f} it   slowdown {ge}{n / sync:.2f}x   "
                                          f"vs own P=1 {ge}{n / mean[(name, 1)]:.2f}x"))
    rows += list(results.items())
    rows.append(("optimizer_step_only_overhead", overhead_opt))
    rows.append(("not reached within cap (lower bounds)", ", ".join(f"{n} P={p}" for n, p in sorted(censored)) or "none"))
    rows.append(("wall_s", round(time.perf_counter() - t_start, 1)))
    print_table(f"basis_rotation ({'quick' if args.quick else 'full'}): iterations to reach sync AdamW's held-out "
                f"loss at 60% of {s.budget} steps", rows)
    extra = {"iterations": {f"{n}_p{p}": v for (n, p), v in mean.items()},
             "lower_bounds": sorted(f"{n}_p{p}" for n, p in censored),
             "optimizer_step_only_overhead": overhead_opt, "setup": s.__dict__}
    write_results("basis_rotation", {**results, **extra}, args.quick)


if __name__ == "__main__":
    main()
