"""Bad inputs for a Hugging Face target, each a clear error naming the field before any training:
preset and path both set, a hub id, overrides with a path, a missing config.json, an unsupported
architecture, missing tokenizer files, .bin-only or unreadable safetensors, a shard the index
names but that is missing, a tokenizer larger than the vocabulary, a pipeline that does not divide
the layers, a sequence longer than the model's positions or its sliding window, and a drafter
trained for another model. Tiny models are built here with transformers (no hub)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from spectrain_api.config import from_manifest
from spectrain_api.errors import ConfigError
from spectrain_api.rules import check_spec
from spectrain_workloads.hf.source import inspect
from spectrain_workloads.hf.tiny import build_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama") / "m", "LlamaForCausalLM", layers=2)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def job(model: dict, **target: object) -> dict:
    return {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "j"},
            "spec": {"target": {"image": "x", "model": model, **target}}}


@pytest.mark.parametrize("model,field,words", [
    ({"preset": "debug", "path": "file:///m"}, "spec.target.model", "exclusive"),
    ({"path": "meta-llama/Llama-3.2-1B"}, "spec.target.model.path", "download it into a volume first"),
    ({"path": "file://rel/dir"}, "spec.target.model.path", "absolute"),
    ({"path": "s3://bucket/m"}, "spec.target.model.path", "file:///abs/dir or pvc://"),
    ({"path": "file:///m", "overrides": {"dim": 8}}, "spec.target.model.overrides", "remove overrides"),
    ({"path": "pvc://"}, "spec.target.model.path", "use pvc://<claim>/<path>"),
])
def test_contract_refuses(model: dict, field: str, words: str) -> None:
    errors = check_spec(from_manifest(job(model)))
    assert any(e.startswith(field) and words in e for e in errors), errors


def test_contract_refuses_other_modes_with_a_path() -> None:
    m = job({"path": "file:///m"}, parallelism={"pipeline": 2, "data": 1}, nodes=2)
    m["spec"]["mode"] = "AsyncPipeline"
    assert any("mode AsyncPipeline" in e for e in check_spec(from_manifest(m)))


def test_a_good_directory_passes(llama: Path) -> None:
    src = inspect(f"file://{llama}")
    assert src.arch == "LlamaForCausalLM" and src.n_layers == 2 and src.model_config.dim == 64


def test_directory_problems_name_the_file_and_the_fix(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        inspect(f"file://{tmp_path}/nowhere")
    d = copy(llama, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        inspect(f"file://{d}")
    d = copy(llama, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"'GPT2LMHeadModel'.*not supported; supported: LlamaForCausalLM, "
                                          r"Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM"):
        inspect(f"file://{d}")
    d = copy(llama, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer files \['tokenizer\.json'\] are missing"):
        inspect(f"file://{d}")
    d = copy(llama, tmp_path / "bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"neither model\.safetensors nor .*\.bin weights are not read"):
        inspect(f"file://{d}")
    d = copy(llama, tmp_path / "garbage")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"not a readable safetensors file"):
        inspect(f"file://{d}")
    d = copy(llama, tmp_path / "index")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"names model-00002\.safetensors, which is missing"):
        inspect(f"file://{d}")


def test_missing_tensors_and_a_small_vocabulary_are_refused(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from spectrain_workloads.hf.tokenizer import HFTokenizer

    d = copy(llama, tmp_path / "partial")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"lack 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        inspect(f"file://{d}")
    with pytest.raises(ConfigError, match=r"tokenizer .* has \d+ tokens but config\.json's vocab_size is 100"):
        HFTokenizer(llama, model_vocab=100)


def test_layout_rules_use_the_models_own_sizes(llama: Path, tmp_path: Path) -> None:
    from spectrain_workloads.target_model import resolve_target

    three = job({"path": f"file://{llama}"}, nodes=3, parallelism={"pipeline": 3, "microbatches": 3})
    with pytest.raises(ConfigError, match=r"3 stages do not divide the model's 2 layers"):
        resolve_target(from_manifest(three))
    long = job({"path": f"file://{llama}"}, data={"seqLen": 512})
    with pytest.raises(ConfigError, match=r"seqLen: 512 exceeds the model's max_position_embeddings 256"):
        resolve_target(from_manifest(long))
    mistral = build_model(tmp_path / "mistral", "MistralForCausalLM", layers=2)
    cfg = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**cfg, "sliding_window": 32}))
    windowed = job({"path": f"file://{mistral}"}, data={"seqLen": 64})
    with pytest.raises(ConfigError, match=r"sliding_window 32; sliding-window attention is not supported"):
        resolve_target(from_manifest(windowed))


def test_generate_refuses_a_drafter_of_another_model(llama: Path, tmp_path: Path) -> None:
    from spectrain_workloads import generate
    from spectrain_workloads.drafter.export import export_drafter
    from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter

    other = build_model(tmp_path / "wide", "LlamaForCausalLM", layers=2, vocab=384)
    drafter = HFEagleDrafter(json.loads((other / "config.json").read_text()))
    export_drafter(tmp_path / "export", 1, drafter, {})
    args = _gen_args(llama, tmp_path / "export")
    with pytest.raises(ConfigError, match=r"--drafter .*trained for another model \(vocab size 384 vs the "
                                          r"target's 512\)"):
        generate.generate(args)
    args.prompt, args.prompts = None, None
    with pytest.raises(ConfigError, match="exactly one of --prompt TEXT or --prompts FILE"):
        generate.generate(args)


def test_generate_takes_an_lm_drafter_of_the_targets_vocabulary(llama: Path, tmp_path: Path) -> None:
    """An LM drafter reads only tokens: its width may differ from the target's, its vocabulary not."""
    from spectrain_workloads import generate
    from spectrain_workloads.drafter.export import export_drafter
    from spectrain_workloads.drafter.models import build_drafter
    from spectrain_workloads.drafter.settings import DrafterSettings

    src = inspect(f"file://{llama}")
    lm = build_drafter(DrafterSettings(arch="LM"), src.model_config)
    assert lm.cfg.dim != src.model_config.dim
    export_drafter(tmp_path / "lm", 1, lm, {})
    module, meta = generate.load_matching_drafter(str(tmp_path / "lm"), src)
    assert meta["arch"] == "LM" and module.cfg.vocab_size == src.model_config.vocab_size


