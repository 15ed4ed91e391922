"""bench-harvest: how much of the target's idle time the drafter turns into training, at what cost.

A synthetic target (spectrain_workloads.drafter.synthetic: real ring, real debug-model hidden
states of real text) runs steps of fixed CPU work followed by predicted Bubble windows and
open-ended Imbalance windows; the drafter sidecar runs as its own process (IdleOnly).

harvest_efficiency     drafter busy time inside usable windows / usable window time (its summary),
                       over the training phase: the summary as it stood before the slowdown
                       phase, whose "off" blocks SIGSTOP the drafter (windows it is forbidden to use)
harvest_efficiency_incl_stopped   the same over the whole run, SIGSTOPped blocks included
overrun_p99_ms         p99 of (last task end - window end) over windows worked in
drafter_microstep_ms   the largest training micro-step the drafter ran (its measured cost, p75):
                       the bound the overrun must stay under
target_slowdown_ratio  median fixed-work compute time per step with the drafter running / with it
                       stopped (SIGSTOP), blocks interleaved within one run
acceptance_online      expected accepted length (k=4, EAGLE tau incl. the bonus token) on fresh
                       held-out text of the drafter exported by the run
acceptance_offline     the same drafter trained offline (no windows, back to back) on the same
                       data stream for the same number of samples
acceptance_ratio       online / offline

Run: python -m bench.harvest [--quick]   (make bench-harvest [QUICK=1])

SPECTRAIN_DEVICE=cuda (`make gpu-check`): the drafter trains on the GPU and the target's compute is
bf16 matmuls on the same GPU (`_GpuTarget`, timed to completion), so the slowdown is the drafter's
kernels competing with the target's. When the caller started an MPS daemon (CUDA_MPS_PIPE_DIRECTORY set)
both are its clients and the drafter runs under the caps a pod's drafter gets by default
(gpu_sharing.drafter_mps_env: 30 % of the SMs, 8 GiB pinned). The offline baseline trains on the GPU
too. Same keys, in bench/results/harvest_gpu.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import median, parse_args, print_table, write_results
from spectrain_api import rundir
from spectrain_workloads.drafter.combiner import Sample
from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.models import TargetShared, config_digest
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import (
    SyntheticSpec,
    SyntheticTarget,
    WindowSpec,
    target_hidden,
    text_sequences,
)
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.verify import measure
from spectrain_workloads.model import model_config

REPO = Path(__file__).resolve().parents[1]
CFG = model_config("debug", {"n_layers": 2, "max_seq_len": 64})
SEQ = 64
SETTINGS = {"checkpoint_every_s": 5.0, "verify_every_s": 2.0}
DEVICE = "cuda" if os.environ.get("SPECTRAIN_DEVICE") == "cuda" else "cpu"   # benches run on CPU by default
GPU_N = 4096        # target matmul size on the GPU: ~0.25 ms each on an H100-class GPU, ~10 ms for 40


class _GpuTarget(SyntheticTarget):
    """The synthetic target with its compute on the GPU, synchronized so its time includes the kernels."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._a = torch.randn(GPU_N, GPU_N, device="cuda", dtype=torch.bfloat16) / GPU_N ** 0.5

    def _compute(self) -> float:
        t0 = time.perf_counter()
        x = self._a
        while (time.perf_counter() - t0) * 1e3 < self.spec.compute_ms:
            x = torch.tanh(x @ self._a)
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _fixed_compute(self, iters: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = self._a
        for _ in range(iters):
            x = torch.tanh(x @ self._a)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def _drafter_mps_caps() -> dict[str, str]:
    """Under MPS, the drafter's default caps (module docstring): its share of the GPU, as in a pod."""
    if DEVICE != "cuda" or not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return {}
    from spectrain_operator.gpu_sharing import drafter_mps_env

    return drafter_mps_env({"spec": {"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1}}})


def _drafter(root: Path) -> subprocess.Popen[bytes]:
    cfg = root / "config.json"
    cfg.write_text(json.dumps({"spec": {"drafter": {"activation": {"safetyMarginMs": 1}}}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")]),
           "SPECTRAIN_CONFIG": str(cfg), "SPECTRAIN_RING_DIR": str(root / "ring"),
           "SPECTRAIN_RUN_DIR": str(root / "run"), "SPECTRAIN_DEVICE": DEVICE,
           "SPECTRAIN_DRAFTER_SETTINGS": json.dumps(SETTINGS), **_drafter_mps_caps()}
    return subprocess.Popen([sys.executable, "-m", "spectrain_workloads.drafter.sidecar"], env=env,
                            stdout=open(root / "drafter.log", "ab"), stderr=subprocess.STDOUT)


def _events(root: Path) -> list[dict[str, Any]]:
    p = rundir.drafter_metrics(root / "run", 0)
    out = []
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _summary(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads(rundir.drafter_summary(root / "run", 0).read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _offline_acceptance(target: SyntheticTarget, steps: int, samples: int, eval_data: list) -> float:
    """The same drafter, trained back to back on the same stream, for the same number of samples."""
    s = DrafterSettings(**SETTINGS)
    m = target.model
    shared = TargetShared(embedding=m.tok_embeddings.weight.detach(), lm_head=m.output.weight.detach(),
                          model_config=CFG, digest=config_digest(CFG.to_dict()), stamp=())
    tr = DrafterTrainer(s, shared, torch.device(DEVICE))
    seqs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for step in range(steps):
        tokens = text_sequences(target.spec.data_per_step, SEQ, seed=target.spec.seed, offset=step)
        hidden = target_hidden(m, tokens)
        seqs += [(tokens[i], hidden[i], step) for i in range(len(tokens))]
    seqs = [x for i, x in enumerate(seqs, 1) if i % s.eval_every]     # the online run held these out
    c = s.seq_cap        # ... and trained on chunks of seq_cap positions, as here
    stream = [Sample(tokens=t[a:a + c], hidden=h[a:a + c], step=st) for t, h, st in seqs
              for a in range(0, max(len(t) - c, 0) + 1, c)]
    done, acc_n, i = 0, 0, 0
    while done < samples:
        batch = [stream[(i + j) % len(stream)] for j in range(min(s.max_micro_batch, samples - done))]
        i += len(batch)
        tr.micro_step(batch)
        done += len(batch)
        acc_n += len(batch)
        if acc_n >= s.samples_per_step:
            tr.optimizer_step(acc_n)
            acc_n = 0
    return measure(tr.model.cpu(), eval_data, None, k=4).acceptance_length


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    train_s, blocks, block_steps = (20.0, 4, 8) if args.quick else (90.0, 10, 15)
    root = Path(tempfile.mkdtemp(prefix="bench-harvest-"))
    (root / "ring").mkdir()
    spec = SyntheticSpec(windows=[WindowSpec(kind="Bubble", duration_ms=60.0, jitter=0.1),
                                  WindowSpec(kind="Imbalance", duration_ms=40.0, predicted=False, jitter=0.2)],
                         compute_ms=10.0, data_per_step=2, seq_len=SEQ, seed=0)
    target_cls = _GpuTarget if DEVICE == "cuda" else SyntheticTarget
    target = target_cls(run_dir=root / "run", ring_path=root / "ring" / "ring-0", spec=spec, cfg=CFG)
    proc = _drafter(root)
    try:
        while not any(e["event"] == "calibrated" for e in _events(root)):
            if proc.poll() is not None:
                raise RuntimeError(f"drafter exited: {(root / 'drafter.log').read_text()[-2000:]}")
            target.run_step()
        t_end = time.monotonic() + train_s
        while time.monotonic() < t_end:
            target.run_step()
        # the drafter's summary as of the end of the training phase (it rewrites it every second)
        wall_end = time.time()
        while (trained_summary := _summary(root)) is None or trained_summary["updatedAt"] <= wall_end:
            if proc.poll() is not None:
                raise RuntimeError(f"drafter exited: {(root / 'drafter.log').read_text()[-2000:]}")
            target.run_step()
        # slowdown: fixed work per step, drafter running vs stopped, interleaved blocks
        iters = 40
        on, off = [], []
        for b in range(2 * blocks):
            running = b % 2 == 0
            os.kill(proc.pid, signal.SIGCONT if running else signal.SIGSTOP)
            for _ in range(block_steps):
                (on if running else off).append(target.run_step(fixed_iters=iters))
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        steps = target.step
    finally:
        if proc.poll() is None:
            proc.kill()
        target.close()
    summary = json.loads(rundir.drafter_summary(root / "run", 0).read_text())
    trained = [float(v) for k, v in summary["costsMs"].items() if k.startswith("train/")]
    tokens = text_sequences(16, SEQ, seed=1234)
    hidden = target_hidden(target.model, tokens)
    eval_data = [(tokens[i], hidden[i]) for i in range(len(tokens))]
    online_model, _ = load_drafter(root / "run" / "drafter")
    online = measure(online_model, eval_data, None, k=4).acceptance_length
    offline = _offline_acceptance(target, steps, int(summary["samplesTrained"]), eval_data)
    results = {
        "harvest_efficiency": trained_summary["harvestEfficiency"],
        "harvest_efficiency_incl_stopped": summary["harvestEfficiency"],
        "overrun_p99_ms": summary["overrunMsP99"],
        "drafter_microstep_ms": max(trained),
        "target_slowdown_ratio": median(on) / median(off),
        "acceptance_online": online,
        "acceptance_offline": offline,
        "acceptance_ratio": online / offline,
        "unit_ms": summary["unitMs"],
        "samples_trained": summary["samplesTrained"],
        "windows_worked": summary["windowsWorked"],
        "harvested_s_by_kind": summary["harvestedSecondsByKind"],
    }
    name = "harvest" if DEVICE == "cpu" else "harvest_gpu"
    print_table(f"bench-{name}" + (" (quick)" if args.quick else ""),
                {k: v for k, v in results.items() if not isinstance(v, dict)})
    write_results(name, results, args.quick)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
