"""Plain vs speculative rollouts side by side, in the same run, from the same state.

What speculation buys an RL job is only visible next to the same job without it. A second job
(`spectrain run --baseline`) sees another machine load, another drafter history and other policy
weights after a few steps; a rerun inside the job sees none of those differences. So every
`GRPOConfig.plain_every`-th step the trainer also generates that step's prompts plainly (no drafter)
from the same engine state: same policy weights, same prompts, same sampler RNG state. Then the
engine's state is put back exactly as it was before the rerun, and the speculative rollout runs as
it would have without the measurement; training uses only the speculative rollout's sequences.

Why the state is restored and not just the RNG: the engine's DraftController learns from every
decode step it times (plain step times, forward costs). A rerun that fed it would change which
draft lengths later steps choose, hence how the sampler's RNG is consumed, hence the sequences the
policy trains on. With the controller restored too, losses and rewards are bitwise equal with the
measurement on or off (tests/unit/workloads/rl/test_rl.py checks it with a Fixed strategy on CPU).

Lossless speculative decoding makes the two rollouts comparable: greedy, they are token for token
equal; sampling, identically distributed (specdec/sampling.py), so the plain rerun's tokens per
second is a fair baseline for the speculative rollout's.

What the rerun does not reproduce: the drafter sidecar. The rerun runs before the step's RolloutTail
window opens, so the sidecar is idle during it, while it trains in that window during the speculative
rollout. Where the two share cores (an oversubscribed CPU machine) the speculative rollout is slowed by
that and the measured speedup understates speculation's; with a core each (on CPU the RL target
leaves the sidecar its threads: runtime.py) or a GPU shared through MPS the difference is small. It
errs against speculation, so a speedup the report shows is not an artefact of it.

`bench/rl.py` goes further: it runs whole steps (rollout + update) both ways, restoring the
trainer's full state (`GRPOTrainer.state_dict`) in between.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from spectrain_workloads.specdec.engine import RolloutEngine


@dataclass(frozen=True)
class PlainRun:
    """One plain rerun of a rollout batch."""

    seconds: float        # wall time of the plain generation
    tokens: int           # tokens it generated (identically distributed to the speculative run's)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def snapshot(engine: RolloutEngine) -> tuple[Any, Any]:
    """What a generation changes in the engine besides its buffers: the sampler RNG, the controller."""
    return engine.gen.get_state(), copy.deepcopy(engine.controller)


def restore(engine: RolloutEngine, state: tuple[Any, Any]) -> None:
    gen_state, controller = state
    engine.gen.set_state(gen_state)
    engine.controller = controller


def plain_rerun(engine: RolloutEngine, prompts: list[list[int]], *, keep_hidden: bool) -> PlainRun:
    """Generate `prompts` without speculation from the engine's current state, then put that state back.

    keep_hidden: as the speculative run will (the RL loop keeps hidden states to publish them), so
    the plain run pays the same copies and the comparison is of decoding alone."""
    state = snapshot(engine)
    try:
        t0 = time.perf_counter()
        res = engine.generate(prompts, speculative=False, keep_hidden=keep_hidden)
        seconds = time.perf_counter() - t0
    finally:
        restore(engine, state)
    return PlainRun(seconds=seconds, tokens=res.stats.committed)


__all__ = ["PlainRun", "plain_rerun", "restore", "snapshot"]
