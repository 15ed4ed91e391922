"""The decoding engine: batched, KV-cached generation for a target and (optionally) a drafter, the
draft-verify loop around `sampling.speculative_step`.

Layout. Every row keeps its own length; the models run with per-row positions `pos` [B, T], so rows
of different lengths share one forward and a row's cache slots [0, len) are always its committed
tokens. A row's newest token is *pending*: the target has processed tokens [0, len-1) and the next
forward feeds token len-1 (plain: alone; speculative: followed by k drafts). Padding entries (rows
already finished, ragged catch-up chunks) go to a trash slot (the cache's last slot) that no real
query can see. Rows that finish are dropped by compacting the batch to a power-of-two bucket, in place
in the first rows of the buffers, so CUDA graphs captured per bucket keep their addresses.

Drafter sync is lazy (which token a drafter cache entry holds: `adapters`): the engine tracks per row how many committed tokens the drafter has consumed
(`dlen`). A speculative step first feeds only the missing suffix [dlen, len) in one forward (one or two
tokens in steady state; the tokens decoded plainly since the drafter was last used after switching
on), so turning speculation on mid-rollout never recomputes a prefix. The Eagle drafter reads the
target's hidden states from `hid`, which every target forward fills anyway (and which the RL loop
publishes for drafter training, so no extra prefill anywhere). An EAGLE-3 drafter (adapter
`feature_layers` set) reads `feat` instead: the residual stream before its three feature layers,
[B, cache_len, 3H], which the same target forwards return (`features=`, hf.stage) and which exists
only while such a drafter is set. Compaction moves the drafter's cache rows lazily too (`_dperm`:
slot -> the drafter cache row holding that slot's entries, applied at the next catch-up), so a step
with k = 0 is plain decoding's step: no drafter forward, no drafter cache work.

Adaptive: `controller.DraftController` picks k in 0..K per step, keyed by the physical batch bucket,
from a cost model measured on this engine (`_calibrate` prices a bucket once before it may speculate;
every forward refreshes it) and the running acceptance; off above batch_threshold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_api.names import BANDIT
from spectrain_workloads.model import KVCache, Transformer, causal_decode_mask
from spectrain_workloads.specdec.adapters import DraftAdapter, as_drafter
from spectrain_workloads.specdec.config import RolloutConfig, RolloutResult, RolloutStats
from spectrain_workloads.specdec.controller import DraftController
from spectrain_workloads.specdec.cuda_graphs import CudaGraphs
from spectrain_workloads.specdec.sampling import AcceptRule, pick, rejection_rule, speculative_step, to_probs

NEW_VERSION_TRIALS = 8.0    # weight (in trials) of the old acceptance estimate when a drafter's newer version arrives


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class RolloutEngine:
    """generate(prompts) with the target alone (plain) or with a drafter (speculative, adaptive).

    The same module may be trained between rollouts (RL): caches are re-set up per rollout batch
    and training forwards (pos=None) ignore them.
    """

    def __init__(self, target: Transformer, cfg: RolloutConfig, drafter: nn.Module | DraftAdapter | None = None,
                 *, drafter_arch: str | None = None, rule: AcceptRule = rejection_rule) -> None:
        self.target, self.cfg, self.rule = target, cfg, rule
        self.device = next(target.parameters()).device
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.controller = DraftController(max_draft=cfg.max_draft_tokens, batch_threshold=cfg.batch_threshold,
                                          strategy=cfg.strategy)
        self.graphs = CudaGraphs() if cfg.cuda_graphs and self.device.type == "cuda" else None
        # The controller's clock. On one CPU thread an engine's cost is its CPU time: wall time on a shared
        # machine adds the waits for a core, which hit plain and speculative steps alike and only add
        # noise. Otherwise (CUDA, several threads) wall time, after a synchronize.
        single_cpu = self.device.type == "cpu" and torch.get_num_threads() == 1
        self.clock: Callable[[], float] = time.process_time if single_cpu else time.perf_counter
        self.drafter: DraftAdapter | None = None
        self._alloc: tuple[int, int] = (0, 0)            # (batch, cache_len) the caches were set up for
        self._kv: list[KVCache] = []
        self._n_dkv = 0                                  # how many of _kv are the drafter's (the last ones)
        self._dperm: torch.Tensor | None = None          # [nb] slot -> drafter cache row, while compaction is pending
        self._features: tuple[int, ...] | None = None    # the EAGLE-3 drafter's feature layers (None: no `feat`)
        self.set_drafter(drafter, drafter_arch)

    def set_drafter(self, drafter: nn.Module | DraftAdapter | None, arch: str | None = None, *,
                    new_version: bool = False) -> None:
        """Swap the drafter. new_version: a newer export of the drafter in use (its acceptance estimate
        carries over with little weight); else acceptance statistics start over from the prior."""
        had = self.drafter is not None
        self.drafter = as_drafter(drafter, arch) if drafter is not None else None
        self._features = self.drafter.feature_layers if self.drafter is not None else None
        if self._features and not getattr(self.target, "captures_features", False):
            raise ConfigError(f"an EAGLE-3 drafter reads the target's residual stream before layers "
                              f"{list(self._features)}; a {type(self.target).__name__} target cannot return it "
                              "(Hugging Face targets, hf.stage.HFStage, can)")
        carry = new_version and had
        self.controller.reset_acceptance(carry_trials=NEW_VERSION_TRIALS if carry else 0.0)
        if not carry:        # another drafter: its forward costs are unknown (a new version has the same shape)
            self.controller.reset_drafter_costs()
        self._alloc = (0, 0)
        if self.graphs is not None:
            self.graphs.drop("d")

    # ---- buffers: base tensors allocated once per (batch, cache_len); the live batch is a prefix view
    def _modules_kv(self) -> list[KVCache]:
        """The target's caches, then the drafter's own (the last `self._n_dkv`; none when the drafter is
        the target module itself, whose caches are the target's)."""
        kv = [m for m in self.target.modules() if isinstance(m, KVCache)]
        seen = {id(m) for m in kv}
        mods = self.drafter.module.modules() if self.drafter is not None else iter(())
        dkv = [m for m in mods if isinstance(m, KVCache) and id(m) not in seen]
        self._n_dkv = len(dkv)
        return kv + dkv

    def _setup(self, batch: int, cache_len: int) -> None:
        stale = self._alloc == (0, 0) or [id(m) for m in self._modules_kv()] != [id(m) for m in self._kv]
        if stale or batch > self._alloc[0] or cache_len > self._alloc[1]:   # stale: another engine set them up
            if cache_len > self.target.cfg.max_seq_len:
                raise ConfigError(
                    f"prompt + rl.maxNewTokens + maxDraftTokens + 2 = {cache_len} exceeds the model's "
                    f"max_seq_len {self.target.cfg.max_seq_len}; lower rl.maxNewTokens or raise max_seq_len")
            self.target.setup_caches(batch, cache_len)
            if self.drafter is not None:
                self.drafter.setup_caches(batch, cache_len)
            self._alloc = (batch, cache_len)
            if self.graphs is not None:
                self.graphs = CudaGraphs()
            self._kv = self._modules_kv()
            self._kv_base: list[tuple[torch.Tensor, torch.Tensor]] = [(kv.k, kv.v) for kv in self._kv]  # type: ignore[misc]
            H, dt = self.target.cfg.dim, next(self.target.parameters()).dtype
            self._tok_base = torch.zeros(batch, cache_len, dtype=torch.long, device=self.device)
            self._hid_base = torch.zeros(batch, cache_len, H, dtype=dt, device=self.device)
            self._feat_base = (torch.zeros(batch, cache_len, len(self._features) * H, dtype=dt, device=self.device)
                               if self._features else None)
        self._view(batch)

    def _view(self, nb: int) -> None:
        for kv, (k, v) in zip(self._kv, self._kv_base, strict=False):
            kv.k, kv.v = k[:nb], v[:nb]
        self.tok, self.hid = self._tok_base[:nb], self._hid_base[:nb]
        self.feat = self._feat_base[:nb] if self._feat_base is not None else None
        self.nb = nb

    def _compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` [m] (slot indices, actives first) to slots 0..m-1 and shrink the view to m.
        The drafter's cache rows move only when it is next used (`_sync_drafter_rows`)."""
        m = keep.numel()
        for k, v in self._kv_base[: len(self._kv_base) - self._n_dkv]:
            k[:m] = k[keep]
            v[:m] = v[keep]
        if self._n_dkv:
            self._dperm = keep if self._dperm is None else self._dperm[keep]
        self._tok_base[:m] = self._tok_base[keep]
        self._hid_base[:m] = self._hid_base[keep]
        if self._feat_base is not None:
            self._feat_base[:m] = self._feat_base[keep]
        for name in ("length", "dlen", "limit", "active", "row"):
            setattr(self, name, getattr(self, name)[keep])
        self._view(m)

    def _sync_drafter_rows(self) -> None:
        """Apply the compactions since the drafter was last used to its cache rows."""
        if self._dperm is None:
            return
        m = self._dperm.numel()
        for k, v in self._kv_base[len(self._kv_base) - self._n_dkv:]:
            k[:m] = k[self._dperm]
            v[:m] = v[self._dperm]
        self._dperm = None

    # ---- forwards
    def _timed(self, kind: str, shape: torch.Size, fn: Callable[[], Any], record: bool = True) -> Any:
        """fn's output; its seconds go to the cost model under (kind, batch bucket, tokens per row)."""
        t0 = self.clock()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if record:
            self.controller.record_forward(kind, shape[0], shape[1], self.clock() - t0)
        return out

    def _target_fwd(self, tokens: torch.Tensor, pos: torch.Tensor, record: bool = True) -> tuple[torch.Tensor, ...]:
        fn = self._target_call
        graphs = self.graphs
        if graphs is not None:
            return self._timed("target", tokens.shape, lambda: graphs.run(("t", *tokens.shape), fn, tokens, pos), record)
        return self._timed("target", tokens.shape, lambda: fn(tokens, pos), record)

    def _target_call(self, tokens: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> (logits [B, T, V], final-norm hidden [B, T, H]) and, for an EAGLE-3 drafter, features [B, T, 3H]."""
        extra = {"features": self._features} if self._features else {}
        out: tuple[torch.Tensor, ...] = self.target(tokens, pos, causal_decode_mask(pos, self.cache_len),
                                                    return_hidden=True, **extra)
        return out

    def _draft_fwd(self, tokens: torch.Tensor, hidden: torch.Tensor | None, pos: torch.Tensor,
                   graph: bool, record: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.drafter is not None
        d = self.drafter

        def fn(tokens: torch.Tensor, pos: torch.Tensor, *hidden: torch.Tensor) -> Any:
            return d.forward(tokens, hidden[0] if hidden else None, pos, causal_decode_mask(pos, self.cache_len))
        args = (tokens, pos) + ((hidden,) if hidden is not None else ())
        graphs = self.graphs
        if graphs is not None and graph:
            return self._timed("draft", tokens.shape, lambda: graphs.run(("d", *tokens.shape), fn, *args), record)
        return self._timed("draft", tokens.shape, lambda: fn(*args), record)

    def _calibrate(self) -> None:
        """Price the current bucket before it may speculate: target forwards over 1 and K + 1 tokens per
        row and a drafter forward over 1, each run once untimed (first-call allocation, graph capture)
        and once timed. Every entry goes to the trash slot, which no real query reads."""
        assert self.drafter is not None
        nb, dev = self.nb, self.device
        for T in (1, self.cfg.max_draft_tokens + 1):
            tok = torch.zeros(nb, T, dtype=torch.long, device=dev)
            pos = torch.full((nb, T), self.trash, device=dev)
            for record in (False, True):
                self._target_fwd(tok, pos, record)
        tok, pos = torch.zeros(nb, 1, dtype=torch.long, device=dev), torch.full((nb, 1), self.trash, device=dev)
        src = self._feat_base if self._feat_base is not None else self._hid_base
        hidden = src[:nb, :1] if self.drafter.needs_hidden else None      # [nb, 1, H or 3H]: any values
        for record in (False, True):
            self._draft_fwd(tok, hidden, pos, graph=True, record=record)
        self.controller.calibrated.add(nb)

    def _verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [nb, T] at positions len-1 .. len-2+T; stores their hidden states; -> logits [nb, T, V]."""
        ar = torch.arange(tokens.size(1), device=self.device)
        pos = torch.where(self.active[:, None], self.length[:, None] - 1 + ar, self.trash)   # [nb, T]
        logits, *states = self._target_fwd(tokens, pos)
        self._store(pos.clamp(max=self.trash - 1), *states)
        return logits

    def _store(self, slots: torch.Tensor, hidden: torch.Tensor, feats: torch.Tensor | None = None) -> None:
        """Keep a target forward's hidden states (and features) at `slots` [nb, T] of each row."""
        self.hid[self.rows[:, None], slots] = hidden
        if feats is not None and self.feat is not None:
            self.feat[self.rows[:, None], slots] = feats

    def _draft_next_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """draft_next for sampling.speculative_step; its first call catches the drafter up lazily."""
        d = self.drafter
        assert d is not None
        state: dict[str, Any] = {}

        def draft_next(tok: torch.Tensor) -> torch.Tensor:          # tok [nb] -> logits [nb, V]
            if not state:   # feed tokens [dlen, len) (the last is `tok`); ragged rows padded to the trash
                self._sync_drafter_rows()
                cnt = torch.where(self.active, self.length - self.dlen, 1)                       # [nb]
                C = int(cnt.max())
                j = self.dlen[:, None] + torch.arange(C, device=self.device)                     # [nb, C]
                real = (j < self.length[:, None]) & self.active[:, None]
                pos = torch.where(real, j - d.offset, self.trash)
                jj = j.clamp(max=self.trash - 1)
                toks = self.tok[self.rows[:, None], jj]                                          # [nb, C]
                src = self.feat if self.feat is not None else self.hid                           # [nb, L, H or 3H]
                hidden = src[self.rows[:, None], (jj - 1).clamp(min=0)] if d.needs_hidden else None
                t0 = self.clock()
                logits, h = self._draft_fwd(toks, hidden, pos, graph=C == 1)
                state["catchup_s"] = self.clock() - t0
                last = (cnt - 1)[:, None]
                state["pos"] = torch.where(self.active, self.length - d.offset, self.trash)      # [nb]
                state["h"] = h.gather(1, last[..., None].expand(-1, 1, h.size(-1))) if h is not None else None
                return logits.gather(1, last[..., None].expand(-1, 1, logits.size(-1)))[:, 0]
            logits, h = self._draft_fwd(tok[:, None], state["h"], state["pos"][:, None], graph=True)
            state["pos"] = torch.where(self.active, state["pos"] + 1, self.trash)
            state["h"] = h
            return logits[:, 0]

        draft_next.state = state  # type: ignore[attr-defined]
        return draft_next

    # ---- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, speculative: bool | None = None, keep_hidden: bool = False,
                 on_step: Callable[[int, RolloutEngine], None] | None = None,
                 on_finish: Callable[[list[int], RolloutResult], None] | None = None) -> RolloutResult:
        """Generate up to max_new_tokens per prompt (stops at EOS). on_step(n_active, engine) runs after
        every decode step (`engine.result` is the partial result); on_finish(row ids, partial result)
        whenever rows finish."""
        cfg, s, dev = self.cfg, self.cfg.sampling, self.device
        spec = (cfg.speculative if speculative is None else speculative) and self.drafter is not None
        if not prompts or any(len(p) < 1 for p in prompts):
            raise ConfigError("every prompt needs at least one token (BOS)")
        B, lens = len(prompts), [len(p) for p in prompts]
        self.cache_len = max(lens) + cfg.max_new_tokens + cfg.max_draft_tokens + 2
        self._setup(B, self.cache_len)
        self.cache_len = self._alloc[1]
        self.trash = self.cache_len - 1
        self.rows = torch.arange(B, device=dev)
        self.row = torch.arange(B, device=dev)          # slot -> original row id
        self.length = torch.tensor(lens, device=dev)
        self.limit = self.length + cfg.max_new_tokens
        self.active = torch.ones(B, dtype=torch.bool, device=dev)
        self.dlen = torch.full((B,), self.drafter.offset if self.drafter else 0, device=dev)
        self._dperm = None                              # fresh rows: the drafter's old cache rows are not read
        for i, prompt in enumerate(prompts):
            self.tok[i, : len(prompt)] = torch.tensor(prompt, device=dev)
        result = self.result = RolloutResult([list(p) for p in prompts], lens, [None] * B, RolloutStats())
        self.controller.new_rollout()
        t_start = time.perf_counter()

        W = max(lens) - 1                                # prefill all but each row's pending last token
        if W > 0:
            ar = torch.arange(W, device=dev)
            pos = torch.where(ar < self.length[:, None] - 1, ar, self.trash)                  # [B, W]
            _, *states = self._target_call(self.tok[:, :W], pos)       # no graph: a one-off shape
            self._store(ar.expand(B, W), *states)

        st = result.stats

        def horizon() -> int:       # without EOS every row runs to its budget: the largest one left
            return int((self.limit - self.length)[self.active].max())

        horizon_fn = horizon if cfg.eos_id is None else None
        while True:
            n_active = int(self.active.sum())
            if n_active == 0:
                break
            if n_active <= self.nb // 2:             # drop finished rows: compact to a power-of-two bucket
                order = torch.argsort((~self.active).to(torch.int8), stable=True)
                self._compact(order[: _next_pow2(n_active)])
                self.rows = torch.arange(self.nb, device=dev)
            # The drafter needs each row to hold more than `offset` tokens: true after the first step
            # (every active row commits a token per step), so checked on the prompts only.
            can = (spec and self.drafter is not None and n_active <= cfg.batch_threshold
                   and (st.decode_steps > 0 or min(lens) > self.drafter.offset))
            if can and cfg.strategy == BANDIT and self.nb not in self.controller.calibrated:
                self._calibrate()
            # A step's price is all it costs: the choice, the forwards and the bookkeeping after them
            # (a speculative step's bookkeeping is heavier; left out, drafting would look cheaper).
            t0 = self.clock()
            k = self.controller.choose(self.nb, n_active, can, horizon_fn)
            old_len = self.length
            last = self.tok[self.rows, self.length - 1]                                       # [nb]
            if k == 0:
                p = to_probs(self._verify(last[:, None])[:, 0], s)                            # [nb, V]
                new, n_acc = pick(p, s, self.gen)[:, None], torch.zeros_like(last)           # [nb, 1]
                catchup = 0.0
            else:
                draft_next = self._draft_next_fn()
                draft, n_acc, nxt = speculative_step(draft_next, self._verify, last, k, s, self.gen, self.rule)
                new = torch.cat([draft, nxt[:, None]], 1).scatter(1, n_acc[:, None], nxt[:, None])   # [nb, k+1]
                catchup = draft_next.state["catchup_s"]  # type: ignore[attr-defined]
            # commit: accepted drafts + the target's token, cut at EOS and at the row's budget
            j = torch.arange(new.size(1), device=dev)
            cnt = n_acc + 1
            eos_hit = torch.zeros_like(self.active)
            if cfg.eos_id is not None:
                is_eos = (new == cfg.eos_id) & (j < cnt[:, None])
                eos_hit = is_eos.any(1)
                cnt = torch.where(eos_hit, is_eos.int().argmax(1) + 1, cnt)
            cnt = torch.minimum(cnt, self.limit - self.length) * self.active
            wpos = (self.length[:, None] + j).clamp(max=self.trash - 1)
            self.tok[self.rows[:, None], wpos] = new          # entries past cnt are uncommitted scratch
            self.length = self.length + cnt
            if k > 0 and self.drafter is not None:
                kept = torch.minimum(n_acc, torch.full_like(n_acc, k - 1)) if self.drafter.keeps_drafts else 0
                self.dlen = torch.where(self.active, torch.minimum(old_len + kept, self.length), self.dlen)
            done = self.active & (eos_hit | (self.length >= self.limit))
            act = self.active
            self.active = self.active & ~done
            # bookkeeping (one host sync)
            st.decode_steps += 1
            st.committed += int(cnt.sum())
            st.trace.append((n_active, self.nb, k))
            if k > 0:
                self.controller.record_acceptance(n_acc[act], k, self.nb)
                if cfg.eos_id is None:      # what the step saved: the rows' tokens to go, before and after
                    self.controller.record_value(self.nb, k, (self.limit - old_len)[act].tolist(),
                                                 (self.limit - self.length)[act].tolist())
                st.spec_steps += 1
                st.verified_rows += n_active
                st.accepted += int(n_acc[act].sum())
                st.drafted += k * n_active
            dt, switch = self.clock() - t0, 0.0
            if k > 0:
                # a long catch-up (after plain steps) is the price of switching, not of this arm: the
                # arm is priced with the steady state's one drafter forward, the rest is the switch's
                switch = catchup - (self.controller.forward_time("draft", self.nb, 1) or catchup)
            self.controller.record_step(self.nb, k, dt - switch, switch_s=switch)
            finished = done.nonzero()[:, 0].tolist()
            if finished:
                ids = []
                for slot in finished:
                    i, n = int(self.row[slot]), int(self.length[slot])
                    result.sequences[i] = self.tok[slot, :n].tolist()
                    if keep_hidden:
                        result.hidden[i] = self.hid[slot, : n - 1].clone()
                    ids.append(i)
                if on_finish is not None:
                    on_finish(ids, result)
            if on_step is not None:
                on_step(int(self.active.sum()), self)
        st.seconds = time.perf_counter() - t_start
        return result


__all__ = ["NEW_VERSION_TRIALS", "RolloutEngine"]
