"""bench-eagle3: the EAGLE-3 drafter (arch Eagle3) against the EAGLE-1 drafter (arch Eagle): acceptance for
the same training time, the bytes each training sample moves, and what an Eagle3 drafter costs the demo job.

1. Acceptance, two targets (each trained once offline, cached under bench/results/cache/, keyed by its config):
   - demo: the demo's target shape (preset debug, n_layers 8, dim 64, byte vocab 264), trained as a byte LM
     on Python standard-library source (builtin:python-stdlib, the demo's data);
   - hf: a tiny Hugging Face Llama (hf/tiny.py, 8 layers, hidden 64, BPE vocab 512) trained with transformers
     on the same text, tokenized by its own tokenizer; its features are transformers' hidden_states[i], its
     final-norm hidden state the last entry (what its LM head reads).
   Per target two DrafterTrainer's (preset debug, the demo's lr 4e-3, seed 0), one of each arch, get the same
   stream of training samples (seq_cap + 1 = 33 tokens of the first 90% of the text, the target's final-norm
   hidden [T, H] for Eagle; cat(f_low, f_mid, f_high, final) [T, 4H] for Eagle3, feature layers
   default_feature_layers(8) = (2, 4, 5)), one batch of samples_per_step (8) sequences per micro_step +
   optimizer_step, interleaved: the next batch goes to whichever trainer has used less training time
   (perf_counter around its micro_step + optimizer_step), until both have had TRAIN_S seconds. Measured on
   64 held-out sequences (the last 10% of the text, other seeds), per target <t> in {demo, hf}:
     acceptance_eagle1_t0_<t>, acceptance_eagle3_t0_<t>   expected acceptance length (accepted + 1, k=4,
                                                          greedy) by each arch's own measure_batch
                                                          (drafter.verify / drafter.eagle3_tasks)
     alpha_eagle1_t1_<t>, alpha_eagle3_t1_<t>             teacher-forced sum_v min(p, q) at temperature 1:
                                                          the probability that rejection sampling accepts
                                                          the first draft (verify.sampled_acceptance_rate /
                                                          eagle3_tasks.sampled_acceptance_rate)
     acceptance_eagle3_over_eagle1_<t>, alpha_eagle3_over_eagle1_<t>   the ratios
     top1_eagle1_<t>, top1_eagle3_<t>                     teacher-forced greedy agreement of the first draft
     train_s_eagle1_<t>, train_s_eagle3_<t>               training time each got (s)
     samples_eagle1_<t>, samples_eagle3_<t>               training samples each consumed
     target_loss_<t>, target_loss_start_<t>               the target's training loss, last / first step
   Headline: acceptance_eagle3_over_eagle1 = min over the targets of the t0 ratio, goal_acceptance_ratio 1.2,
   acceptance_goal_met.
2. Bytes per training sample across the ring and the fleet (tokens int64 + hidden/features fp32 per sequence:
   harvest/data_publisher.py ring records, drafter/fleet.py `share` and `send_part` frames; headers left out)
   for the demo's layout (pipeline 2, 8 layers, seqLen 256, H 64, feature layers (2, 4, 5): stage 0 taps layer
   2, stage 1 layers 4, 5 and has the final hidden state). Eagle: the last stage's ring record + P-1 forwarded
   [T, H] samples; Eagle3: every stage's ring record + the parts sent to the last stage + P-1 forwarded
   [T, 4H] samples. Keys feature_bytes_per_sample_eagle1, feature_bytes_per_sample_eagle3,
   feature_bytes_per_sample_ratio; checked against the Eagle3 demo run of 3.: fleet_bytes_per_sample_eagle3
   (the layout's part + forwarded frames) vs fleet_bytes_per_sample_eagle3_measured (the drafter summaries'
   exchangeBytesSent summed over ranks / featureSamplesAssembled; it also holds the weight frames and the
   frame headers) and fleet_bytes_layout_over_measured (featurePartsSent x part_bytes + samplesShared x
   forward_bytes, priced by the layout, / exchange_bytes_sent: <= 1, the rest is weights and headers),
   plus feature_parts_sent, feature_samples_assembled, samples_shared, weight_frames_sent from those summaries.
3. target_slowdown_ratio_eagle3 / _eagle1: examples/demo.yaml (`spectrain run`, pipeline 2 + 2 drafters,
   IdleOnly) with arch Eagle3, with arch Eagle, and with spec.drafter.enabled false, 60 (quick) or 90 steps,
   in rounds of three runs (order rotated each round); per run the median step time (max over the ranks per
   step, the first 3 steps skipped, as report.summary.step_times); each ratio is the median over rounds of
   drafter / off (target_slowdown_round_ratios_*, step_s_*_runs list the runs). goal_target_slowdown 1.03
   (Eagle3), target_slowdown_goal_met; the Eagle ratio tells what is EAGLE-3's own.

Run: python -m bench.eagle3 [--quick]   (make bench-eagle3 [QUICK=1]); --quick: 10 s of training per drafter
and one round of 60-step demo runs (< 4 min once the targets are cached); the full one 75 s and 3 rounds of 90.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import RESULTS_DIR, median, parse_args, print_table, write_results
from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = RESULTS_DIR / "cache"
N_LAYERS = 8
SEQ = 33                  # seq_cap (32) + 1 tokens per training sample
HELDOUT = 64              # held-out sequences
K = 4                     # draft length of the acceptance figure
LR = 4e-3                 # the demo's drafter lr (examples/demo.yaml)
DEMO_TARGET = {"preset": "debug", "overrides": {"n_layers": N_LAYERS}, "vocab": 264}
HF_TARGET = {"arch": "LlamaForCausalLM", "layers": N_LAYERS, "seed": 0}
TRAIN = {"source": "builtin:python-stdlib", "max_bytes": 2 << 20, "seq": 128, "batch": 16, "steps": 400,
         "lr": 3e-3, "seed": 0}
GOAL_RATIO = 1.2
GOAL_SLOWDOWN = 1.03
# the demo's layout for the bytes figure
PIPELINE, SEQ_LEN, DIM = 2, 256, 64


def _key(**parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def _train_loop(step_loss: Any, params: Any, corpus: torch.Tensor, cfg: dict[str, Any]) -> tuple[float, float]:
    """AdamW + one-cycle on random windows of the first 90% of `corpus`; (first loss, last loss)."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    end = int(corpus.numel() * 0.9) - cfg["seq"] - 1
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["steps"], pct_start=0.1)
    first = last = float("nan")
    for i in range(cfg["steps"]):
        idx = torch.randint(0, end, (cfg["batch"],), generator=gen)
        x = torch.stack([corpus[j: j + cfg["seq"] + 1] for j in idx.tolist()])
        loss = step_loss(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        last = float(loss.detach())
        first = last if i == 0 else first
        if i % 100 == 0:
            print(f"  target step {i}: loss {last:.3f}", flush=True)
    return first, last


class DemoTarget:
    """The demo's target shape as one model.Transformer; features by harvest.FeatureTap, as the stages tap them."""

    name = "demo"

    def __init__(self) -> None:
        from spectrain_workloads.data import load_corpus
        from spectrain_workloads.model import Transformer, model_config

        self.cfg = model_config(DEMO_TARGET["preset"], DEMO_TARGET["overrides"], vocab_size=DEMO_TARGET["vocab"])
        self.corpus = torch.from_numpy(load_corpus(TRAIN["source"], max_bytes=TRAIN["max_bytes"]).astype("int64"))
        self.model = Transformer(self.cfg)
        self.model.init_weights(0)
        path = CACHE_DIR / f"eagle3-demo-{_key(target=DEMO_TARGET, train=TRAIN, v=1)}.pt"
        if path.exists():
            blob = torch.load(path, weights_only=True)
            self.model.load_state_dict(blob["model"])
            self.info = {**json.loads(blob["info"]), "cached": True}
        else:
            print(f"training the demo target once (cached as {path.name}) ...", flush=True)
            t0 = time.perf_counter()
            m = self.model
            m.train()
            first, last = _train_loop(
                lambda x: torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()),
                m.parameters(), self.corpus, TRAIN)
            self.info = {"loss_start": first, "loss": last, "train_s": time.perf_counter() - t0}
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"model": m.state_dict(), "info": json.dumps(self.info)}, tmp)
            tmp.replace(path)
            self.info["cached"] = False
        self.model.eval()

    def shared(self) -> Any:
        from spectrain_workloads.drafter.models import TargetShared, config_digest

        m = self.model
        assert m.tok_embeddings is not None and m.output is not None
        return TargetShared(embedding=m.tok_embeddings.weight.detach().clone(), lm_head=m.output.weight.detach().clone(),
                            model_config=self.cfg, digest=config_digest(self.cfg.to_dict()), stamp=())

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (final-norm hidden [B, T, H], features [B, T, 3H] = inputs of `layers`)."""
        from spectrain_workloads.harvest.feature_tap import FeatureTap

        tap = FeatureTap([self.model], layers)
        try:
            _, hidden = self.model(tokens, return_hidden=True)
            feats = tap.take(tokens.size(0))
        finally:
            tap.remove()
        return hidden.float(), feats.float()


class HFTarget:
    """A tiny HF Llama (hf/tiny.py) trained with transformers; features from output_hidden_states."""

    name = "hf"

    def __init__(self) -> None:
        import transformers

        from spectrain_workloads.data import load_corpus
        from spectrain_workloads.hf.source import sizes
        from spectrain_workloads.hf.tiny import VOCAB, build_model
        from spectrain_workloads.hf.tokenizer import HFTokenizer

        d = CACHE_DIR / f"eagle3-hf-{_key(target=HF_TARGET, train=TRAIN, v=1)}"
        info_file = d / "bench_info.json"
        if not info_file.exists():
            print(f"training the HF target once (cached in {d.name}/) ...", flush=True)
            t0 = time.perf_counter()
            build_model(d, HF_TARGET["arch"], layers=HF_TARGET["layers"], seed=HF_TARGET["seed"])
            corpus = self._corpus(d, load_corpus, HFTokenizer, VOCAB)
            m = transformers.AutoModelForCausalLM.from_pretrained(str(d))
            m.train()
            first, last = _train_loop(
                lambda x: torch.nn.functional.cross_entropy(m(input_ids=x[:, :-1]).logits.flatten(0, 1),
                                                            x[:, 1:].flatten()),
                m.parameters(), corpus, TRAIN)
            m.save_pretrained(str(d))
            info = {"loss_start": first, "loss": last, "train_s": time.perf_counter() - t0}
            info_file.write_text(json.dumps(info))
            self.info = {**info, "cached": False}
        else:
            self.info = {**json.loads(info_file.read_text()), "cached": True}
        self.corpus = self._corpus(d, load_corpus, HFTokenizer, VOCAB)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
        self.hf_config = json.loads((d / "config.json").read_text())
        self.cfg = sizes(self.hf_config)

    @staticmethod
    def _corpus(d: Path, load_corpus: Any, tok_cls: Any, vocab: int) -> torch.Tensor:
        ids = load_corpus(TRAIN["source"], max_bytes=TRAIN["max_bytes"], tokenizer=tok_cls(d, model_vocab=vocab))
        return torch.from_numpy(ids.astype("int64"))

    def shared(self) -> Any:
        from spectrain_workloads.drafter.models import TargetShared, config_digest

        emb = self.model.get_input_embeddings().weight.detach().clone()
        head = self.model.get_output_embeddings().weight.detach().clone()
        return TargetShared(embedding=emb, lm_head=head, model_config=self.cfg,
                            digest=config_digest({**self.cfg.to_dict(), "hf_config": self.hf_config}), stamp=(),
                            hf_config=self.hf_config)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=tokens, output_hidden_states=True)
        hs = out.hidden_states                     # [L + 1] x [B, T, H]; the last one after the final norm
        return hs[-1].float(), torch.cat([hs[i] for i in layers], dim=-1).float()


def windows(corpus: torch.Tensor, n: int, seed: int, heldout: bool) -> torch.Tensor:
    """n windows of SEQ tokens: from the first 90% of the text (training) or the last 10% (held out)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (int(corpus.numel() * 0.9), corpus.numel() - SEQ) if heldout else (0, int(corpus.numel() * 0.9) - SEQ)
    starts = torch.randint(lo, hi, (n,), generator=g)
    return torch.stack([corpus[s: s + SEQ] for s in starts.tolist()])


