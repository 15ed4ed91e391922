"""Hugging Face targets: a transformers causal LM as the target, its stages, the drafter's frozen
pieces and the export a serving engine loads.

- `source`: a model directory (config, safetensors shards, tokenizer) read without the hub;
- `arch`: which transformers architectures are supported and how their layers split into stages;
- `stage`: one pipeline stage of an HF model, with the hidden states the drafter trains on;
- `tokenizer`: the model's tokenizer behind the project's tokenizer interface;
- `save`: the trained target written back as an HF model directory (shards per stage, then one
  rename that publishes it);
- `tiny`: tiny random models built offline for tests, demos and benchmarks.
"""
