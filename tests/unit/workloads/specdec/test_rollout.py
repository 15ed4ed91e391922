"""Rollout engine: greedy speculative decoding emits exactly plain greedy decoding's tokens.

float64 models, so kernel-shape-dependent rounding (T=1 vs T=k+1 forwards, batch 1 vs 8) cannot flip
an argmax: any difference is an engine bug, not numerics.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.model import KVCache
from spectrain_workloads.specdec.adapters import EagleDraft, LMDraft
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.controller import DraftController
from spectrain_workloads.specdec.engine import RolloutEngine
from tests.unit.workloads.specdec.drafters import TinyEagle, tiny_model

pytestmark = pytest.mark.unit

torch.set_num_threads(1)
TARGET = tiny_model(1)
BAD_LM = tiny_model(2, n_layers=1)      # untrained: almost every draft is rejected
EAGLE = TinyEagle(TARGET, seed=3)


def naive_greedy(prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding without KV caches: recompute the whole sequence per token."""
    x = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x.append(int(TARGET(torch.tensor([x]))[0, -1].argmax()))
            if x[-1] == eos:
                break
    return x


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[257] + [rng.randrange(256) for _ in range(rng.randrange(0, 9))] for _ in range(n)]


def engine(drafter: object, k: int, *, strategy: str = "Fixed", eos: int | None = None, new: int = 14) -> RolloutEngine:
    cfg = RolloutConfig(max_new_tokens=new, temperature=0, eos_id=eos, max_draft_tokens=k, strategy=strategy)
    return RolloutEngine(TARGET, cfg, drafter)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["bad_lm", "self", "eagle"])
def test_greedy_speculative_equals_plain(batch: int, k: int, drafter: str) -> None:
    ps = prompts(batch, seed=batch * 10 + k)
    ref = [naive_greedy(p, 14) for p in ps]
    d = {"bad_lm": BAD_LM, "self": TARGET, "eagle": EAGLE}[drafter]
    plain = engine(d, k).generate(ps, speculative=False)
    spec = engine(d, k).generate(ps)
    assert plain.sequences == ref
    assert spec.sequences == ref
    assert spec.stats.spec_steps > 0 and plain.stats.spec_steps == 0
    if drafter == "self":   # the target drafting for itself: every draft accepted (caches in sync)
        assert spec.stats.accepted == spec.stats.drafted


def test_eos_and_compaction_match_plain() -> None:
    ps = prompts(16, seed=1)
    free = [naive_greedy(p, 24) for p in ps]
    rows_with = {t: sum(t in s[len(p):] for s, p in zip(free, ps, strict=False)) for s in free for t in s}
    eos = max(rows_with, key=lambda t: (rows_with[t], t))   # a token greedy decoding emits in most rows
    ref = [naive_greedy(p, 24, eos) for p in ps]
    assert len({len(r) - len(p) for r, p in zip(ref, ps, strict=False)}) > 2   # rows end at different steps
    res = engine(BAD_LM, 3, eos=eos, new=24).generate(ps, keep_hidden=True)
    assert res.sequences == ref
    assert min(b for _, b, _ in res.stats.trace) < 16         # the batch was compacted
    for seq, h in zip(res.sequences, res.hidden, strict=False):                # hidden states = a full forward's
        _, full = TARGET(torch.tensor([seq[:-1]]), return_hidden=True)
        assert h is not None and torch.allclose(h, full[0], atol=1e-9)


