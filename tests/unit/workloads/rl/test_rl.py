"""GRPO pieces, the shipped tasks' rewards, and RolloutTail windows + hidden states on the ring."""

from __future__ import annotations

import random

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.ring import RingConsumer, RingProducer, WindowKind
from spectrain_workloads.rl.grpo import (
    GRPOConfig,
    GRPOTrainer,
    StepResult,
    group_advantages,
    grpo_loss,
    pad_batch,
    response_logprobs,
    sft_warmup,
)
from spectrain_workloads.rl.sidebyside import plain_rerun
from spectrain_workloads.rl.tasks import TOKENIZER, Example, get_task
from spectrain_workloads.specdec.config import RolloutConfig

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def tiny_policy(seed: int = 0) -> Transformer:
    m = Transformer(ModelConfig(vocab_size=264, dim=32, n_layers=2, n_heads=2, max_seq_len=96))
    m.init_weights(seed)
    return m


@pytest.mark.parametrize("name", ["arithmetic", "copy", "sort", "alphabet"])
def test_task_rewards_exact_partial_and_wrong(name: str) -> None:
    task = get_task(name, max_len=12)
    ex = task.sample(random.Random(0))
    right = task.answer_ids(ex)
    assert task.reward(ex, right) == 1.0
    assert task.reward(ex, right[:-1]) < 1.0                    # not closed by EOS
    assert task.reward(ex, right + [ord("x")]) == 1.0          # anything after EOS is ignored
    wrong = TOKENIZER.encode("#" * len(ex.answer), eos=True)
    assert task.reward(ex, wrong) == 0.0
    if len(ex.answer) > 1:
        half = TOKENIZER.encode(ex.answer[:-1] + "#", eos=True)
        assert 0.0 < task.reward(ex, half) < 1.0


def test_task_answers_are_correct_and_lengths_long_tailed() -> None:
    rng = random.Random(1)
    assert get_task("arithmetic").reward(Example("12+30=", "42"), TOKENIZER.encode("42", eos=True)) == 1.0
    for name in ("copy", "sort", "arithmetic", "alphabet"):
        task = get_task(name, max_len=40)
        exs = [task.sample(rng) for _ in range(2000)]
        if name == "alphabet":      # 'abc:<letter><n>=' -> n letters on from it, z wrapping to a
            letters = "abcdefghijklmnopqrstuvwxyz" * 3
            for e in exs:
                start, n = e.prompt[4], int(e.prompt[5:-1])
                assert e.answer == letters[letters.index(start):][:n], e
            assert min(len(e.answer) for e in exs) == task.min_len and any("za" in e.answer for e in exs)   # wraps
        elif name != "arithmetic":
            body = [e.prompt.split(":", 1)[1][:-1] for e in exs]
            assert all(e.answer == (b if name == "copy" else "".join(sorted(b))) for e, b in zip(exs, body, strict=True))
        else:
            assert all(str(eval(e.prompt[:-1])) == e.answer for e in exs[:200])   # noqa: S307 (digits and '+')
        lens = sorted(len(e.answer) for e in exs)
        median, p99 = lens[len(lens) // 2], lens[int(0.99 * len(lens))]
        # long tail, capped (alphabet's starts at 8 letters: the cap at 40 bounds its tail sooner)
        assert p99 >= (2 if name == "alphabet" else 4) * median and max(lens) <= 40
    with pytest.raises(ConfigError, match="rl.task"):
        get_task("chess")
    with pytest.raises(ConfigError, match="alphabet task min_len must be >= 1, got 0"):
        get_task("alphabet", min_len=0)


def test_group_advantages_are_normalised_per_group() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    a = group_advantages(r, 4)
    assert torch.allclose(a.view(2, 4).mean(1), torch.zeros(2), atol=1e-6)
    assert a[0] > 0 > a[1] and torch.all(a[4:] == 0)            # identical rewards: no signal
    with pytest.raises(ConfigError, match="groupSize"):
        GRPOConfig(group_size=1)


def test_clipped_loss_stops_the_gradient_outside_the_trust_region() -> None:
    old = torch.zeros(2, 1)
    mask = torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0])
    logp = torch.tensor([[0.5], [-0.5]], requires_grad=True)    # ratios e^.5 (A>0) and e^-.5 (A<0): both clipped
    loss, _ = grpo_loss(logp, old, adv, mask, 0.2)
    loss.backward()
    assert logp.grad is not None and torch.all(logp.grad == 0)
    logp2 = torch.zeros(2, 1, requires_grad=True)
    loss2, _ = grpo_loss(logp2, old, adv, mask, 0.2)
    loss2.backward()
    assert logp2.grad is not None and logp2.grad[0, 0] < 0 < logp2.grad[1, 0]   # push A>0 up, A<0 down


