"""Rollout engine: greedy speculative decoding emits exactly plain greedy decoding's tokens.

float64 models, so kernel-shape-dependent rounding (T=1 vs T=k+1 forwards, batch 1 vs 8) cannot flip
an argmax: any difference is an engine bug, not numerics.
"""

from __future__ import annotations

import random

import pytest
import torch

from spectrain_workloads.errors import ConfigError
from spectrain_workloads.rl.rollout import DraftController, EagleDraft, RolloutConfig, RolloutEngine
from tests.unit.drafters import TinyEagle, tiny_model

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

    def choose(self, bucket: int, n_active: int, can_draft: bool) -> int:
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


def test_controller_goes_plain_above_threshold_and_for_a_useless_drafter() -> None:
    c = DraftController(max_draft=4, batch_threshold=8, strategy="Bandit")
    assert c.choose(16, 16, True) == 0
    c.record_step(4, 0, 1.0)
    c.record_forward("target", 4, 1.0)
    c.record_forward("draft", 4, 0.1)
    assert c.choose(4, 4, True) > 0                   # optimistic: untried arms could win
    c.record_acceptance(torch.zeros(200, dtype=torch.long), 4)   # nothing ever accepted
    assert c.choose(4, 4, True) == 0
    assert c.choose(4, 4, False) == 0


def simulate(c: DraftController, steps: int, step_s: dict[int, float], accepted: int, bucket: int = 4) -> list[int]:
    """Drive the controller with synthetic timings: plain steps take step_s[0], speculative step_s[1]
    (any k); every row accepts `accepted` drafts (capped at k). -> the k chosen per step."""
    ks = []
    for _ in range(steps):
        k = c.choose(bucket, bucket, True)
        ks.append(k)
        c.record_forward("target", bucket * (k + 1), step_s[0] if k == 0 else step_s[1] * 0.8)
        if k:
            c.record_forward("draft", bucket, step_s[1] * 0.2 / (k + 1))
            c.record_acceptance(torch.full((bucket,), min(accepted, k)), k)
        c.record_step(bucket, k, step_s[0] if k == 0 else step_s[1])
    return ks


def test_controller_with_a_useless_drafter_costs_at_most_a_few_percent() -> None:
    c = DraftController(max_draft=8, batch_threshold=32, strategy="Bandit")
    ks = simulate(c, 3000, {0: 1.0, 1: 1.5}, accepted=0)
    spec = [i for i, k in enumerate(ks) if k]
    cost = sum(1.5 if k else 1.0 for k in ks) / len(ks)
    assert cost < 1.01, cost                          # vs always-plain 1.0
    assert 1 <= len(spec) <= 12
    gaps = [b - a for a, b in zip(spec, spec[1:], strict=False)]
    assert gaps[-1] > 4 * gaps[0]                     # probes back off


def test_controller_speculates_with_a_good_drafter_and_remeasures_plain() -> None:
    c = DraftController(max_draft=8, batch_threshold=32, strategy="Bandit", remeasure_every=48)
    ks = simulate(c, 500, {0: 1.0, 1: 1.5}, accepted=6)
    tail = ks[100:]
    assert sum(k > 0 for k in tail) > 0.95 * len(tail)
    assert 0 < tail.count(0) <= len(tail) // 40        # plain re-measured now and then, not more
    # The machine changes: speculative steps got 4x slower. Plain wins again, and the controller notices.
    ks = simulate(c, 300, {0: 1.0, 1: 6.0}, accepted=6)
    assert sum(k == 0 for k in ks[100:]) > 0.9 * len(ks[100:])


def test_bandit_engine_matches_plain_across_rollouts() -> None:
    ps = prompts(4, seed=11)
    ref = [naive_greedy(p, 16) for p in ps]
    eng = engine(TARGET, 4, strategy="Bandit", new=16)
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