class ScriptedController(DraftController):
    """Plays a fixed on/off pattern of draft lengths (a real controller with a different policy)."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(max_draft=4, batch_threshold=64, strategy="Bandit")
        self.pattern, self.i = pattern, 0

    def choose(self, bucket: int, n_active: int, can_draft: bool, horizon: object = None) -> int:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)] if can_draft else 0


class RecordingEagle(EagleDraft):
    """Records the real (non-trash) entries every drafter forward consumes."""

    def __init__(self, module: TinyEagle) -> None:
        super().__init__(module)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens, hidden, pos, mask):  # type: ignore[no-untyped-def]
        self.calls.append((tokens.clone(), hidden.clone(), pos.clone()))
        return super().forward(tokens, hidden, pos, mask)


@pytest.mark.parametrize("pattern", [[0, 0, 0, 3, 0, 2, 2, 0, 0, 4], [0, 0, 0, 0, 0, 0, 1, 4]])
def test_switching_mid_rollout_catches_up_only_the_missing_suffix(pattern: list[int]) -> None:
    ps = prompts(1, seed=7)
    ref = [naive_greedy(p, 30) for p in ps]
    rec = RecordingEagle(EAGLE)
    eng = engine(rec, 4, new=30)
    eng.controller = ScriptedController(pattern)
    res = eng.generate(ps)
    assert res.sequences == ref
    seq = ref[0]
    _, h_full = TARGET(torch.tensor([seq]), return_hidden=True)   # [1, T, H]
    ks = [k for _, _, k in res.stats.trace if k > 0]
    calls, fed = iter(rec.calls), []
    for k in ks:                         # each speculative step: one catch-up forward, then k-1 draft forwards
        tokens, hidden, pos = next(calls)
        real = pos[0] < eng.trash
        for t, h, p in zip(tokens[0][real], hidden[0][real], pos[0][real], strict=False):
            assert int(t) == seq[int(p) + 1]                             # entry t = (x_{t+1}, h_t)
            assert torch.allclose(h, h_full[0, int(p)], atol=1e-9)       # the target's true hidden
            fed.append(int(p))
        for _ in range(k - 1):
            next(calls)
    assert next(calls, None) is None
    # every catch-up position fed exactly once (no prefix recomputed), in order, with no gap
    assert fed == list(range(len(fed)))
    assert len(fed) > 10


class RecordingLM(LMDraft):
    """Records the positions every drafter forward writes."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.positions: list[torch.Tensor] = []

    def forward(self, tokens, hidden, pos, mask):  # type: ignore[no-untyped-def]
        self.positions.append(pos.clone())
        return super().forward(tokens, hidden, pos, mask)


def eos_prompts() -> tuple[list[list[int]], int, list[list[int]]]:
    """16 prompts, an EOS token that greedy decoding emits in most rows (rows end at different steps:
    the batch compacts), and the reference continuations."""
    ps = prompts(16, seed=1)
    free = [naive_greedy(p, 24) for p in ps]
    rows_with = {t: sum(t in s[len(p):] for s, p in zip(free, ps, strict=False)) for s in free for t in s}
    eos = max(rows_with, key=lambda t: (rows_with[t], t))
    return ps, eos, [naive_greedy(p, 24, eos) for p in ps]


def test_plain_steps_do_no_drafter_work() -> None:
    """k = 0 is plain decoding: the drafter runs only in the bucket's calibration (into the trash
    slot), and its cache rows stay where they are while the batch compacts."""
    ps, eos, ref = eos_prompts()
    rec = RecordingLM(copy.deepcopy(TARGET))
    cfg = RolloutConfig(max_new_tokens=24, temperature=0, eos_id=eos, max_draft_tokens=3, strategy="Bandit")
    eng = RolloutEngine(TARGET, cfg, rec)
    eng.controller = ScriptedController([0])
    eng.controller.strategy = "Bandit"
    res = eng.generate(ps)
    assert res.sequences == ref
    assert res.stats.plain_share == 1.0 and res.stats.k_histogram == {0: res.stats.decode_steps}
    assert min(b for _, b, _ in res.stats.trace) < 16                  # the batch compacted
    assert rec.positions and all(bool((p == eng.trash).all()) for p in rec.positions)
    dkv = [m for m in rec.module.modules() if isinstance(m, KVCache)]
    assert all(bool((m.k[:, :, : eng.trash] == 0).all()) for m in dkv)   # nothing but the trash slot written


@pytest.mark.parametrize("drafter", ["lm", "eagle"])
def test_lazy_drafter_compaction_keeps_its_cache_rows_right(drafter: str) -> None:
    """Plain steps while rows finish, then speculation: the drafter's cache rows follow the compactions.
    The target drafting for itself (a copy, its own caches) accepts every draft only if they do."""
    ps, eos, ref = eos_prompts()
    d = copy.deepcopy(TARGET) if drafter == "lm" else EAGLE
    cfg = RolloutConfig(max_new_tokens=24, temperature=0, eos_id=eos, max_draft_tokens=4, strategy="Fixed")
    eng = RolloutEngine(TARGET, cfg, d)
    eng.controller = ScriptedController([0, 0, 0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 4, 1])
    res = eng.generate(ps)
    assert res.sequences == ref
    assert len({b for _, b, k in res.stats.trace if k > 0}) > 1          # speculated in several buckets
    if drafter == "lm":
        assert res.stats.accepted == res.stats.drafted > 0


