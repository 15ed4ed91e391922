"""The draft-length controller: a measured cost model, and per decode step the k in 0..K that commits
the most tokens per second, so speculation runs only where it pays.

Decision. A step of physical batch bucket nb (the rows every forward runs on) with k drafted tokens
commits per row E_k = (1 - a^(k+1)) / (1 - a) tokens in expectation (i.i.d. per-token acceptance a:
the accepted drafts plus the target's own token; E_0 = 1) and takes S(nb, k) seconds. What ends a
rollout is its last row, so the value of a step is the progress of that row (`progress`): E_k when
rows end at EOS (the longest answer's row), less when every row runs to its budget (the slowest of
n rows). The gain of arm k over plain is G_k = progress_k * S(nb, 0) / S(nb, k); the controller
speculates with the best arm only when G_k > 1 + margin (estimates are noisy; a tie is not worth
drafting for).

Cost model (per controller = per engine, i.e. per device and (target, drafter) pair; seconds):
  S(nb, 0) = P(nb): median of the bucket's last plain steps (each plain step refreshes it);
  S(nb, k): the median of arm k's last steps once it has `min_samples`, else the model
            P(nb) + V(nb, k+1) - V(nb, 1) + k * D(nb) + X(nb), where
  V(nb, T): one target forward over T tokens per row (verifying k = T - 1 drafts), piecewise linear
            in T between the measured T, monotone;
  D(nb):    one drafter forward over one token per row (the cost of one drafted token);
  X(nb):    the rest of a speculative step (sampling drafts, the rejection rule, catch-up tokens):
            the median residual of the bucket's measured speculative steps against the terms above.
V and D are measured when a bucket first may speculate (the engine's `_calibrate`: forwards at
T = 1 and K + 1 into its trash slot) and refreshed by every real forward afterwards. A measured
S(nb, k) below P(nb) + V(nb, k+1) - V(nb, 1) + k * D(nb) is raised to it: a busy machine's timings
must not make drafting look cheaper than the work it adds. Seconds are the engine's clock (CPU time
on one CPU thread, else wall time).

Acceptance per bucket: accepted / trials of the rejection rule (a row that accepts n < k drafts saw
n + 1 trials), forgetting old trials beyond `forget_trials` (the drafter keeps training during a
run), shrunk toward the pooled estimate of all buckets with `shrink` pseudo-trials; the pooled one
starts from a prior of `prior_trials` trials at `prior_alpha`.

Value without EOS (rows running to their budget; F and the model's value: `value`). Per bucket the
controller keeps realized extra value (F(before) - F(after)) / P(nb) - 1 over the model's in the same
state, from `value_prior` tokens at ratio 1, forgetting beyond `forget_tokens`; it scales every arm's
extra progress. Plain prices are fixed per rollout (`price`), so a rollout's values add up.

Exploration budget. A step that the estimates do not choose (a probe of k > 0 while plain wins, or a
plain step while speculating, which keeps P current) is charged its regret: its time minus the time
the chosen policy needs for the tokens it committed (without EOS: its realized value), plus a probe's
catch-up (the drafter feeding the tokens decoded plainly since it last ran: after a long plain run
about a plain step) unless the probe turns the bucket to speculating. Such steps run only while the
charged regret is <= `explore` x the time of every recorded step: at most that share of decode time
plus one step. A probe runs when optimistic estimates (acceptance: mean + 2 standard errors; value
ratio: plus its uncertainty, at most 1) say drafting could win, or when the bucket has not been probed
for `stale_steps` steps (a drafter that improved is noticed after its estimate settled at "useless").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from spectrain_api.names import FIXED
from spectrain_workloads.specdec import value

ARMS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)   # draft lengths the controller prices (plus max_draft itself)


class _Window:
    """The last n samples of one timing; its median is robust to the spikes of a shared machine."""

    __slots__ = ("xs", "n", "_median")

    def __init__(self, n: int) -> None:
        self.xs: list[float] = []
        self.n = n
        self._median: float | None = None

    def __len__(self) -> int:
        return len(self.xs)

    def add(self, x: float) -> None:
        self.xs.append(x)
        if len(self.xs) > self.n:
            del self.xs[0]
        self._median = None

    def median(self) -> float:
        # Cached: read on every decode step; sorting each time would cost a few percent of a small
        # model's CPU step.
        if self._median is None:
            s = sorted(self.xs)
            m = len(s) // 2
            self._median = s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])
        return self._median


class DraftController:
    """choose(bucket, n_active, can_draft) -> k (0: plain) per decode step; record_* feed the estimates.

    Strategy "Fixed" always drafts max_draft (where drafting is allowed); "Bandit" decides as above.
    """

    REPLAN_ALPHA = 0.02     # an acceptance estimate that moved by more than this replans its bucket at once

    def __init__(self, *, max_draft: int, batch_threshold: int, strategy: str, margin: float = 0.08,
                 explore: float = 0.01, window: int = 9, min_samples: int = 3, stale_steps: int = 256,
                 replan_every: int = 16, remeasure_every: int = 64, prior_alpha: float = 0.5,
                 prior_trials: float = 2.0, forget_trials: float = 512.0, shrink: float = 4.0,
                 value_prior: float = 4.0, forget_tokens: float = 256.0) -> None:
        self.max_draft, self.batch_threshold, self.strategy = max_draft, batch_threshold, strategy
        self.margin, self.explore, self.window, self.min_samples = margin, explore, window, min_samples
        self.stale_steps, self.replan_every, self.remeasure_every = stale_steps, replan_every, remeasure_every
        self.prior_alpha, self.prior_trials = prior_alpha, prior_trials
        self.forget_trials, self.shrink = forget_trials, shrink
        self.value_prior, self.forget_tokens = value_prior, forget_tokens
        self.arms = sorted({k for k in ARMS if k <= max_draft} | {max_draft})
        self.step_s: dict[tuple[int, int], _Window] = {}              # (bucket, k) -> seconds per step
        self.fwd_s: dict[tuple[str, int], dict[int, _Window]] = {}    # (kind, bucket) -> T -> seconds per forward
        self.resid_s: dict[int, _Window] = {}                          # bucket -> X samples
        self.calibrated: set[int] = set()
        self.elapsed_s = 0.0            # every recorded step
        self.regret_s = 0.0             # exploration steps' charged regret
        self._plan: dict[int, tuple[int, float, int, float, float, float]] = {}   # bucket -> _replan's
        self._plan_age: dict[int, int] = {}
        self._since_probe: dict[int, int] = {}
        self._spec_run: dict[int, int] = {}                            # spec steps since plain was measured
        self._explore_step = False
        self._exploiting = False        # the last choose() speculated because the estimates say it pays
        self._switch_due: dict[int, float] = {}                        # bucket -> a probe's catch-up seconds
        self._prices: dict[int, float] = {}                            # bucket -> this rollout's plain price
        self._rng = random.Random(0)                                   # expected_value's draws
        self._tokens_per_row = 1.0      # the last step's committed tokens per active row
        self.accepted, self.trials = 0.0, 0.0    # pooled over buckets (set by reset_acceptance)
        self.reset_acceptance()

    # ---- acceptance
    def reset_acceptance(self, carry_trials: float = 0.0) -> None:
        """A new drafter: acceptance restarts from the prior, or (carry_trials > 0, a newer version of
        the same drafter) from the current pooled estimate weighted as that many trials, so the new
        version's own acceptance takes over within a few steps; probing starts over."""
        if carry_trials > 0 and self.trials > 0:
            a = self.accepted / self.trials
            self.trials = min(self.trials, carry_trials)
            self.accepted = a * self.trials
        else:
            self.accepted, self.trials = self.prior_alpha * self.prior_trials, self.prior_trials
        self.acc: dict[int, tuple[float, float]] = {}                  # bucket -> (accepted, trials)
        self.extra: dict[int, tuple[float, float]] = {}                # bucket -> (realized, predicted) extra value
        self._since_probe.clear()
        self._plan.clear()

    def reset_drafter_costs(self) -> None:
        """A drafter of another shape: its forward times, and the speculative steps built on them, are stale."""
        self.fwd_s = {key: t for key, t in self.fwd_s.items() if key[0] != "draft"}
        self.step_s = {key: w for key, w in self.step_s.items() if key[1] == 0}
        self.resid_s.clear()
        self.calibrated.clear()
        self._plan.clear()

    @property
    def alpha(self) -> float:
        """Pooled per-token acceptance over all buckets."""
        return min(self.accepted / self.trials, 0.999)

    def alpha_for(self, bucket: int) -> tuple[float, float]:
        """(per-token acceptance estimate, effective trials) for one bucket."""
        acc, tr = self.acc.get(bucket, (0.0, 0.0))
        n = tr + self.shrink
        return min((acc + self.shrink * self.alpha) / n, 0.999), n

    def value_ratio(self, bucket: int, optimistic: bool = False) -> float:
        """Realized / predicted extra value of this bucket's speculative steps (rows to their budget);
        optimistic: plus its uncertainty, 1 / sqrt(1 + predicted / value_prior) (1 with nothing seen, ~0.12
        once `forget_tokens` are), at most max(ratio, 1)."""
        real, pred = self.extra.get(bucket, (0.0, 0.0))
        ratio = max(0.0, (real + self.value_prior) / (pred + self.value_prior))
        if not optimistic:
            return ratio
        return min(max(ratio, 1.0), ratio + 1 / math.sqrt(1 + pred / self.value_prior))

    def new_rollout(self) -> None:
        """A rollout starts: the plain prices `finish_time` uses are fixed for its length (`price`)."""
        self._prices.clear()

    def price(self, bucket: int) -> float:
        """The plain step price of `bucket` that values steps during this rollout: measured, else the
        nearest measured larger bucket's (assuming no saving), else the nearest smaller one's. Fixed from
        its first use to the next `new_rollout`, so the values of a rollout's steps add up to its plain
        time (F telescopes), whatever bucket a step ran in and however the measurements moved since."""
        p = self._prices.get(bucket)
        if p is None:
            measured = sorted(b for b, k in self.step_s if k == 0)
            larger = [b for b in measured if b >= bucket]
            near = larger[0] if larger else (measured[-1] if measured else None)
            p = self._prices[bucket] = (self.plain_time(near) or 0.0) if near is not None else 0.0
        return p

    def finish_time(self, left: list[int], bucket: int) -> float:
        """F at this rollout's prices (`value.finish_time`)."""
        return value.finish_time(left, bucket, self.price)

    expected_tokens = staticmethod(value.expected_tokens)
    progress = staticmethod(value.progress)

    # ---- costs
    def plain_time(self, bucket: int) -> float | None:
        w = self.step_s.get((bucket, 0))
        return w.median() if w is not None else None

    def forward_time(self, kind: str, bucket: int, T: int) -> float | None:
        """One forward over T tokens per row: measured, or piecewise linear between the measured T and
        extended with the last slope; made monotone in T (a forward over more tokens is no faster)."""
        table = self.fwd_s.get((kind, bucket))
        if not table:
            return None
        pts, best = [], 0.0
        for t in sorted(table):
            best = max(best, table[t].median())
            pts.append((t, best))
        if T <= pts[0][0]:
            return pts[0][1]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:], strict=False):
            if T <= t1:
                return s0 + (s1 - s0) * (T - t0) / (t1 - t0)
        if len(pts) >= 2:
            (t0, s0), (t1, s1) = pts[-2], pts[-1]
            return s1 + (s1 - s0) * (T - t1) / (t1 - t0)
        return pts[-1][1]

    def _model_terms(self, bucket: int, k: int, plain: float) -> float:
        v1 = self.forward_time("target", bucket, 1)
        vk = self.forward_time("target", bucket, k + 1)
        d = self.forward_time("draft", bucket, 1) or 0.0
        extra = max(0.0, vk - v1) if vk is not None and v1 is not None else 0.0
        return plain + extra + k * d

    def step_time(self, bucket: int, k: int) -> float:
        """S(bucket, k): measured median, or the cost model (needs plain measured first). Never below
        the model's terms without X: a speculative step does a plain step's work plus the extra
        verification tokens and k drafter forwards, however the timings of a busy machine fell."""
        plain = self.plain_time(bucket) or 0.0
        if k == 0:
            return plain
        floor = self._model_terms(bucket, k, plain)
        w = self.step_s.get((bucket, k))
        if w is not None and len(w) >= self.min_samples:
            return max(floor, w.median())
        x = self.resid_s.get(bucket)
        return max(floor, floor + (x.median() if x is not None else 0.0))

    def gains(self, bucket: int, a: float | None = None) -> dict[int, float]:
        """G_k = E_k x S(bucket, 0) / S(bucket, k) for every arm, at acceptance a (default: the estimate)."""
        a = self.alpha_for(bucket)[0] if a is None else a
        plain = self.plain_time(bucket) or 0.0
        return {k: self.expected_tokens(k, a) * plain / max(self.step_time(bucket, k), 1e-12) for k in self.arms}

    def _replan(self, bucket: int, n_active: int = 1, horizon: int | None = None,
                store: bool = True) -> tuple[int, float, int, float, float, float]:
        """(best arm, its gain, best arm at an optimistic acceptance, its gain, the acceptance used, the
        value ratio used); gains from `progress` (n_active rows, horizon: the largest remaining budget,
        None with EOS), their extra tokens scaled by `value_ratio` without EOS."""
        a, n = self.alpha_for(bucket)
        a_opt = min(0.999, a + 2 * math.sqrt(max(a * (1 - a), 0.05 * 0.95) / n))
        plain = self.plain_time(bucket) or 0.0
        cost = {k: max(self.step_time(bucket, k), 1e-12) for k in self.arms}
        ratio, ratio_opt = ((self.value_ratio(bucket), self.value_ratio(bucket, optimistic=True))
                            if horizon is not None else (1.0, 1.0))

        def gain(k: int, alpha: float, r: float) -> float:
            return (1 + (self.progress(k, alpha, n_active, horizon) - 1) * r) * plain / cost[k]
        g = {k: gain(k, a, ratio) for k in self.arms}
        go = {k: gain(k, a_opt, ratio_opt) for k in self.arms}     # probing: optimism on both estimates
        k = max(self.arms, key=lambda j: (g[j], -j))
        k_opt = max(self.arms, key=lambda j: (go[j], -j))
        plan = (k, g[k], k_opt, go[k_opt], a, ratio)
        if store:       # a plan for pricing only (store False) must not replace the one choose() made
            self._plan[bucket] = plan
            self._plan_age[bucket] = 0
        return plan

    # ---- decision
    def _within_budget(self) -> bool:
        return self.regret_s <= self.explore * self.elapsed_s

    def choose(self, bucket: int, n_active: int, can_draft: bool,
               horizon: Callable[[], int] | None = None) -> int:
        """k for the next step; horizon() (asked only when replanning): the active rows' largest remaining
        token budget, for batches whose rows all run to their budget (no EOS); None: rows end at EOS."""
        k = self._choose(bucket, n_active, can_draft, horizon)
        # A probe's catch-up is regret unless the probe turned the bucket to speculating (then it is the
        # price of the switch the estimates chose).
        due = self._switch_due.pop(bucket, 0.0)
        if not self._exploiting:
            self.regret_s += due
        return k

    def _choose(self, bucket: int, n_active: int, can_draft: bool, horizon: Callable[[], int] | None) -> int:
        self._explore_step = self._exploiting = False
        if not can_draft or n_active > self.batch_threshold:
            return 0
        if self.strategy == FIXED:
            return self.max_draft
        if (bucket, 0) not in self.step_s:
            return 0                                          # measure plain first
        age = self._plan_age.get(bucket, 0) + 1
        self._plan_age[bucket] = age
        plan = self._plan.get(bucket)
        if plan is None or age >= self.replan_every:
            plan = self._replan(bucket, n_active, horizon() if horizon is not None else None)
        k, gain, k_opt, gain_opt, _, _ = plan
        if gain > 1 + self.margin:
            self._exploiting = True
            run = self._spec_run.get(bucket, 0) + 1
            self._spec_run[bucket] = run
            if run >= self.remeasure_every and self._within_budget():   # keep P current
                self._spec_run[bucket] = 0
                self._explore_step = True
                return 0
            return k
        since = self._since_probe.get(bucket, 0) + 1
        self._since_probe[bucket] = since
        if (gain_opt > 1 or since >= self.stale_steps) and self._within_budget():
            self._since_probe[bucket] = 0
            self._explore_step = True
            return k_opt
        return 0

    # ---- measurements
    def _add(self, table: dict[Any, _Window], key: Any, seconds: float) -> None:
        w = table.get(key)
        if w is None:
            w = table[key] = _Window(self.window)
        w.add(seconds)

    def record_forward(self, kind: str, bucket: int, tokens_per_row: int, seconds: float) -> None:
        self._add(self.fwd_s.setdefault((kind, bucket), {}), tokens_per_row, seconds)

    def record_acceptance(self, n_accepted: torch.Tensor, k: int, bucket: int) -> None:
        """n_accepted [n]: accepted prefix per active row of a step with k drafts."""
        acc = float(n_accepted.sum())
        trials = acc + float((n_accepted < k).sum())
        self._tokens_per_row = 1.0 + acc / max(1, n_accepted.numel())
        self.accepted, self.trials = self._forget(self.accepted + acc, self.trials + trials)
        cell = self.acc.get(bucket, (0.0, 0.0))
        self.acc[bucket] = self._forget(cell[0] + acc, cell[1] + trials)
        plan = self._plan.get(bucket)
        if plan is not None and abs(self.alpha_for(bucket)[0] - plan[4]) > self.REPLAN_ALPHA:
            del self._plan[bucket]

    def record_value(self, bucket: int, k: int, before: list[int], after: list[int]) -> None:
        """A step with k drafts (rows running to their budget) took the active rows from `before` to
        `after` tokens to go."""
        plain = self.price(bucket)
        if not plain or not before:
            return
        f_before = self.finish_time(before, bucket)
        realized = (f_before - self.finish_time(after, bucket)) / plain
        self._tokens_per_row = realized         # what an exploring step is charged against
        predicted = self.expected_value(k, self.alpha_for(bucket)[0], before, bucket, f_before=f_before)
        real, pred = self.extra.get(bucket, (0.0, 0.0))
        real, pred = real + realized - 1, pred + predicted - 1
        if pred > self.forget_tokens:
            real, pred = real * self.forget_tokens / pred, self.forget_tokens
        self.extra[bucket] = (real, pred)
        plan = self._plan.get(bucket)
        if plan is not None and abs(self.value_ratio(bucket) - plan[5]) > 0.05:
            del self._plan[bucket]

    def expected_value(self, k: int, a: float, before: list[int], bucket: int, samples: int = 4,
                       f_before: float | None = None) -> float:
        """The i.i.d. model's value of a k-draft step from `before`, in plain steps (`value.expected_value`)."""
        plain = self.price(bucket)
        if not plain or not before:
            return 1.0
        return value.expected_value(k, a, before, bucket, self.price, self._rng.random, samples, f_before) / plain

    def _forget(self, accepted: float, trials: float) -> tuple[float, float]:
        if trials <= self.forget_trials:
            return accepted, trials
        return accepted * self.forget_trials / trials, self.forget_trials

    def record_step(self, bucket: int, k: int, seconds: float, switch_s: float = 0.0) -> None:
        """A decode step's time: `seconds` prices arm k (the engine's time less any catch-up beyond one
        drafter forward); `switch_s` is that catch-up (the drafter feeding the tokens decoded plainly
        since it was last used), paid by the decision to switch: counted as decode time, and as regret
        when the step is a probe that does not turn the bucket to speculating (`choose`)."""
        self._add(self.step_s, (bucket, k), seconds)
        self.elapsed_s += seconds + switch_s
        if k > 0:
            plain = self.plain_time(bucket)
            if plain is not None:
                self._add(self.resid_s, bucket, seconds - self._model_terms(bucket, k, plain))
            if len(self.step_s[(bucket, k)]) <= self.min_samples:     # the arm's price just changed source
                self._plan.pop(bucket, None)
        if self._explore_step:
            plan = self._plan.get(bucket) or (self._replan(bucket, store=False) if (bucket, 0) in self.step_s else None)
            if plan is not None:
                k_best, gain = plan[0], plan[1]
                per_token = (self.step_time(bucket, k_best) / self.expected_tokens(k_best, self.alpha_for(bucket)[0])
                             if gain > 1 + self.margin else self.plain_time(bucket) or 0.0)
                done = self._tokens_per_row if k > 0 else 1.0
                self.regret_s += max(0.0, seconds - done * per_token)
                if k > 0:
                    self._switch_due[bucket] = max(0.0, switch_s)
                    self._plan.pop(bucket, None)    # its trials narrow the optimistic bound: replan now
            self._explore_step = False


__all__ = ["ARMS", "DraftController"]
