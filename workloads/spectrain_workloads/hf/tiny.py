"""Tiny random Hugging Face models, built offline (no hub): a BPE tokenizer trained on a few stdlib
files and a 4-layer Llama / Qwen2 / Qwen3 / Mistral of hidden size 64, saved with save_pretrained
(safetensors) into a directory. The tests build theirs with it, and `make demo-hf` its model:

    python -m spectrain_workloads.hf.tiny OUT_DIR [--arch LlamaForCausalLM] [--layers 4] [--tie]
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 512
ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def build_tokenizer(out: Path, vocab: int = VOCAB) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text() for n in ("textwrap.py", "string.py", "bisect.py", "heapq.py")]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, arch: str = "LlamaForCausalLM", *, layers: int = 4, tie: bool = False,
                seed: int = 0, max_positions: int = 256, vocab: int = VOCAB) -> Path:
    """A tiny random `arch` with its tokenizer in `out` (created); returns `out`."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab - 16)   # room for the specials a family's tokenizer class adds, as real models pad
    family = arch.removesuffix("ForCausalLM")
    config_cls = getattr(transformers, f"{family}Config")
    extra: dict[str, Any] = {"head_dim": 32} if family == "Qwen3" else {}
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build a tiny random Hugging Face model directory (no hub)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="LlamaForCausalLM", choices=ARCHS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tie", action="store_true", help="tie the embedding and the LM head")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build_model(args.out, args.arch, layers=args.layers, tie=args.tie, seed=args.seed)
    print(f"tiny {args.arch} ({args.layers} layers, vocab {VOCAB}) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