def compare(target: Any, train_s: float) -> dict[str, Any]:
    """Train an Eagle and an Eagle3 DrafterTrainer on the same stream for train_s seconds each (interleaved),
    then measure both on held-out text."""
    from spectrain_api.eagle3 import default_feature_layers
    from spectrain_workloads.drafter import eagle3_tasks, verify
    from spectrain_workloads.drafter.combiner import Sample
    from spectrain_workloads.drafter.settings import DrafterSettings
    from spectrain_workloads.drafter.train import DrafterTrainer

    t = target.name
    layers = default_feature_layers(target.cfg.n_layers)
    shared = target.shared()
    torch.manual_seed(0)
    trainers = {arch: DrafterTrainer(DrafterSettings(arch=arch, preset="debug", lr=LR, seed=0), shared,
                                     torch.device("cpu")) for arch in ("Eagle", "Eagle3")}
    assert trainers["Eagle3"].feature_layers == layers
    per_step = trainers["Eagle"].settings.samples_per_step
    stream: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        while len(stream) <= i:
            tokens = windows(target.corpus, per_step, seed=1000 + len(stream), heldout=False)
            final, feats = target.forward(tokens, layers)
            stream.append((tokens, final, feats))
        return stream[i]

    used = {arch: 0.0 for arch in trainers}
    steps = {arch: 0 for arch in trainers}
    loss = {arch: float("nan") for arch in trainers}
    while min(used.values()) < train_s:
        arch = min(used, key=lambda a: used[a])
        tokens, final, feats = batch(steps[arch])
        hidden = torch.cat([feats, final], dim=-1) if arch == "Eagle3" else final
        samples = [Sample(tokens=tokens[j], hidden=hidden[j], step=0) for j in range(len(tokens))]
        tr = trainers[arch]
        t0 = time.perf_counter()
        loss[arch] = tr.micro_step(samples)
        tr.optimizer_step(len(samples))
        used[arch] += time.perf_counter() - t0
        steps[arch] += 1

    tokens = windows(target.corpus, HELDOUT, seed=99, heldout=True)
    final, feats = target.forward(tokens, layers)
    e1, e3 = trainers["Eagle"], trainers["Eagle3"]
    a1 = verify.measure_batch(e1.model, tokens, final, e1.target_head, k=K)
    a3 = eagle3_tasks.measure_batch(e3.model, tokens, torch.cat([feats, final], -1), e3.target_head, k=K)
    alpha1 = verify.sampled_acceptance_rate(e1.model, [(tokens[i], final[i]) for i in range(len(tokens))])
    alpha3 = eagle3_tasks.sampled_acceptance_rate(e3.model, tokens, torch.cat([feats, final], -1), e3.target_head)
    return {
        f"acceptance_eagle1_t0_{t}": a1.acceptance_length, f"acceptance_eagle3_t0_{t}": a3.acceptance_length,
        f"alpha_eagle1_t1_{t}": alpha1, f"alpha_eagle3_t1_{t}": alpha3,
        f"acceptance_eagle3_over_eagle1_{t}": a3.acceptance_length / a1.acceptance_length,
        f"alpha_eagle3_over_eagle1_{t}": alpha3 / alpha1 if alpha1 > 0 else float("nan"),
        f"top1_eagle1_{t}": a1.top1, f"top1_eagle3_{t}": a3.top1,
        f"train_s_eagle1_{t}": used["Eagle"], f"train_s_eagle3_{t}": used["Eagle3"],
        f"samples_eagle1_{t}": steps["Eagle"] * per_step, f"samples_eagle3_{t}": steps["Eagle3"] * per_step,
        f"drafter_loss_eagle1_{t}": loss["Eagle"], f"drafter_loss_eagle3_{t}": loss["Eagle3"],
        f"target_loss_start_{t}": target.info["loss_start"], f"target_loss_{t}": target.info["loss"],
        f"target_cached_{t}": target.info["cached"],
    }


