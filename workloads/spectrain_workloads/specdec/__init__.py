"""Lossless speculative decoding: a drafter proposes k tokens, the target verifies them in one forward.

The general engine under `spectrain generate` and the RL mode's rollouts (`rl.grpo`); it imports
neither `target/` nor `rl/`. One concept per module, read in this order:

- `sampling`: the rule. Sampling settings (temperature, top-p), the rejection rule that keeps the
  target's distribution exactly, one speculative step over callables (draft k, verify k + 1).
- `adapters`: the engine's view of a drafter (LM or Eagle head): which token a cache entry consumes,
  whether it reads the target's hidden states.
- `eagle3_draft`: the EAGLE-3 drafter's adapter: its own static cache, the target's features
  before three layers fused, probabilities over the target's vocabulary (zero off the draft one).
- `controller`: the adaptive draft length. A cost model measured on the engine and the running
  acceptance choose k in 0..K per decode step, 0 (plain) where drafting does not pay.
- `config`: `RolloutConfig` in; `RolloutResult` and `RolloutStats` out.
- `engine`: `RolloutEngine`, the draft-verify loop: per-row KV caches, continuous batching with
  compaction to power-of-two buckets, the drafter's lazy catch-up, CUDA graphs per bucket
  (`cuda_graphs`).
"""
