"""What a decode step is worth when every row runs to its token budget (no EOS), in tokens or seconds.

The batch ends with its last row, so a speculative step is worth how much sooner the batch can finish,
not the mean tokens its rows commit. Three views, from the i.i.d. acceptance model (each draft
accepted with probability a until the first rejection: a row commits c tokens, P(c >= j) = a^(j-1),
j <= k + 1):

- `progress`: the long-run advance per step of the batch's slowest row, for planning;
- `finish_time` F(left): plain decoding's seconds to finish rows with `left` tokens to go, rows dropping
  out as they finish and the batch compacting to the power-of-two bucket of the rows still active, each
  step priced by `price(bucket)`. A step's realized value is F(before) - F(after): easy rows running
  ahead are worth what their finishing early saves. With prices fixed over a rollout, the values of
  its steps add up to its plain time.
- `expected_value`: the model's E[F(before) - F(after)] in the actual state, so realized over expected
  measures the drafter and the rows, not when the controller happened to probe: rows tied at the most
  tokens to go (after plain steps every row is) move the batch's end only as far as the least lucky of
  them.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def expected_tokens(k: int, a: float) -> float:
    """E[committed tokens per row] for k drafts at per-token acceptance a (bonus token included)."""
    return (1 - a ** (k + 1)) / (1 - a)


def progress(k: int, a: float, n_rows: int, horizon: int | None) -> float:
    """Expected progress per step of the batch's last row to finish, in tokens.

    horizon None (rows end at EOS): the row that finishes last is the one with the longest answer,
    and it advances E_k per step. Otherwise every row runs to its budget and the batch ends with
    its slowest row: over the remaining horizon / E_k steps, the slowest of n rows, each committing
    i.i.d. c per step (mean E_k, standard deviation sd), advances about E_k - z_n sd / sqrt(steps)
    per step, z_n = sqrt(2 ln n) (the expected maximum of n standard normals, roughly); at least 1.
    """
    mean = expected_tokens(k, a)
    if horizon is None or n_rows <= 1 or k == 0:
        return mean
    second = sum((2 * j - 1) * a ** (j - 1) for j in range(1, k + 2))       # E[c^2]: P(c >= j) = a^(j-1)
    sd = math.sqrt(max(0.0, second - mean * mean))
    steps = max(1.0, horizon / mean)
    return max(1.0, mean - math.sqrt(2 * math.log(n_rows)) * sd / math.sqrt(steps))


def finish_time(left: list[int], bucket: int, price: Callable[[int], float]) -> float:
    """F: seconds to finish rows with `left` tokens to go decoding plainly in `bucket`. With rows sorted
    longest first, while the i longest are active every step costs the price of the bucket they compact
    to (the power of two >= i, at most `bucket`)."""
    rows = sorted((x for x in left if x > 0), reverse=True)
    total = 0.0
    for i, x in enumerate(rows):
        b = min(bucket, 1 << i.bit_length())           # i + 1 active rows: the power of two >= i + 1
        total += (x - (rows[i + 1] if i + 1 < len(rows) else 0)) * price(b)
    return total


def expected_value(k: int, a: float, before: list[int], bucket: int, price: Callable[[int], float],
                   rand: Callable[[], float], samples: int = 4, f_before: float | None = None) -> float:
    """E[F(before) - F(after)] in seconds for a step with k drafts from `before` (tokens to go per
    active row), every row committing i.i.d. c tokens (at most its tokens to go): a Monte Carlo over
    `samples` draws of `rand` (uniform in [0, 1); seeded by the caller). f_before: F(before), if known."""
    f0 = finish_time(before, bucket, price) if f_before is None else f_before
    total = 0.0
    for _ in range(samples):
        after = []
        for x in before:
            c = 1
            while c <= k and rand() < a:
                c += 1
            after.append(x - c)
        total += f0 - finish_time(after, bucket, price)
    return total / samples


__all__ = ["expected_tokens", "expected_value", "finish_time", "progress"]
