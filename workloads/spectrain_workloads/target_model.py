"""What a run trains: a project preset on the byte tokenizer, or a Hugging Face model directory
with its own tokenizer (`spec.target.model.path`). One object answers, for either, what the
trainer, the ring, the drafter's shared files and the corpus need.

    target = resolve_target(cfg)          # checks the directory before anything is built
    stage = target.build_stage(k, P)      # initialised (preset, from the seed) or loaded (HF)
    corpus = target.load_corpus(source)   # token ids with the model's tokenizer

Every mode trains one (target.trainer, rl.grpo) and `hooks.attach` sizes the ring from it, so it
sits beside them, not inside target/ or rl/ (neither package imports the other's models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from spectrain_api.config import JobConfig, ModelConfig, preset_model_config
from spectrain_api.errors import ConfigError
from spectrain_api.rules import eagle3_target_errors, pipeline_errors
from spectrain_workloads.hf.source import ModelDir


@dataclass(frozen=True)
class TargetModel:
    config: ModelConfig                 # sizes: dim (ring hidden width), vocab, n_layers, max_seq_len
    seed: int
    source: ModelDir | None = None      # a Hugging Face directory; None: a preset

    @property
    def is_hf(self) -> bool:
        return self.source is not None

    def build_stage(self, stage: int, n_stages: int) -> nn.Module:
        """Stage `stage` of `n_stages` with its weights: the preset's seeded init, or the HF checkpoint's."""
        if self.source is None:
            from spectrain_workloads.model import Transformer

            module = Transformer.stage(self.config, stage, n_stages)
            module.init_weights(self.seed)
            return module
        from spectrain_workloads.hf.stage import HFStage

        hf = HFStage.stage(self.source, stage, n_stages)
        hf.load_weights(self.source)
        return hf

    def tokenizer(self) -> Any:
        if self.source is None:
            from spectrain_workloads.tokenizer import ByteTokenizer

            return ByteTokenizer()
        from spectrain_workloads.hf.tokenizer import HFTokenizer

        return HFTokenizer(self.source.root, model_vocab=self.config.vocab_size)

    def load_corpus(self, source: str, *, max_bytes: int) -> np.ndarray:
        from spectrain_workloads.data import load_corpus

        return load_corpus(source, max_bytes=max_bytes, tokenizer=self.tokenizer() if self.is_hf else None)

    def shared_config(self) -> dict[str, Any]:
        """model_config.json of the drafter's shared files: the sizes, and for an HF target its
        config.json (the drafter builds its decoder layer from it)."""
        out = self.config.to_dict()
        if self.source is not None:
            out["hf_config"] = self.source.config
        return out


def resolve_target(cfg: JobConfig, *, data_root: str | None = None) -> TargetModel:
    """The job's target model; ConfigError (naming the field) for a directory that cannot be trained."""
    model = cfg.target.model
    if model.path is None:
        return TargetModel(config=preset_model_config(model), seed=cfg.seed)
    from spectrain_workloads.hf.arch import hf_config, sliding_window
    from spectrain_workloads.hf.source import inspect

    source = inspect(model.path, data_root=data_root)
    hf = hf_config(source.config)
    mcfg = source.model_config
    errors = pipeline_errors(cfg, source.n_layers) + eagle3_target_errors(cfg, source.n_layers,
                                                                          source.model_config.vocab_size)
    seq = cfg.target.data.seq_len
    if seq > mcfg.max_seq_len:
        errors.append(f"spec.target.data.seqLen: {seq} exceeds the model's max_position_embeddings "
                      f"{mcfg.max_seq_len} ({source.root}/config.json); lower seqLen")
    window = sliding_window(hf)
    if window is not None and window < seq:
        errors.append(f"spec.target.data.seqLen: {seq} exceeds the model's sliding_window {window}; "
                      "sliding-window attention is not supported: lower seqLen to at most the window")
    if errors:
        raise ConfigError("; ".join(errors))
    return TargetModel(config=mcfg, seed=cfg.seed, source=source)