def test_more_directory_problems(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not a directory; give the model's directory"):
        inspect(f"file://{llama}/config.json")
    cfg = json.loads((llama / "config.json").read_text())
    del cfg["num_hidden_layers"]
    for name, file, text, error in [
            ("badjson", "config.json", "{not json", r"config\.json is not readable JSON"),
            ("nolayers", "config.json", json.dumps(cfg), r"config\.json lacks the integer 'num_hidden_layers'"),
            ("badindex", "model.safetensors.index.json", "[]",
             r"model\.safetensors\.index\.json is not a safetensors index")]:
        d = copy(llama, tmp_path / name)
        (d / file).write_text(text)
        with pytest.raises(ConfigError, match=error):
            inspect(f"file://{d}")
    d = copy(llama, tmp_path / "badtok")
    (d / "tokenizer.json").write_text("{}")
    from spectrain_workloads.hf.tokenizer import HFTokenizer

    with pytest.raises(ConfigError, match=r"the tokenizer in .* does not load"):
        HFTokenizer(d, model_vocab=512)


def test_a_misshapen_tensor_is_refused_when_the_stage_loads(llama: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from spectrain_workloads.hf.stage import HFStage

    d = copy(llama, tmp_path / "shape")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(d / "model.safetensors"))
    src = inspect(f"file://{d}")
    stage = HFStage.stage(src, 0, 2)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(7, 64\), "
                                          r"config\.json implies \(128, 64\)"):
        stage.load_weights(src)


def test_rl_needs_an_eos_token() -> None:
    from spectrain_workloads.rl.tasks import get_task

    class NoEos:
        EOS = None

    with pytest.raises(ConfigError, match="tokenizer defines no eos_token"):
        get_task("copy", tokenizer=NoEos())