def feature_bytes() -> dict[str, Any]:
    """Per training sample, the arrays that cross the ring and the fleet (module docstring, 2.)."""
    from spectrain_api.eagle3 import default_feature_layers

    T, H, P, L = SEQ_LEN, DIM, PIPELINE, N_LAYERS
    tok = T * 8                                        # tokens [T] int64
    per_stage = L // P
    layers = default_feature_layers(L)
    held = [sum(1 for i in layers if s * per_stage <= i < (s + 1) * per_stage) for s in range(P)]   # [1, 2]

    def rec(width: int) -> int:                        # tokens + one fp32 [T, width] array (or several side by side)
        return tok + T * width * 4

    eagle1 = rec(H) + (P - 1) * rec(H)                 # last stage's ring record + forwarded samples
    rings = [rec(held[s] * H + (H if s == P - 1 else 0)) for s in range(P)]   # the last stage's also has hidden
    parts = [rec(held[s] * H) for s in range(P - 1) if held[s]]               # send_part to the last stage
    forwarded = (P - 1) * rec(4 * H)
    eagle3 = sum(rings) + sum(parts) + forwarded
    return {"feature_bytes_per_sample_eagle1": eagle1, "feature_bytes_per_sample_eagle3": eagle3,
            "feature_bytes_per_sample_ratio": eagle3 / eagle1, "fleet_bytes_per_sample_eagle3": sum(parts) + forwarded,
            "feature_layers_per_stage": held, "part_bytes": sum(parts), "forward_bytes": rec(4 * H)}


