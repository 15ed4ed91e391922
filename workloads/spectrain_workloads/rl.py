"""spec.mode RL: GRPO on a verifiable-reward task with speculative rollouts and RolloutTail windows.

One RL step: sample `prompts_per_step` problems, `group_size` rollouts each (RolloutEngine: the
newest exported drafter, adaptive speculative decoding, lossless); rewards from the task;
group-normalised advantages A = (r - mean_group) / (std_group + eps); clipped policy loss
-min(rho A, clip(rho, 1-eps, 1+eps) A) over response tokens (token mean), plus kl_coef x KL(policy ||
reference) (k3 estimator) when kl_coef > 0; gradients accumulated over length-sorted micro-batches;
one AdamW step.

Long tail as idle time: when the rollout's active batch drops below tail_fraction x batch (or
empties), the rank opens a RolloutTail window on the ring (closed when the rollout ends, after the
cross-rank barrier when WORLD_SIZE > 1) and publishes each finished sequence's hidden states
(those the rollout computed anyway: no extra prefill) and tokens on the data channel, so the
drafter sidecar trains on them during the window. `run(cfg)` is target.py's entry for spec.mode RL.

`run(cfg)`: the policy starts from a short supervised warm-up on the task (the stand-in for a
pretrained policy, so rewards carry signal): SPECTRAIN_RL_WARMUP_STEPS steps (default 200; set it
through spec.target.env; skipped on resume). At the start of every RL step the rollout engine loads
the newest drafter export ($SPECTRAIN_EXPORT_DIR/LATEST) if it moved; metrics record its version per
step. SIGTERM: the checkpoint of the current step boundary is saved, then the rank exits (shutdown.py).
"""

from __future__ import annotations

import copy
import datetime
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spectrain_workloads.errors import ConfigError
from spectrain_workloads.model import Transformer
from spectrain_workloads.rollout import RolloutConfig, RolloutEngine, RolloutResult
from spectrain_workloads.tasks import TOKENIZER, Example, Task, get_task

ROLLOUT_TAIL = 4          # ring.WindowKind.ROLLOUT_TAIL (the ring is optional here)