def test_controller_goes_plain_above_threshold_and_for_a_useless_drafter() -> None:
    c = DraftController(max_draft=4, batch_threshold=8, strategy="Bandit")
    assert c.choose(16, 16, True) == 0
    c.record_step(4, 0, 1.0)
    c.record_forward("target", 4, 1, 1.0)
    c.record_forward("target", 4, 5, 1.2)
    c.record_forward("draft", 4, 1, 0.05)
    assert c.choose(4, 4, True) > 0                   # the prior (a = 0.5) says drafting pays here
    c.record_acceptance(torch.zeros(200, dtype=torch.long), 4, 4)   # nothing ever accepted
    c.elapsed_s, c.regret_s = 100.0, 10.0             # exploration budget spent: no probe either
    assert c.choose(4, 4, True) == 0
    assert c.choose(4, 4, False) == 0


def simulate(c: DraftController, steps: int, plain_s: float, spec_s: Callable[[int], float], a: float,
             bucket: int = 4, seed: int = 0, switch_s: float = 0.0) -> list[int]:
    """Drive the controller with synthetic timings: plain steps take plain_s, speculative ones spec_s(k),
    the first after a plain step switch_s more (the drafter's catch-up); every row accepts each draft with
    probability a until the first rejection (the i.i.d. model); forwards priced consistently with the
    step times. -> the k chosen per step."""
    gen = torch.Generator().manual_seed(seed)
    ks: list[int] = []
    for _ in range(steps):
        switch = switch_s if ks and ks[-1] == 0 else 0.0
        k = c.choose(bucket, bucket, True)
        ks.append(k)
        c.record_forward("target", bucket, k + 1, plain_s * 0.9 if k == 0 else spec_s(k) - 0.1 * plain_s * k)
        if k:
            c.record_forward("draft", bucket, 1, 0.1 * plain_s)
            hits = torch.rand(bucket, k, generator=gen) < a                      # [bucket, k]
            c.record_acceptance(hits.long().cumprod(1).sum(1), k, bucket)
        c.record_step(bucket, k, plain_s if k == 0 else spec_s(k), switch_s=switch if k else 0.0)
    return ks


def simulated_cost(ks: list[int], plain_s: float, spec_s: Callable[[int], float], switch_s: float) -> float:
    """Seconds per step of a `simulate` run, catch-ups included."""
    return sum(spec_s(k) + (switch_s if i and ks[i - 1] == 0 else 0.0) if k else plain_s
               for i, k in enumerate(ks)) / len(ks)


def test_controller_with_a_useless_drafter_costs_at_most_its_exploration_budget() -> None:
    c = DraftController(max_draft=8, batch_threshold=32, strategy="Bandit")
    ks = simulate(c, 3000, 1.0, lambda k: 1.3 + 0.1 * k, a=0.0)
    spec = [i for i, k in enumerate(ks) if k]
    cost = sum(1.3 + 0.1 * k if k else 1.0 for k in ks) / len(ks)
    assert cost <= 1 + c.explore + 0.005, cost        # vs always-plain 1.0: the budget, plus one probe
    assert c.regret_s <= c.explore * c.elapsed_s + 2.2
    assert 1 <= len(spec) <= 40                        # stale probes keep the estimate fresh
    assert all(k == 1 for k in ks[spec[3]:] if k)     # once a is known ~0, the cheapest probe


def test_each_probe_narrows_the_next_choice() -> None:
    """A useless drafter whose k = 1 step costs barely more than plain: optimism alone says probe. Each
    probe's trials tighten the optimistic acceptance at once, so no probe runs that the estimates of
    that moment rule out (a plan kept for replan_every steps would). Budget unbounded here."""
    c = DraftController(max_draft=1, batch_threshold=32, strategy="Bandit", explore=1.0, stale_steps=10_000)
    probes, unjustified = 0, []
    c.record_step(1, 0, 1.0)
    for step in range(400):
        fresh_opt = c._replan(1, 1, None, store=False)[3]      # the optimistic gain from what is known now
        k = c.choose(1, 1, True)
        c.record_forward("target", 1, k + 1, 0.9)
        if k:
            probes += 1
            if fresh_opt <= 1:
                unjustified.append(step)
            c.record_forward("draft", 1, 1, 0.1)
            c.record_acceptance(torch.zeros(1, dtype=torch.long), k, 1)   # never accepted
        c.record_step(1, k, 1.1 if k else 1.0)
    assert unjustified == [], unjustified
    assert 10 <= probes <= 30, probes          # until 2 sqrt(0.0475 / n) < 0.1 (S1 / S0 - 1): n ~ 19


