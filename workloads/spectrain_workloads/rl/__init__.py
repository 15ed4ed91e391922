"""spec.mode RL: GRPO on verifiable tasks with speculative rollouts.

- `grpo`: the RL step (GRPO loss, trainer, the mode's entry `run`);
- `rollout`: the batched rollout engine (KV cache, continuous batching, CUDA-graph pool);
- `specdec`: lossless speculative sampling (draft, verify, resample);
- `tasks`: the tasks and their rewards.
"""