@dataclass(kw_only=True)
class GRPOConfig:
    group_size: int = 8
    prompts_per_step: int = 8
    lr: float = 3e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    tail_fraction: float = 0.25    # RolloutTail opens when active batch < tail_fraction x batch, or empties
    train_micro_batch: int = 8     # rows per policy-update forward (length-sorted; gradients accumulated)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"rl.groupSize must be >= 2 (advantages are group-relative), got {self.group_size}")
        for name in ("prompts_per_step", "ppo_epochs", "train_micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GRPO {name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.clip_eps <= 0 or self.kl_coef < 0 or not 0 <= self.tail_fraction <= 1:
            raise ConfigError("GRPO needs lr > 0, clip_eps > 0, kl_coef >= 0 and tail_fraction in [0, 1]")


@dataclass
class StepResult:
    step: int
    reward_mean: float
    loss: float
    kl: float
    rollout_s: float
    train_s: float
    step_s: float
    tokens: int                 # generated tokens
    response_len_mean: float
    response_len_max: int
    acceptance_length: float    # tokens per row-verification (0: no speculative step)
    spec_steps: int
    tail_s: float               # RolloutTail window length (0: none opened)
    published: int              # sequences published on the data channel


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """rewards [G * group_size] (groups contiguous) -> (r - group mean) / (group std + eps)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def response_logprobs(model: nn.Module, seqs: torch.Tensor, temperature: float) -> torch.Tensor:
    """seqs [N, L] -> log p(seqs[:, t+1] | seqs[:, :t+1]) [N, L-1] at the sampling temperature."""
    logits = model(seqs[:, :-1]).float() / (temperature if temperature > 0 else 1.0)   # [N, L-1, V]
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0]


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps: float,
              ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logp, old_logp, mask [N, L-1]; adv [N] -> (loss, mean KL). Token mean over response tokens."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    per_tok = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        d = ref_logp - logp
        kl_tok = torch.exp(d) - d - 1                      # k3: unbiased, >= 0
        per_tok = per_tok + kl_coef * kl_tok
        kl = (kl_tok * mask).sum() / mask.sum()
    return (per_tok * mask).sum() / mask.sum(), kl


def pad_batch(seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    L = max(len(s) for s in seqs)
    out = torch.full((len(seqs), L), TOKENIZER.PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out.to(device)


def sft_warmup(model: Transformer, task: Task, *, steps: int, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> float:
    """Teacher-forced answers (the stand-in for a pretrained policy, so RL starts with signal). -> last loss."""
    rng, dev = random.Random(seed), model.rope.device
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        exs = [task.sample(rng) for _ in range(batch)]
        prompts = [task.prompt_ids(e) for e in exs]
        seqs = pad_batch([p + task.answer_ids(e) for p, e in zip(prompts, exs, strict=False)], dev)
        logits = model(seqs[:, :-1])
        t = torch.arange(seqs.size(1) - 1, device=dev)[None]
        mask = (t >= torch.tensor([len(p) - 1 for p in prompts], device=dev)[:, None]) & (seqs[:, 1:] != TOKENIZER.PAD)
        loss = (F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten(), reduction="none") * mask.flatten()).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


class GRPOTrainer:
    """GRPO on one rank. `producer`: a ring.RingProducer (or None: no windows, no data).

    Drafter: `set_drafter(module, arch)` (the engine starts every later rollout with it), or
    `reload_drafter(export_dir)` to follow $SPECTRAIN_EXPORT_DIR/LATEST.
    """

    def __init__(self, policy: Transformer, task: Task, cfg: GRPOConfig, rollout: RolloutConfig, *,
                 drafter: nn.Module | None = None, drafter_arch: str | None = None, producer: Any = None,
                 stage: int = 0, on_window: Callable[[dict[str, Any]], None] | None = None,
                 barrier: Callable[[], None] | None = None, grad_sync: Callable[[nn.Module], None] | None = None,
                 keep_hidden: bool = False) -> None:
        self.policy, self.task, self.cfg, self.rcfg = policy, task, cfg, rollout
        self.engine = RolloutEngine(policy, rollout, drafter, drafter_arch=drafter_arch)
        self.opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
        self.reference = copy.deepcopy(policy).requires_grad_(False) if cfg.kl_coef > 0 else None
        self.rng = random.Random(cfg.seed)
        self.producer, self.stage, self.on_window = producer, stage, on_window
        self.barrier, self.grad_sync = barrier, grad_sync
        self.keep_hidden = keep_hidden          # keep rollout hidden states in last_rollout (in-process drafters)
        self.step_idx = 0
        self.drafter_version: str | None = None
        self._tail_pred_ns = 0
        self.last_rollout: tuple[list[Example], RolloutResult] | None = None

    # ---- drafter
    def set_drafter(self, module: nn.Module | None, arch: str | None = None, *, new_version: bool = False) -> None:
        self.engine.set_drafter(module, arch, new_version=new_version)

    def reload_drafter(self, export_dir: str | os.PathLike[str]) -> bool:
        """Load the newest export if LATEST moved since the last rollout; True when a new one was loaded."""
        latest = Path(export_dir) / "LATEST"
        try:
            version = latest.read_text().strip()
        except OSError:
            return False
        if not version or version == self.drafter_version:
            return False
        from spectrain_workloads.drafter.export import load_drafter

        module, meta = load_drafter(Path(export_dir) / version, device=self.policy.rope.device)
        self.set_drafter(module.to(next(self.policy.parameters()).dtype), meta.get("arch"),
                         new_version=self.drafter_version is not None)
        self.drafter_version = version
        return True

    # ---- one step
    def rollout(self) -> tuple[list[Example], RolloutResult, dict[str, Any]]:
        g = self.cfg.group_size
        exs = [self.task.sample(self.rng) for _ in range(self.cfg.prompts_per_step)]
        prompts = [self.task.prompt_ids(e) for e in exs for _ in range(g)]
        B = len(prompts)
        tail: dict[str, Any] = {"wid": None, "published": 0, "pending": []}
        publish = self.producer is not None

        def send(ids: list[int], res: RolloutResult) -> None:
            for i in ids:
                h = res.hidden[i]
                if h is None:
                    continue
                hn = h.detach().cpu()
                dtype = str(hn.dtype).removeprefix("torch.")
                if hn.dtype == torch.bfloat16:
                    hn = hn.view(torch.int16)          # numpy has no bfloat16; meta says so
                toks = torch.tensor(res.sequences[i][: hn.size(0)], dtype=torch.long)    # [T]: x_0..x_{T-1}
                meta = {"step": self.step_idx, "dtype": dtype, "stage": self.stage, "seq_index": i}
                try:
                    self.producer.publish_data(meta, {"hidden": hn.numpy(), "tokens": toks.numpy()})
                    tail["published"] += 1
                except ValueError:                     # ring.PayloadTooLarge: a slot cannot hold it
                    pass
                if not self.keep_hidden:
                    res.hidden[i] = None               # published: free it

        def on_finish(ids: list[int], res: RolloutResult) -> None:
            if not publish:
                return
            if tail["wid"] is None:
                tail["pending"].extend(ids)
            else:
                send(ids, res)

        def on_step(n_active: int, eng: RolloutEngine) -> None:
            if self.producer is not None and tail["wid"] is None and (n_active < self.cfg.tail_fraction * B or n_active == 0):
                tail["start_ns"], tail["predicted_ns"] = time.monotonic_ns(), self._tail_pred_ns
                tail["wid"] = self.producer.window_start(ROLLOUT_TAIL, stage=self.stage, step=self.step_idx,
                                                         predicted_duration_ns=self._tail_pred_ns)
                send(tail["pending"], eng.result)
                tail["pending"] = []

        res = self.engine.generate(prompts, keep_hidden=publish or self.keep_hidden, on_step=on_step, on_finish=on_finish)
        if self.barrier is not None:
            self.barrier()                              # waiting for slower ranks is tail idle time too
        if tail["wid"] is not None:
            actual = time.monotonic_ns() - tail["start_ns"]
            self.producer.window_end(tail["wid"], actual_duration_ns=actual)
            tail["actual_ns"] = actual
            self._tail_pred_ns = actual if not self._tail_pred_ns else (self._tail_pred_ns + actual) // 2
            if self.on_window is not None:
                self.on_window({"window_id": tail["wid"], "kind": "RolloutTail", "stage": self.stage,
                                "step": self.step_idx, "start_ns": tail["start_ns"],
                                "predicted_ns": tail["predicted_ns"], "actual_ns": actual})
        return exs, res, tail

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        self.policy.eval()
        exs, res, tail = self.rollout()
        t1 = time.perf_counter()
        g, dev = self.cfg.group_size, self.policy.rope.device
        rewards = torch.tensor([self.task.reward(exs[i // g], r) for i, r in enumerate(res.responses)])
        adv = group_advantages(rewards, g).to(dev)
        temp = self.rcfg.temperature
        # Length-sorted micro-batches, each padded to its own longest row: with long-tailed responses
        # one long row no longer pads every other row to its length. Same loss (token mean over all
        # response tokens), accumulated over micro-batches.
        order = sorted(range(len(res.sequences)), key=lambda i: len(res.sequences[i]))
        mb = self.cfg.train_micro_batch
        chunks = []
        for c in range(0, len(order), mb):
            idx = order[c: c + mb]
            seqs = pad_batch([res.sequences[i] for i in idx], dev)                    # [n, L]
            t = torch.arange(seqs.size(1) - 1, device=dev)[None]
            plen = torch.tensor([res.prompt_lens[i] for i in idx], device=dev)[:, None]
            slen = torch.tensor([len(res.sequences[i]) for i in idx], device=dev)[:, None]
            mask = ((t >= plen - 1) & (t < slen - 1)).float()                         # response tokens [n, L-1]
            chunks.append((seqs, mask, adv[torch.tensor(idx, device=dev)]))
        total = sum(float(m.sum()) for _, m, _ in chunks) or 1.0
        self.policy.train()
        with torch.no_grad():
            old = [response_logprobs(self.policy, sq, temp) for sq, _, _ in chunks] if self.cfg.ppo_epochs > 1 else None
            ref = ([response_logprobs(self.reference, sq, temp) for sq, _, _ in chunks]
                   if self.reference is not None else None)
        loss = kl = torch.zeros(())
        for _ in range(self.cfg.ppo_epochs):
            self.opt.zero_grad(set_to_none=True)
            loss = kl = torch.zeros(())
            for j, (sq, mask, a) in enumerate(chunks):
                if mask.sum() == 0:
                    continue
                w = float(mask.sum()) / total
                logp = response_logprobs(self.policy, sq, temp)
                lc, kc = grpo_loss(logp, logp.detach() if old is None else old[j], a, mask, self.cfg.clip_eps,
                                   None if ref is None else ref[j], self.cfg.kl_coef)
                (lc * w).backward()
                loss, kl = loss + float(lc.detach()) * w, kl + float(kc) * w
            if self.grad_sync is not None:
                self.grad_sync(self.policy)
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
            self.opt.step()
        self.policy.eval()
        t2 = time.perf_counter()
        self.last_rollout = (exs, res)
        lens = [len(r) for r in res.responses]
        out = StepResult(step=self.step_idx, reward_mean=float(rewards.mean()), loss=float(loss.detach()), kl=float(kl),
                         rollout_s=t1 - t0, train_s=t2 - t1, step_s=t2 - t0, tokens=sum(lens),
                         response_len_mean=sum(lens) / len(lens), response_len_max=max(lens),
                         acceptance_length=res.stats.acceptance_length, spec_steps=res.stats.spec_steps,
                         tail_s=tail.get("actual_ns", 0) / 1e9, published=tail["published"])
        self.step_idx += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        from spectrain_workloads.checkpoint import rng_state

        return {"model": self.policy.state_dict(), "optim": self.opt.state_dict(), "step": self.step_idx,
                "task_rng": self.rng.getstate(), "engine_rng": self.engine.gen.get_state(), "rng": rng_state(),
                "tail_pred_ns": self._tail_pred_ns}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from spectrain_workloads.checkpoint import set_rng_state

        self.policy.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.step_idx = int(state["step"])
        self.rng.setstate(state["task_rng"])
        self.engine.gen.set_state(state["engine_rng"])
        set_rng_state(state["rng"])
        self._tail_pred_ns = int(state.get("tail_pred_ns", 0))


class LMDistiller:
    """In-process LM-drafter training on rollout outputs (soft targets = the policy head over the
    rollout's own hidden states, no extra prefill). Stands in for the drafter sidecar in benchmarks
    and tests; the RL job itself loads the sidecar's exports."""

    def __init__(self, drafter: Transformer, *, lr: float = 2e-3) -> None:
        self.drafter = drafter
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=lr)

    @staticmethod
    def collect(policy: Transformer, res: RolloutResult) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens [T], target probs [T, V]) per row with kept hidden states."""
        out = []
        assert policy.output is not None
        with torch.no_grad():
            for seq, h in zip(res.sequences, res.hidden, strict=False):
                if h is not None and h.size(0) > 0:
                    out.append((torch.tensor(seq[: h.size(0)], device=h.device), torch.softmax(policy.output(h).float(), -1)))
        return out

    def train(self, data: list[tuple[torch.Tensor, torch.Tensor]], *, steps: int, batch: int = 16,
              seed: int = 0) -> float:
        rng = random.Random(seed)
        self.drafter.train()
        loss = torch.zeros(())
        for _ in range(steps):
            picks = [data[rng.randrange(len(data))] for _ in range(min(batch, len(data)))]
            toks = pad_batch([p[0].tolist() for p in picks], picks[0][0].device)                    # [b, T]
            probs = torch.zeros(*toks.shape, picks[0][1].size(-1), device=toks.device)
            mask = torch.zeros(toks.shape, device=toks.device)
            for i, (t, p) in enumerate(picks):
                probs[i, : t.numel()], mask[i, : t.numel()] = p, 1.0
            logp = torch.log_softmax(self.drafter(toks).float(), -1)                                  # [b, T, V]
            loss = -((probs * logp).sum(-1) * mask).sum() / mask.sum()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        self.drafter.eval()
        return float(loss.detach())


# ------------------------------------------------------------------------------------------ entry

def run(cfg: Any) -> list[float]:
    """spec.mode RL on this rank (env per docs/contracts.md); returns the per-step mean rewards."""
    from spectrain_workloads.checkpoint import CheckpointManager, save_shared
    from spectrain_workloads.metrics import MetricsWriter
    from spectrain_workloads.model import model_config
    from spectrain_workloads.shutdown import EXIT_TERMINATED, Terminator, block_sigterm
    from spectrain_workloads.trainer import RankInfo, TrainerOptions, _device

    block_sigterm()          # SIGTERM: a sigwait thread (shutdown.py); saved at the next step boundary
    t = cfg.target
    if t.rl is None:
        raise ConfigError("spec.target.rl is required when spec.mode is RL")
    if t.parallelism.pipeline != 1:
        raise ConfigError("spec.mode RL runs data-parallel only: set spec.target.parallelism.pipeline to 1")
    opts, rank = TrainerOptions.from_env(), RankInfo.from_env()
    device = _device(opts, rank)
    if device.type == "cpu":
        # The drafter sidecar shares these cores (SPECTRAIN_DRAFTER_THREADS, default 1): leave it its
        # threads, since oversubscribed intra-op threads make every decode step many times slower.
        spare = int(os.environ.get("SPECTRAIN_DRAFTER_THREADS") or 1) if opts.drafter_enabled else 0
        torch.set_num_threads(opts.torch_threads or max(1, ((os.cpu_count() or 1) - spare) // max(1, rank.local_world)))
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    if rank.rank == 0:
        TOKENIZER.save(opts.run_dir)
    mcfg = model_config(t.model.preset, t.model.overrides, vocab_size=TOKENIZER.vocab_size)
    policy = Transformer(mcfg)
    policy.init_weights(cfg.seed)
    policy.to(device)
    rl = t.rl
    task = get_task(rl.task, max_len=max(2, min(48, rl.max_new_tokens - 1)))
    rcfg = RolloutConfig.from_rl(rl, seed=cfg.seed + rank.rank)
    gcfg = GRPOConfig(group_size=rl.group_size, prompts_per_step=t.data.batch_size, lr=t.optimizer.lr,
                      seed=cfg.seed + rank.rank)

    import torch.distributed as dist
    barrier = grad_sync = None
    if rank.world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank.rank,
                                world_size=rank.world, timeout=datetime.timedelta(minutes=10))
        barrier = dist.barrier

        def grad_sync(m: nn.Module) -> None:
            for p in m.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(rank.world)

    producer = None
    if opts.drafter_enabled and opts.ring_dir is not None:
        from spectrain_workloads.ring import RingLayout, RingProducer, ring_path

        mib = 1 << 20
        need = mcfg.max_seq_len * (mcfg.dim * 4 + 8) + 64 * 1024
        slot = max(mib, -(-need // mib) * mib)
        producer = RingProducer.create(ring_path(opts.ring_dir, rank.local_rank), rank=rank.rank,
                                       layout=RingLayout(data_slots=max(4, min(64, (192 * mib) // slot)), data_slot_bytes=slot))
    export_dir = Path(os.environ.get("SPECTRAIN_EXPORT_DIR") or opts.run_dir / cfg.drafter.export.path)
    metrics = MetricsWriter(opts.run_dir, rank.rank, local_rank=rank.local_rank, port=opts.metrics_port,
                            progress=rank.rank == 0, total_steps=t.steps)
    trainer = GRPOTrainer(policy, task, gcfg, rcfg, producer=producer, on_window=metrics.window_closed,
                          barrier=barrier, grad_sync=grad_sync)
    ckpt = CheckpointManager(opts.run_dir, rank.rank, t.checkpoint.keep)
    latest = ckpt.latest()
    if latest is not None:
        trainer.load_state_dict(ckpt.load(latest))
    else:
        if rank.rank == 0:   # the drafter can set up and calibrate during the warm-up (it refreshes these later)
            assert policy.tok_embeddings is not None and policy.output is not None
            save_shared(opts.run_dir, embedding=policy.tok_embeddings.weight, lm_head=policy.output.weight,
                        model_config=mcfg.to_dict())
        sft_warmup(policy, task, steps=int(os.environ.get("SPECTRAIN_RL_WARMUP_STEPS", "200")), seed=cfg.seed)
        if rank.world > 1:   # identical start on every rank
            for p in policy.parameters():
                dist.broadcast(p.data, 0)

    def save(step: int) -> None:
        ckpt.save(step, trainer.state_dict())
        if rank.rank == 0:
            assert policy.tok_embeddings is not None and policy.output is not None
            save_shared(opts.run_dir, embedding=policy.tok_embeddings.weight, lm_head=policy.output.weight,
                        model_config=mcfg.to_dict())

    if latest is None:
        save(0)          # the drafter's Eagle head needs the shared embedding / head from the start
    term = Terminator(opts.term_grace_s, lambda: save(trainer.step_idx))
    rewards: list[float] = []
    try:
        while trainer.step_idx < t.steps:
            if term.requested.is_set():
                with term.state_lock:
                    save(trainer.step_idx)
                    term.done.set()
                print(f"[spectrain-target] SIGTERM: saved RL step {trainer.step_idx}; exiting", flush=True)
                metrics.close()
                os._exit(EXIT_TERMINATED)
            if opts.drafter_enabled and rl.speculative.enabled:
                try:
                    if trainer.reload_drafter(export_dir):
                        print(f"[spectrain-target] RL step {trainer.step_idx}: rollouts use drafter "
                              f"{trainer.drafter_version} from {export_dir}", flush=True)
                except (ConfigError, OSError, RuntimeError, KeyError) as exc:   # a bad export must not stop RL
                    print(f"spectrain rl: keeping the current drafter, cannot load {export_dir}: {exc}", flush=True)
            with term.state_lock:      # the emergency save only ever sees a completed step
                r = trainer.step()
            rewards.append(r.reward_mean)
            metrics.step(step=trainer.step_idx, loss=r.loss, step_time_s=r.step_s, tokens=r.tokens,
                         extra={"reward": r.reward_mean, "kl": r.kl, "rollout_s": r.rollout_s, "train_s": r.train_s,
                                "acceptance_length": r.acceptance_length, "spec_steps": r.spec_steps,
                                "response_len_mean": r.response_len_mean, "response_len_max": r.response_len_max,
                                "rollout_tail_s": r.tail_s, "published": r.published,
                                "drafter_version": trainer.drafter_version})
            if trainer.step_idx % t.checkpoint.every_steps == 0 or trainer.step_idx == t.steps:
                with term.state_lock:
                    save(trainer.step_idx)
    finally:
        metrics.close()
        if producer is not None:
            producer.close()
        if rank.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return rewards


__all__ = ["GRPOConfig", "GRPOTrainer", "LMDistiller", "StepResult", "group_advantages", "grpo_loss",
           "pad_batch", "response_logprobs", "run", "sft_warmup"]