def _gen_args(model: Path, drafter: Path, **over: object) -> argparse.Namespace:
    """The CLI's own parser, so every default `spectrain generate` has is there."""
    from spectrain_operator.cli import add_generate_arguments
    p = argparse.ArgumentParser()
    add_generate_arguments(p)
    args = p.parse_args(["--model", str(model), "--drafter", str(drafter), "--prompt", "x = 1",
                         "--max-new-tokens", "4", "--draft-tokens", "2", "--json", "--device", "cpu"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_generate_argument_errors_name_the_flag(llama: Path, tmp_path: Path) -> None:
    import torch

    from spectrain_workloads import generate
    from spectrain_workloads.drafter.export import export_drafter
    from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter

    export_drafter(tmp_path / "ok", 1, HFEagleDrafter(json.loads((llama / "config.json").read_text())), {})
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    cases = [({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
             ({"temperature": -1.0}, "--temperature must be >= 0"),
             ({"prompt": None, "prompts": str(tmp_path / "none.txt")}, "--prompts .*none.txt"),
             ({"prompt": None, "prompts": str(empty)}, "no non-empty line"),
             ({"device": "tpu"}, "--device must be auto, cpu or cuda"),
             ({"dtype": "fp8"}, "--dtype must be one of auto, float32, bfloat16"),
             ({"max_new_tokens": 400}, "exceeds the model's max_position_embeddings 256")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "--device cuda: this torch sees no CUDA device"))
    for over, words in cases:
        with pytest.raises(ConfigError, match=words):
            generate.generate(_gen_args(llama, tmp_path / "ok", **over))


def test_generate_refuses_a_preset_or_other_architecture_drafter(llama: Path, tmp_path: Path) -> None:
    from spectrain_workloads import generate
    from spectrain_workloads.drafter.export import export_drafter
    from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter
    from spectrain_workloads.drafter.models import EagleDrafter

    src = inspect(f"file://{llama}")
    export_drafter(tmp_path / "preset", 1, EagleDrafter(src.model_config), {})
    with pytest.raises(ConfigError, match="an Eagle drafter of a preset target"):
        generate.load_matching_drafter(str(tmp_path / "preset"), src)
    qwen = build_model(tmp_path / "qwen", "Qwen2ForCausalLM", layers=2)
    export_drafter(tmp_path / "qwen-drafter", 1, HFEagleDrafter(json.loads((qwen / "config.json").read_text())), {})
    with pytest.raises(ConfigError, match=r"trained for \['Qwen2ForCausalLM'\], the target is \['LlamaForCausalLM'\]"):
        generate.load_matching_drafter(str(tmp_path / "qwen-drafter"), src)


def test_weights_the_pods_user_cannot_read_name_the_fix(llama: Path, tmp_path: Path) -> None:
    """A model copied into a volume keeps save_pretrained's 0600 weights: the pods' user (not the
    files' owner) gets an error that says to make them readable, not to re-copy them. Checked as
    that user in a forked child (the test process is root here, and root reads everything)."""
    import os
    if os.geteuid() != 0:
        pytest.skip("needs root to run the check as another user")
    d = copy(llama, tmp_path / "private")
    (d / "model.safetensors").chmod(0o600)
    for p in (d, *d.parents):
        if p.stat().st_mode & 0o005 != 0o005:
            p.chmod(p.stat().st_mode | 0o005)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                     # child: become UID/GID 1000, report what inspect says, exit
        os.close(r)
        msg = "no error"
        try:
            os.setgroups([])
            os.setgid(1000)
            os.setuid(1000)
            inspect(f"file://{d}")
        except ConfigError as exc:
            msg = str(exc)
        except BaseException as exc:  # noqa: BLE001 - anything else is reported to the parent
            msg = f"unexpected {exc!r}"
        finally:
            os.write(w, msg.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        msg = fh.read()
    os.waitpid(pid, 0)
    assert "cannot be read by this process (uid 1000" in msg and "chmod -R a+rX" in msg, msg