def demo_job(arch: str | None, steps: int, root: Path) -> dict[str, Any]:
    """examples/demo.yaml with drafter `arch` (Eagle3 or Eagle), or spec.drafter.enabled false (None)."""
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"]["steps"] = steps
    job["spec"]["target"]["checkpoint"]["everySteps"] = min(steps, job["spec"]["target"]["checkpoint"]["everySteps"])
    if arch is not None:
        job["spec"]["drafter"]["arch"] = arch
    else:
        job["spec"]["drafter"]["enabled"] = False
    root.mkdir(parents=True, exist_ok=True)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "run", str(path), "--run-dir",
                          str(root / "run")], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"demo run ({arch or 'drafter off'}) failed ({res.returncode}):\n"
                         f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    data = run_volume(root / "run")
    by_step: dict[int, float] = {}
    for f in sorted((data / "metrics").glob("target-rank-*.jsonl")):
        for rec in map(json.loads, f.open()):
            if "step_time_s" in rec and rec.get("step", 0) > 2:          # report.summary.step_times
                by_step[rec["step"]] = max(by_step.get(rec["step"], 0.0), float(rec["step_time_s"]))
    out: dict[str, Any] = {"wall_s": wall, "step_s": median([by_step[s] for s in sorted(by_step)]), "steps": len(by_step)}
    if arch is not None:
        out["summaries"] = [json.loads(p.read_text()) for _, p in rundir.drafter_summaries(data)]
    return out