def test_a_probes_catch_up_is_regret_unless_the_probe_turns_the_bucket() -> None:
    # After a plain run the drafter first feeds the tokens it missed (here 3 s, three plain steps'
    # worth): part of the probe's price, unless the probe shows drafting pays.
    def probed() -> DraftController:
        c = DraftController(max_draft=4, batch_threshold=8, strategy="Bandit", stale_steps=1)
        c.record_step(4, 0, 1.0)
        for T, s in ((1, 1.0), (5, 1.2)):
            c.record_forward("target", 4, T, s)
        c.record_forward("draft", 4, 1, 0.05)
        c.record_acceptance(torch.zeros(64, dtype=torch.long), 4, 4)       # the estimates say plain
        c.elapsed_s = 1000.0                                                # budget left
        k = c.choose(4, 4, True)
        assert k > 0                                                        # a stale probe
        return c
    c = probed()
    c.record_acceptance(torch.zeros(4, dtype=torch.long), 1, 4)
    c.record_step(4, 1, 1.2, switch_s=3.0)
    assert c.elapsed_s == pytest.approx(1000.0 + 1.2 + 3.0)
    assert c.regret_s == pytest.approx(0.2)                 # the step less one plain step's token
    c.choose(4, 4, True)                                    # back to plain: the catch-up was regret
    assert c.regret_s == pytest.approx(3.2)
    c = probed()
    c.record_acceptance(torch.full((4 * 64,), 4), 4, 4)      # the probe: every draft accepted
    c.record_step(4, 4, 1.6, switch_s=3.0)
    assert c.choose(4, 4, True) > 0                         # speculating now: the switch was worth it
    assert c.regret_s == 0.0


def test_a_probe_that_turns_the_bucket_to_speculating_is_not_charged_its_catch_up() -> None:
    c = DraftController(max_draft=8, batch_threshold=32, strategy="Bandit", remeasure_every=48)
    cost = lambda k: 1.0 + 0.25 * k                    # noqa: E731
    ks = simulate(c, 400, 1.0, cost, a=0.75, switch_s=2.0)
    tail = ks[100:]
    assert sum(k > 0 for k in tail) > 0.95 * len(tail)
    assert c.regret_s <= c.explore * c.elapsed_s + 2.2  # the switches chosen by the estimates are not regret


def test_controller_speculates_with_a_good_drafter_and_picks_the_paying_k() -> None:
    c = DraftController(max_draft=8, batch_threshold=32, strategy="Bandit", remeasure_every=48)
    cost = lambda k: 1.0 + 0.25 * k                    # noqa: E731
    ks = simulate(c, 500, 1.0, cost, a=0.75)
    tail = ks[100:]
    assert sum(k > 0 for k in tail) > 0.95 * len(tail)
    assert 0 < tail.count(0) <= len(tail) // 40        # plain re-measured now and then, not more
    best = max(c.arms, key=lambda k: (1 - 0.75 ** (k + 1)) / 0.25 / cost(k))
    assert best == 3 and max(set(tail), key=tail.count) == best
    # The machine changes: speculative steps got 4x slower. Plain wins again, and the controller notices.
    ks = simulate(c, 300, 1.0, lambda k: 4 * cost(k), a=0.75)
    assert sum(k == 0 for k in ks[100:]) > 0.9 * len(ks[100:])


def test_finish_time_telescopes_over_a_rollout_across_buckets() -> None:
    c = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit")
    for b, s in ((64, 16.0), (8, 5.0), (1, 3.0)):               # buckets 2, 4, 16, 32 never ran plainly
        c.record_step(b, 0, s)
    c.new_rollout()
    assert [c.price(b) for b in (1, 2, 4, 8, 16, 32, 64)] == [3.0, 5.0, 5.0, 5.0, 16.0, 16.0, 16.0]
    left = [40] * 20 + [37] * 12                                 # 32 rows, in bucket 64, then in 32
    assert c.finish_time(left, 64) == c.finish_time(left, 32)    # the same rows cost the same wherever they run
    assert c.finish_time(left, 64) == (3 + 37) * 16.0            # 3 steps with 32 rows active, 37 with 12
    for _ in range(9):                                           # the measurements move during the rollout
        c.record_step(64, 0, 30.0)
    assert c.price(64) == 16.0 and c.plain_time(64) == 30.0
    gen = torch.Generator().manual_seed(0)
    rows, bucket, start, valued = [64] * 64, 64, c.finish_time([64] * 64, 64), 0.0
    while any(rows):                                             # uneven progress, the batch compacting
        after = [max(0, x - int(torch.randint(1, 4, (1,), generator=gen))) if x else 0 for x in rows]
        valued += c.finish_time(rows, bucket) - c.finish_time(after, bucket)
        rows = after
        active = sum(x > 0 for x in rows)
        while active and active <= bucket // 2:
            bucket //= 2
    assert valued == pytest.approx(start)
    c.new_rollout()
    assert c.price(64) == 30.0


