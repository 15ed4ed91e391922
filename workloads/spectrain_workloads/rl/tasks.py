"""Verifiable-reward tasks for the RL mode (API.md `rl.task`): arithmetic, copy, sort, alphabet.

Byte-level (ByteTokenizer): prompt = BOS + text, response = answer bytes + EOS. Problem sizes are
long-tailed (Pareto-distributed lengths, capped), so most responses are short and a few are long:
the rollout long tail that RL leaves idle. Rewards are in [0, 1]: 1 for an exact answer closed by
EOS, else partial credit 0.5 * (matching positions / max(len(response), len(answer))), which gives a
weak policy a gradient to climb.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any

from spectrain_api.errors import ConfigError
from spectrain_workloads.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def long_tail_length(rng: random.Random, lo: int, hi: int, alpha: float) -> int:
    """Pareto(alpha) with minimum lo, capped at hi: P(n >= x) = (lo / x) ** alpha."""
    return min(hi, int(lo * (1.0 - rng.random()) ** (-1.0 / alpha)))


@dataclass(frozen=True, kw_only=True)
class Task:
    """max_len caps the answer length (keep it <= rl.maxNewTokens - 1 so EOS fits); alpha: tail index."""

    name: str = ""
    max_len: int = 48
    alpha: float = 1.2
    # The target's tokenizer (encode / decode / BOS / EOS): the byte tokenizer, or an HF target's.
    tokenizer: Any = field(default=TOKENIZER, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ConfigError(f"task max_len must be >= 2, got {self.max_len}")
        if self.alpha <= 0:
            raise ConfigError(f"task alpha must be > 0, got {self.alpha}")
        if self.tokenizer.EOS is None:
            raise ConfigError("spec.target.model.path: the tokenizer defines no eos_token; RL responses end "
                              "with EOS: set eos_token in tokenizer_config.json")

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def prompt_ids(self, ex: Example) -> list[int]:
        return self.tokenizer.encode(ex.prompt, bos=True)

    def answer_ids(self, ex: Example) -> list[int]:
        return self.tokenizer.encode(ex.answer, eos=True)

    def reward(self, ex: Example, response: list[int]) -> float:
        """response: generated ids (EOS and anything after it ignored, except that EOS must be there)."""
        eos = self.tokenizer.EOS
        closed = eos in response
        body = response[: response.index(eos)] if closed else response
        got = self.tokenizer.decode(body)
        if closed and got == ex.answer:
            return 1.0
        match = sum(a == b for a, b in zip(got, ex.answer, strict=False))
        return 0.5 * match / max(len(got), len(ex.answer), 1)


@dataclass(frozen=True, kw_only=True)
class Arithmetic(Task):
    """'a+b=' -> decimal sum; operand digit counts long-tailed (answer length <= max_len)."""

    name: str = "arithmetic"

    def sample(self, rng: random.Random) -> Example:
        def operand() -> int:
            digits = long_tail_length(rng, 1, self.max_len - 1, self.alpha)
            return rng.randrange(10 ** (digits - 1), 10**digits)
        a, b = operand(), operand()
        return Example(f"{a}+{b}=", str(a + b))


@dataclass(frozen=True, kw_only=True)
class Copy(Task):
    """'copy:<letters>=' -> the same letters."""

    name: str = "copy"

    def sample(self, rng: random.Random) -> Example:
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(long_tail_length(rng, 1, self.max_len, self.alpha)))
        return Example(f"copy:{s}=", s)


@dataclass(frozen=True, kw_only=True)
class Sort(Task):
    """'sort:<letters>=' -> the letters sorted."""

    name: str = "sort"

    def sample(self, rng: random.Random) -> Example:
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(long_tail_length(rng, 1, self.max_len, self.alpha)))
        return Example(f"sort:{s}=", "".join(sorted(s)))


@dataclass(frozen=True, kw_only=True)
class Alphabet(Task):
    """'abc:<letter><n>=' -> n consecutive letters from that one (z wraps to a); n long-tailed from
    `min_len` (capped at max_len). Long, mostly predictable responses (each letter follows from the
    last; only the length needs the prompt's count), as the long reasoning traces of RL on a real
    model are: rollouts of many decode steps, where speculative decoding pays, unlike copy's answers
    of a letter or two (median ~2), which are mostly prefill."""

    name: str = "alphabet"
    min_len: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_len < 1:
            raise ConfigError(f"alphabet task min_len must be >= 1, got {self.min_len}")

    def sample(self, rng: random.Random) -> Example:
        n = long_tail_length(rng, min(self.min_len, self.max_len), self.max_len, self.alpha)
        start = rng.randrange(26)
        letters = string.ascii_lowercase
        return Example(f"abc:{letters[start]}{n}=", "".join(letters[(start + i) % 26] for i in range(n)))


TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "copy": Copy, "sort": Sort, "alphabet": Alphabet}


def get_task(name: str, **kwargs: Any) -> Task:
    if name not in TASKS:
        raise ConfigError(f"target.rl.task {name!r} is not shipped; use one of {sorted(TASKS)}")
    return TASKS[name](**kwargs)  # type: ignore[arg-type]


__all__ = ["Alphabet", "Arithmetic", "Copy", "Example", "Sort", "TASKS", "Task", "get_task", "long_tail_length"]
