"""How the coordinator bounds one round's contributions before it averages them (engine Star).

Every rank holds the job's key (drafter.auth), so a compromised rank can send well-formed, finite
weights and any claimed work. The combine keeps the work-weighted average for honest fleets and
bounds what one rank can do to it, in three steps, each counted by cause
(`combineAdjustedByCause`, metric `spectrain_drafter_combine_adjusted_total{cause}`):

- work_capped: a contribution's new work is credited at most at the rate of the coordinator's own
  clock since that rank's previous credited contribution, whatever process (incarnation) sent it,
  plus one round's slack (fleet_weights._new_work, checks.credit_limit_s); a claim of 1e9 s counts
  as the elapsed interval.
- outlier_clipped: with at least MIN_OUTLIER_RANKS ranks that worked in the round, their
  coordinate-wise median m (per tensor) is the round's centre; a member whose distance
  d_r = ||p_r - m|| (over every tensor) exceeds OUTLIER_FACTOR x median_r(d_r) is pulled onto that
  bound: p_r <- m + (p_r - m) * bound / d_r. With fewer working ranks one cannot tell which is the
  outlier; checks.UPDATE_NORM_FACTOR still bounds every update.
- weight_capped: a member's weight (its credited work) is at most WEIGHT_CAP_FACTOR x the median of
  the other working ranks' weights (the coordinator's included), so one rank's share of a round is
  at most 2 / (n + 1) when the other n - 1 worked alike (n = 4: 40 %), and all of it only when
  nobody else worked.
The coordinator's own parameters and work are never adjusted: it is the rank that exports.

Honest ranks start from the same seeded model, are pulled back to the combined version every
round and train on the same target's samples, so their distances and their work per round are
alike and none of the three steps changes anything; the average is then bitwise the plain one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch

from spectrain_api.names import COMBINE_ADJUST_CAUSES

WEIGHT_CAP_FACTOR = 2.0      # x the median of the others' work: pipeline stages' idle time differs ~2x
OUTLIER_FACTOR = 3.0         # x the median distance to the round's centre
MIN_OUTLIER_RANKS = 3        # working ranks needed before a median tells the outlier apart
COMBINE_ADJUSTMENTS = COMBINE_ADJUST_CAUSES   # the causes counted

Params = Mapping[str, torch.Tensor]


def cap_weights(work: Mapping[int, float], trusted: int) -> tuple[dict[int, float], list[int]]:
    """(weights, capped ranks): each rank's work, a member's cut to WEIGHT_CAP_FACTOR x the median
    of the other working ranks' work (unchanged when nobody else worked)."""
    out = dict(work)
    working = {r: w for r, w in work.items() if w > 0}
    capped = []
    for r, w in working.items():
        others = [v for q, v in working.items() if q != r]
        if r == trusted or not others:
            continue
        cap = WEIGHT_CAP_FACTOR * statistics.median(others)
        if w > cap:
            out[r] = cap
            capped.append(r)
    return out, capped


def clip_outliers(parts: Mapping[int, Params], work: Mapping[int, float],
                  trusted: int) -> tuple[dict[int, Params], list[int]]:
    """(parameters, clipped ranks): a working member's parameters pulled onto OUTLIER_FACTOR x the
    median distance to the working ranks' coordinate-wise median; the others returned as they are."""
    out = dict(parts)
    working = [r for r in parts if work.get(r, 0.0) > 0]
    if len(working) < MIN_OUTLIER_RANKS:
        return out, []
    ref = parts[trusted]
    # per tensor: [n_working, *shape] float32 on the coordinator's device -> median over ranks
    centre = {n: torch.stack([parts[r][n].to(p.device, torch.float32) for r in working]).median(0).values
              for n, p in ref.items()}
    dist = {r: _distance(parts[r], centre) for r in working}
    bound = OUTLIER_FACTOR * statistics.median(dist.values())
    clipped = []
    for r in working:
        if r == trusted or dist[r] <= bound:
            continue
        scale = bound / dist[r]
        out[r] = {n: (centre[n] + (parts[r][n].to(c.device, torch.float32) - centre[n]) * scale).to(ref[n].dtype)
                  for n, c in centre.items()}
        clipped.append(r)
    return out, clipped


def _distance(p: Params, centre: Mapping[str, torch.Tensor]) -> float:
    """||p - centre|| over every tensor, in float64."""
    return math.sqrt(sum(float((p[n].to(c.device, torch.float64) - c.double()).square().sum())
                         for n, c in centre.items()))


def weighted_average(parts: Mapping[int, Params], weights: Mapping[int, float],
                     like: Params) -> dict[str, torch.Tensor]:
    """sum_r weights[r] / sum(weights) x parts[r], per tensor in float32 on `like`'s device, cast to its dtype."""
    total = sum(weights[r] for r in parts)
    ranks = list(parts)
    return {n: torch.stack([weights[r] / total * parts[r][n].to(p.device, torch.float32) for r in ranks])
            .sum(0).to(p.dtype) for n, p in like.items()}


__all__ = ["COMBINE_ADJUSTMENTS", "MIN_OUTLIER_RANKS", "OUTLIER_FACTOR", "WEIGHT_CAP_FACTOR", "cap_weights", "clip_outliers",
           "weighted_average"]