def test_controller_acceptance_is_per_bucket() -> None:
    c = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit")
    for _ in range(20):
        c.record_acceptance(torch.full((16,), 4), 4, 16)      # bucket 16: every draft accepted
        c.record_acceptance(torch.zeros(2, dtype=torch.long), 4, 2)   # bucket 2: none
    assert c.alpha_for(16)[0] > 0.9 and c.alpha_for(2)[0] < 0.2
    assert 0.2 < c.alpha_for(8)[0] < 0.99              # an unseen bucket starts from the pooled estimate


def test_cost_model_interpolates_verification_cost_monotonically() -> None:
    c = DraftController(max_draft=8, batch_threshold=64, strategy="Bandit")
    c.record_forward("target", 4, 1, 1.0)
    c.record_forward("target", 4, 9, 3.0)
    assert c.forward_time("target", 4, 5) == pytest.approx(2.0)
    assert c.forward_time("target", 4, 17) == pytest.approx(5.0)   # extended with the last slope
    c.record_forward("target", 4, 3, 0.5)                          # a faster measurement is not believed
    assert c.forward_time("target", 4, 3) == pytest.approx(1.0)
    c.record_step(4, 0, 1.2)
    c.record_forward("draft", 4, 1, 0.1)
    v5 = 1.0 + (3.0 - 1.0) * (5 - 3) / (9 - 3)                    # between T = 3 (raised to 1.0) and 9
    assert c.step_time(4, 4) == pytest.approx(1.2 + (v5 - 1.0) + 4 * 0.1)
    for _ in range(3):                      # a busy machine's timing that makes drafting look free is not believed
        c.record_step(4, 4, 0.9)
    assert c.step_time(4, 4) == pytest.approx(1.2 + (v5 - 1.0) + 4 * 0.1)
    assert max(c.gains(4, a=0.0).values()) < 1.0                    # nothing accepted: plain always wins


def test_bandit_engine_matches_plain_across_rollouts() -> None:
    ps = prompts(4, seed=11)
    ref = [naive_greedy(p, 16) for p in ps]
    eng = engine(TARGET, 4, strategy="Bandit", new=16)
    # The target drafting for itself never pays (a drafted token costs a target forward): a generous
    # exploration budget and frequent stale probes make the real controller switch anyway.
    eng.controller = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit", explore=1.0, stale_steps=4)
    ks = set()
    for _ in range(3):
        res = eng.generate(ps)
        assert res.sequences == ref
        ks |= {k for _, _, k in res.stats.trace}
    assert 0 in ks and len(ks) > 1                   # it did switch between plain and speculative


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="maxDraftTokens"):
        RolloutConfig(max_draft_tokens=0)
    with pytest.raises(ConfigError, match="strategy"):
        RolloutConfig(strategy="Greedy")
    with pytest.raises(ConfigError, match="max_seq_len"):
        engine(BAD_LM, 2, new=600).generate(prompts(1, 0))


def test_generate_compare_times_warmed_engines_in_interleaved_pairs() -> None:
    from spectrain_workloads.generate import _shown, compare

    ps = prompts(2, seed=3)
    spec, plain = engine(BAD_LM, 3, strategy="Bandit", new=6), engine(None, 3, new=6)
    spec.generate(ps)                                    # the shown run: spec's warm-up
    out = compare(spec, plain, ps, repeats=3)
    assert out["compare_pairs"] == 3
    lo, hi = out["speedup_spread"]
    assert 0 < lo <= out["speedup_vs_plain"] <= hi
    assert _shown({"0": 5, "3": 2}) == "0:5,3:2" and _shown([0.5, 1.25]) == "0.5-1.25"