def slowdown(rounds: int, steps: int, root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Rounds of three runs (drafter off, Eagle, Eagle3), the order rotated each round; per round the
    ratio of each drafter's median step time to the off run's."""
    runs: dict[str | None, list[dict[str, Any]]] = {None: [], "Eagle": [], "Eagle3": []}
    for i in range(rounds):
        order = [None, "Eagle", "Eagle3"]
        order = order[i % 3:] + order[:i % 3]
        for arch in order:
            print(f"  demo run, round {i + 1}/{rounds}: {arch or 'drafter off'} ...", flush=True)
            runs[arch].append(demo_job(arch, steps, root / f"round{i}-{arch or 'off'}"))
    out: dict[str, Any] = {"goal_target_slowdown": GOAL_SLOWDOWN, "demo_steps": steps, "demo_rounds": rounds,
                           "step_s_off_runs": [r["step_s"] for r in runs[None]]}
    for arch, name in (("Eagle3", "eagle3"), ("Eagle", "eagle1")):
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(runs[arch], runs[None], strict=True)]
        out[f"target_slowdown_ratio_{name}"] = statistics.median(ratios)
        out[f"target_slowdown_round_ratios_{name}"] = ratios
        out[f"step_s_{name}_runs"] = [r["step_s"] for r in runs[arch]]
    out["target_slowdown_goal_met"] = bool(out["target_slowdown_ratio_eagle3"] <= GOAL_SLOWDOWN)
    return out, runs["Eagle3"]


def measured_bytes(runs: list[dict[str, Any]], layout: dict[str, Any]) -> dict[str, Any]:
    """The fleet counters of the last Eagle3 demo run's drafter summaries, against the layout: the parts and
    samples the counters report priced by the layout (fleet_bytes_eagle3_layout) over the bytes the drafters
    sent (exchange_bytes_sent, also weight frames and frame headers): <= 1, near 1 when the features dominate."""
    sums = runs[-1]["summaries"]

    def total(key: str) -> int:
        return int(sum(s.get(key, 0) for s in sums))

    assembled, sent = total("featureSamplesAssembled"), total("exchangeBytesSent")
    priced = total("featurePartsSent") * layout["part_bytes"] + total("samplesShared") * layout["forward_bytes"]
    return {"feature_parts_sent": total("featurePartsSent"), "feature_samples_assembled": assembled,
            "samples_shared": total("samplesShared"), "exchange_bytes_sent": sent,
            "weight_frames_sent": total("weightFramesSent"), "fleet_bytes_eagle3_layout": priced,
            "fleet_bytes_layout_over_measured": priced / sent if sent else float("nan"),
            "fleet_bytes_per_sample_eagle3_measured": sent / assembled if assembled else float("nan")}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    train_s, rounds, steps = (10.0, 1, 60) if args.quick else (75.0, 3, 90)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    demo, hf = DemoTarget(), HFTarget()
    torch.set_num_threads(1)                 # one core per drafter, as in the job (SPECTRAIN_TORCH_THREADS 1)
    results: dict[str, Any] = {"train_budget_s": train_s, "k": K, "heldout_sequences": HELDOUT, "drafter_lr": LR}
    for target in (demo, hf):
        print(f"{target.name}: Eagle vs Eagle3, {train_s:.0f} s of training each ...", flush=True)
        results.update(compare(target, train_s))
    ratios = [results[f"acceptance_eagle3_over_eagle1_{t}"] for t in ("demo", "hf")]
    results["acceptance_eagle3_over_eagle1"] = min(ratios)
    results["goal_acceptance_ratio"] = GOAL_RATIO
    results["acceptance_goal_met"] = bool(min(ratios) >= GOAL_RATIO)
    layout = feature_bytes()
    results.update(layout)
    with tempfile.TemporaryDirectory(prefix="bench-eagle3-") as tmp:
        slow, on_runs = slowdown(rounds, steps, Path(tmp))
    results.update(slow)
    results.update(measured_bytes(on_runs, layout))
    results["wall_s"] = time.perf_counter() - t_start
    path = write_results("eagle3", results, args.quick)
    print_table("bench-eagle3 (Eagle3 vs Eagle drafter)",
                {k: v for k, v in results.items() if not isinstance(v, list) and not (isinstance(v, float)
                                                                                      and math.isnan(v))})
    print(f"\n-> {path}")


if __name__ == "__main__":
    main()