def test_grpo_step_raises_logprob_of_good_responses() -> None:
    task = get_task("copy", max_len=6)
    policy = tiny_policy(0)
    sft_warmup(policy, task, steps=30, batch=16, lr=1e-2)       # emits answers of about the right shape
    trainer = GRPOTrainer(policy, task, GRPOConfig(group_size=8, prompts_per_step=4, lr=3e-3, seed=0),
                          RolloutConfig(max_new_tokens=10, temperature=1.0, seed=0))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    res = trainer.step()
    exs, roll = trainer.last_rollout  # type: ignore[misc]
    rewards = torch.tensor([task.reward(exs[i // 8], r) for i, r in enumerate(roll.responses)])
    adv = group_advantages(rewards, 8)
    seqs = pad_batch(roll.sequences, torch.device("cpu"))
    t = torch.arange(seqs.size(1) - 1)[None]
    mask = ((t >= torch.tensor(roll.prompt_lens)[:, None] - 1) & (t < torch.tensor([len(s) for s in roll.sequences])[:, None] - 1)).float()
    with torch.no_grad():
        new = (response_logprobs(policy, seqs, 1.0) * mask).sum(1)
        policy.load_state_dict(before)
        old = (response_logprobs(policy, seqs, 1.0) * mask).sum(1)
    assert res.reward_mean == pytest.approx(float(rewards.mean()))
    assert (adv != 0).sum() >= 4
    # the surrogate objective sum_i A_i log p_i went up: the update followed the policy gradient
    assert float((adv * (new - old)).sum()) > 0
    assert float((new - old)[adv > 0].mean()) > float((new - old)[adv < 0].mean())


def test_rollout_tail_window_and_hidden_states_on_the_ring(tmp_path: object) -> None:
    path = f"{tmp_path}/ring-0"
    producer = RingProducer.create(path, rank=0)
    consumer = RingConsumer.open(path, timeout_s=5)
    task = get_task("copy", max_len=24)
    policy = tiny_policy(1).eval()
    closed: list[dict[str, object]] = []
    trainer = GRPOTrainer(policy, task, GRPOConfig(group_size=4, prompts_per_step=4, seed=2, tail_fraction=0.5),
                          RolloutConfig(max_new_tokens=24, temperature=1.0, seed=3, eos_id=ord("a")),
                          producer=producer, on_window=closed.append)
    exs, res, tail = trainer.rollout()
    assert tail["wid"] is not None and len(closed) == 1 and closed[0]["kind"] == "RolloutTail"
    events = consumer.poll_windows()
    assert [(e.kind, e.is_end) for e in events] == [(WindowKind.ROLLOUT_TAIL, False), (WindowKind.ROLLOUT_TAIL, True)]
    assert events[1].actual_duration_ns > 0
    records = []
    while (rec := consumer.next_data()) is not None:
        records.append((dict(rec.meta), {k: v.copy() for k, v in rec.arrays.items()}))
    assert len(records) == tail["published"] == len(res.sequences)    # every sequence, published once
    for meta, arrays in records:
        seq = res.sequences[meta["seq_index"]]
        assert meta["stage"] == 0 and meta["dtype"] == "float32"
        assert arrays["tokens"].tolist() == seq[:-1]                   # tokens[t+1] follows position t
        with torch.no_grad():
            _, h = policy(torch.tensor([seq[:-1]]), return_hidden=True)
        assert torch.allclose(torch.from_numpy(arrays["hidden"]), h[0], atol=1e-4)   # the rollout's own states
    producer.close()


def _trained(plain_every: int, strategy: str = "Fixed") -> tuple[list[StepResult], Transformer, GRPOTrainer]:
    """4 GRPO steps with speculative rollouts from a fixed seed; plain reruns every `plain_every` steps."""
    task = get_task("copy", max_len=8)
    policy = tiny_policy(0)
    sft_warmup(policy, task, steps=10, batch=8, lr=1e-2)
    drafter = Transformer(ModelConfig(vocab_size=264, dim=16, n_layers=1, n_heads=2, max_seq_len=96))
    drafter.init_weights(1)
    trainer = GRPOTrainer(policy, task, GRPOConfig(group_size=4, prompts_per_step=2, lr=3e-3, seed=0,
                                                   plain_every=plain_every),
                          RolloutConfig(max_new_tokens=10, temperature=1.0, seed=0, strategy=strategy,
                                        max_draft_tokens=3),
                          drafter=drafter, drafter_arch="LM")
    return [trainer.step() for _ in range(4)], policy, trainer


def test_plain_reruns_measure_the_speedup_without_changing_training() -> None:
    # Fixed draft length: the rollouts do not depend on timings, so the runs must agree bit for bit.
    off, p_off, _ = _trained(0)
    on, p_on, _ = _trained(2)
    assert [(r.loss, r.reward_mean, r.kl, r.tokens, r.acceptance_length) for r in on] == \
        [(r.loss, r.reward_mean, r.kl, r.tokens, r.acceptance_length) for r in off]
    assert all(torch.equal(a, b) for a, b in zip(p_on.state_dict().values(), p_off.state_dict().values(), strict=True))
    assert [r.step for r in on if r.plain_rollout_s is not None] == [1, 3]        # steps 2 and 4 counted from 1
    assert all(r.plain_rollout_s is None and "rl_step_speedup" not in r.metrics() for r in off)
    for r in on:
        m = r.metrics()
        assert m["rollout_tokens_per_s"] == pytest.approx(r.tokens / r.rollout_s) and r.spec_steps > 0
        if r.plain_rollout_s is not None:
            assert r.plain_tokens and m["plain_rollout_s"] > 0 and m["plain_rollout_tokens_per_s"] > 0
            assert m["rl_step_speedup"] == pytest.approx((r.plain_rollout_s + r.train_s) / r.step_s)


def test_plain_rerun_leaves_the_engine_as_it_found_it() -> None:
    # Bandit: the controller learns from every timed decode step; a rerun must not teach it anything.
    _, policy, trainer = _trained(0, strategy="Bandit")
    eng = trainer.engine
    before = (eng.gen.get_state().clone(), {k: list(w.xs) for k, w in eng.controller.step_s.items()},
              eng.controller.accepted, eng.controller.trials)
    prompts = [trainer.task.prompt_ids(trainer.task.sample(random.Random(5))) for _ in range(4)]
    run = plain_rerun(eng, prompts, keep_hidden=False)
    assert run.seconds > 0 and run.tokens >= len(prompts) and run.tokens_per_s > 0
    after = (eng.gen.get_state(), {k: list(w.xs) for k, w in eng.controller.step_s.items()},
             eng.controller.accepted, eng.controller.trials)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_plain_every_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="plain_every"):
        GRPOConfig(plain_every=-1)