def test_progress_is_the_last_rows_advance() -> None:
    E = DraftController.expected_tokens
    assert DraftController.progress(4, 0.6, 1, 32) == E(4, 0.6)            # one row: its own advance
    assert DraftController.progress(4, 0.6, 64, None) == E(4, 0.6)         # EOS: the longest answer's row
    slowest = DraftController.progress(4, 0.6, 64, 32)                     # 64 rows to their budget
    assert 1.0 <= slowest < 0.75 * E(4, 0.6)
    assert DraftController.progress(4, 0.6, 4, 32) > slowest               # fewer rows: a faster slowest
    assert DraftController.progress(0, 0.6, 64, 32) == 1.0


def test_a_steps_expected_value_sees_rows_tied_at_the_batchs_end() -> None:
    c = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit")
    c.record_step(16, 0, 1.0)                                   # every bucket priced alike: F = max(left)
    c.new_rollout()
    E = DraftController.expected_tokens(4, 0.8)
    spread = c.expected_value(4, 0.8, [64] + [50] * 15, 16, samples=400)
    tied = c.expected_value(4, 0.8, [64] * 16, 16, samples=400)
    least_of_16 = sum(0.8 ** ((j - 1) * 16) for j in range(1, 6))  # E[min of 16 rows' tokens]
    assert spread == pytest.approx(E, rel=0.05)                 # one row sets the end: its mean advance
    assert tied == pytest.approx(least_of_16, rel=0.05) and tied < 0.5 * spread
    assert c.expected_value(0, 0.8, [64] * 16, 16) == 1.0       # a plain step is worth one


def test_probing_optimism_on_the_value_ratio_shrinks_with_evidence() -> None:
    c = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit")
    c.record_step(8, 0, 1.0)
    assert c.value_ratio(8) == 1.0 and c.value_ratio(8, optimistic=True) == 1.0     # nothing seen yet
    c.record_acceptance(torch.full((64,), 4), 4, 8)
    left = [64 - i for i in range(8)]
    for _ in range(40):             # steps predicted to add value that add none: every row advances 1
        after = [x - 1 for x in left]
        c.record_value(8, 4, left, after)
        left = after
    real, pred = c.extra[8]
    assert pred > 20 and c.value_ratio(8) < 0.3
    assert c.value_ratio(8, optimistic=True) - c.value_ratio(8) == pytest.approx(1 / math.sqrt(1 + pred / 4.0))
    assert c.value_ratio(8, optimistic=True) < 0.8


def test_controller_values_a_step_by_how_much_sooner_the_batch_can_finish() -> None:
    """8 rows running to their budget, drafts of k = 4 at 1.4x a plain step. Mixed rows (7 accept every
    draft, 1 none; acceptance pooled over rows 0.8): the easy rows running ahead pay only where the
    batch, once they finish, compacts to buckets that cost less; alike rows at the same pooled
    acceptance pay either way."""
    def run(mixed: bool, small_bucket_s: float) -> list[int]:
        c = DraftController(max_draft=4, batch_threshold=64, strategy="Bandit")
        for b in (1, 2, 4):
            c.record_step(b, 0, small_bucket_s)
        c.record_step(8, 0, 1.0)
        for T, s in ((1, 0.9), (5, 1.1)):
            c.record_forward("target", 8, T, s)
        c.record_forward("draft", 8, 1, 0.05)
        gen = torch.Generator().manual_seed(0)
        left = [100_000] * 8
        ks = []
        for _ in range(400):
            k = c.choose(8, 8, True, lambda left=left: max(left))
            ks.append(k)
            if k:
                n_acc = (torch.tensor([k] * 7 + [0]) if mixed else
                         (torch.rand(8, k, generator=gen) < 0.8).long().cumprod(1).sum(1))
                c.record_acceptance(n_acc, k, 8)
                after = [x - int(n) - 1 for x, n in zip(left, n_acc, strict=True)]
                c.record_value(8, k, left, after)
                left = after
            else:
                left = [x - 1 for x in left]
            c.record_step(8, k, 1.0 if k == 0 else 1.4)
        return ks[100:]
    def spec_share(ks: list[int]) -> float:
        return sum(k > 0 for k in ks) / len(ks)
    hard_row = run(mixed=True, small_bucket_s=1.0)                      # the hard row sets the pace:
    assert sum(1.4 if k else 1.0 for k in hard_row) / len(hard_row) <= 1.02    # probes only (budget 1 %)
    assert spec_share(run(mixed=True, small_bucket_s=0.3)) > 0.9       # the hard row finishes alone, cheaply
    assert spec_share(run(mixed=False, small_bucket_s=1.0)) > 0.9
