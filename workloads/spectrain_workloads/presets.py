"""Model presets (API.md names), importable without torch so the operator can check a spec
(e.g. that the pipeline degree divides the preset's layers) without the workload image."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=64, n_layers=4, n_heads=4, max_seq_len=512),
    "small": dict(dim=256, n_layers=8, n_heads=8, max_seq_len=1024),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=2048),
    "1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, max_seq_len=4096),
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=4096, ffn_dim=11008),
}

DEFAULT_N_LAYERS = 4  # ModelConfig's default, for presets that do not set it


def n_layers(preset: str, overrides: dict[str, Any] | None = None) -> int:
    """Layer count of a preset after overrides; KeyError for an unknown preset."""
    merged = {**PRESETS[preset], **(overrides or {})}
    return int(merged.get("n_layers", DEFAULT_N_LAYERS))
