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
drafter sidecar trains on them during the window. rl/mode.py runs these steps as spec.mode RL
(warm-up, drafter exports, checkpoints, SIGTERM, metrics).
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_workloads.model import Transformer
from spectrain_workloads.ring.records import WindowKind
from spectrain_workloads.rl.sidebyside import plain_rerun
from spectrain_workloads.rl.tasks import TOKENIZER, Example, Task
from spectrain_workloads.specdec.config import RolloutConfig, RolloutResult
from spectrain_workloads.specdec.engine import RolloutEngine


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
    plain_every: int = 0           # every n-th step also rolls out plainly, for the speedup (sidebyside.py); 0: never
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"rl.groupSize must be >= 2 (advantages are group-relative), got {self.group_size}")
        for name in ("prompts_per_step", "ppo_epochs", "train_micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GRPO {name} must be >= 1, got {getattr(self, name)}")
        if self.plain_every < 0:
            raise ConfigError(f"GRPO plain_every must be >= 0 (0: no plain reruns), got {self.plain_every}")
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
    # On steps with a plain rerun (GRPOConfig.plain_every): the same rollout phase with plain decoding,
    # i.e. rollout_s with the speculative decoding's seconds replaced by the plain rerun's.
    plain_rollout_s: float | None = None
    plain_tokens: int | None = None
    # The draft-length controller's decisions in the rollout: share of decode steps with k = 0, and
    # decode steps per k (RolloutStats.plain_share / k_histogram).
    plain_share: float = 0.0
    k_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def rollout_tokens_per_s(self) -> float:
        return self.tokens / self.rollout_s if self.rollout_s > 0 else 0.0

    @property
    def plain_rollout_tokens_per_s(self) -> float | None:
        if self.plain_rollout_s is None or self.plain_tokens is None or self.plain_rollout_s <= 0:
            return None
        return self.plain_tokens / self.plain_rollout_s

    @property
    def rl_step_speedup(self) -> float | None:
        """Plain step time / this step's time; the update is the same computation either way (same
        number of rows, identically distributed lengths), so it counts with its measured time."""
        if self.plain_rollout_s is None or self.step_s <= 0:
            return None
        return (self.plain_rollout_s + self.train_s) / self.step_s

    def metrics(self) -> dict[str, Any]:
        """The RL keys of the step's metrics line (docs/contracts.md); plain_* only on measured steps."""
        out: dict[str, Any] = {
            "reward": self.reward_mean, "kl": self.kl, "rollout_s": self.rollout_s, "train_s": self.train_s,
            "rollout_tokens_per_s": self.rollout_tokens_per_s,
            "acceptance_length": self.acceptance_length, "spec_steps": self.spec_steps,
            "response_len_mean": self.response_len_mean, "response_len_max": self.response_len_max,
            "rollout_tail_s": self.tail_s, "published": self.published, "plain_share": self.plain_share,
            "k_histogram": {str(k): n for k, n in self.k_histogram.items()}}
        if self.plain_rollout_s is not None:
            out.update(plain_rollout_s=self.plain_rollout_s, plain_rollout_tokens_per_s=self.plain_rollout_tokens_per_s,
                       rl_step_speedup=self.rl_step_speedup)
        return out


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
    rng, dev = random.Random(seed), next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        exs = [task.sample(rng) for _ in range(batch)]
        prompts = [task.prompt_ids(e) for e in exs]
        rows = [p + task.answer_ids(e) for p, e in zip(prompts, exs, strict=False)]
        seqs = pad_batch(rows, dev)
        logits = model(seqs[:, :-1])
        t = torch.arange(seqs.size(1) - 1, device=dev)[None]
        mask = ((t >= torch.tensor([len(p) - 1 for p in prompts], device=dev)[:, None])
                & (t < torch.tensor([len(r) for r in rows], device=dev)[:, None] - 1))   # answer tokens [B, L-1]
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

        module, meta = load_drafter(Path(export_dir) / version, device=next(self.policy.parameters()).device)
        self.set_drafter(module.to(next(self.policy.parameters()).dtype), meta.get("arch"),
                         new_version=self.drafter_version is not None)
        self.drafter_version = version
        return True

    # ---- one step
    def measures_plain(self) -> bool:
        """Whether this step also rolls out plainly: every plain_every-th step (counted from 1, as the
        metrics lines are), and only when the rollout would speculate at all."""
        every = self.cfg.plain_every
        return (every > 0 and (self.step_idx + 1) % every == 0 and self.engine.drafter is not None
                and self.engine.cfg.speculative)

    def rollout(self) -> tuple[list[Example], RolloutResult, dict[str, Any]]:
        g = self.cfg.group_size
        exs = [self.task.sample(self.rng) for _ in range(self.cfg.prompts_per_step)]
        prompts = [self.task.prompt_ids(e) for e in exs for _ in range(g)]
        B = len(prompts)
        tail: dict[str, Any] = {"wid": None, "published": 0, "pending": [], "publish_s": 0.0}
        publish = self.producer is not None
        if self.measures_plain():
            # Before the speculative run, from the state it starts from (restored afterwards: sidebyside.py).
            t_plain = time.perf_counter()
            tail["plain"] = plain_rerun(self.engine, prompts, keep_hidden=publish or self.keep_hidden)
            tail["plain_wall_s"] = time.perf_counter() - t_plain

        def send(ids: list[int], res: RolloutResult) -> None:
            t_send = time.perf_counter()
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
            tail["publish_s"] += time.perf_counter() - t_send

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
                tail["wid"] = self.producer.window_start(WindowKind.ROLLOUT_TAIL, stage=self.stage, step=self.step_idx,
                                                         predicted_duration_ns=self._tail_pred_ns)
                send(tail["pending"], eng.result)
                tail["pending"] = []

        t_gen = time.perf_counter()
        res = self.engine.generate(prompts, keep_hidden=publish or self.keep_hidden, on_step=on_step, on_finish=on_finish)
        tail["generate_s"] = time.perf_counter() - t_gen
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
        t0 += tail.get("plain_wall_s", 0.0)     # a plain rerun is a measurement, not part of the step it measures
        g, dev = self.cfg.group_size, next(self.policy.parameters()).device
        rewards = torch.tensor([self.task.reward(exs[i // g], r) for i, r in enumerate(res.responses)])
        adv = group_advantages(rewards, g).to(dev)
        temp = self.rcfg.temperature
        # Length-sorted micro-batches, each padded to its own longest row: with long-tailed responses
        # one long row does not pad every other row to its length. Same loss (token mean over all
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
        plain_s = plain_tokens = None
        if "plain" in tail:
            # The rollout phase as it would have been with plain decoding: the same prompts, publishing
            # and barrier; only the decoding (generate minus the publishing inside its callbacks) swapped.
            decode_s = tail["generate_s"] - tail["publish_s"]
            plain_s, plain_tokens = (t1 - t0) - decode_s + tail["plain"].seconds, tail["plain"].tokens
        out = StepResult(step=self.step_idx, reward_mean=float(rewards.mean()), loss=float(loss.detach()), kl=float(kl),
                         rollout_s=t1 - t0, train_s=t2 - t1, step_s=t2 - t0, tokens=sum(lens),
                         response_len_mean=sum(lens) / len(lens), response_len_max=max(lens),
                         acceptance_length=res.stats.acceptance_length, spec_steps=res.stats.spec_steps,
                         tail_s=tail.get("actual_ns", 0) / 1e9, published=tail["published"],
                         plain_rollout_s=plain_s, plain_tokens=plain_tokens,
                         plain_share=res.stats.plain_share, k_histogram=res.stats.k_histogram)
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


__all__ = ["GRPOConfig", "GRPOTrainer", "StepResult", "group_advantages", "grpo_loss",
           "pad_batch", "response_logprobs", "sft_warmup"]
