"""bench-combine: how to make one drafter out of N replicas, compared at an equal number of samples.

N drafter replicas each see their own stream of samples (hidden states of one trained debug
target on disjoint text), as the drafters of N ranks do. The ways to end with one model:
- average:   each replica steps on its own; every K optimizer steps the replicas' parameters are
             averaged (what drafter.fleet does, there by time rather than by step count)
- diloco:    the same rounds, but the averaged change is applied by an outer Nesterov step
             (DiLoCo: outer lr 0.7, momentum 0.9) to the shared starting point
- gradients: every optimizer step averages the N replicas' gradients (a gradient aggregator:
             one model trained on N x the batch)
- single:    one replica only, its own stream (a job's drafters before the fleet: one export,
             the others' work discarded)

acceptance_<method>     expected accepted length (k=4) on held-out text through the target, after
                        every replica trained on `samples_per_replica` samples, at the drafter's
                        learning rate; acceptance_<method>_lr4x: at 4x that rate (an average of N
                        replicas is a larger batch, which may take a larger step)
bytes_per_sample_<m>    model bytes sent per trained sample (fp32 parameters or gradients, up and
                        down, counted for one replica): what each method costs on the network

Nothing here is timed: the figures are functions of the seed, not of the machine's load.

Run: python -m bench.combine [--quick]   (make bench-combine [QUICK=1])
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from bench.common import parse_args, print_table, write_results
from spectrain_api.config import model_config
from spectrain_workloads.drafter.models import build_drafter, eagle_loss
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import make_target, target_hidden, text_sequences
from spectrain_workloads.drafter.verify import measure
from spectrain_workloads.model import Transformer

N, K, B = 4, 8, 8                  # replicas, optimizer steps per round, samples per optimizer step
METHODS = ("average", "diloco", "gradients", "single")


def trained_target(steps: int) -> Transformer:
    """The debug target after `steps` of next-token training on the text (not degenerate)."""
    cfg = model_config("debug", {"n_layers": 4, "max_seq_len": 128}, vocab_size=264)
    model = make_target(cfg, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(steps):
        x = text_sequences(16, 129, seed=90_000 + i)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def stream(target: Transformer, replica: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica's samples: `batches` batches of B chunks (tokens [B, 33], hidden [B, 33, H])."""
    out = []
    for i in range(batches):
        x = text_sequences(B, 33, seed=10_000 * (replica + 1) + i)
        out.append((x, target_hidden(target, x)))
    return out


def new_drafter(target: Transformer) -> torch.nn.Module:
    d = build_drafter(DrafterSettings(), target.cfg)
    d.load_target_weights(target.tok_embeddings.weight, target.output.weight)   # type: ignore[union-attr]
    return d


def grads(d: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    s = DrafterSettings()
    loss, _ = eagle_loss(d, batch[0], batch[1], hidden_weight=s.hidden_loss_weight, ce_weight=s.ce_loss_weight,
                         stats=False)
    (loss / len(batch[0])).backward()


def step(d: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_([p for p in d.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def trainable(d: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in d.parameters() if p.requires_grad]


@torch.no_grad()
def average_into(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    mean = [torch.stack(ps).mean(0) for ps in zip(*(trainable(m) for m in models), strict=True)]
    for m in models:
        for p, v in zip(trainable(m), mean, strict=True):
            p.copy_(v)
    return mean


def train(method: str, target: Transformer, streams: list[list[Any]], lr: float) -> torch.nn.Module:
    base = new_drafter(target)
    if method == "single":
        d = copy.deepcopy(base)
        opt = torch.optim.AdamW(trainable(d), lr=lr, weight_decay=0.0)
        for batch in streams[0]:
            grads(d, batch)
            step(d, opt)
        return d
    reps = [copy.deepcopy(base) for _ in range(N)]
    opts = [torch.optim.AdamW(trainable(r), lr=lr, weight_decay=0.0) for r in reps]
    if method == "gradients":
        for batches in zip(*streams, strict=True):
            for r, batch in zip(reps, batches, strict=True):
                grads(r, batch)
            with torch.no_grad():   # every replica holds the same parameters; give each the mean gradient
                for ps in zip(*(trainable(r) for r in reps), strict=True):
                    g = torch.stack([p.grad for p in ps]).mean(0)   # type: ignore[misc]
                    for p in ps:
                        p.grad = g.clone()
            for r, o in zip(reps, opts, strict=True):
                step(r, o)
        return reps[0]
    anchor = [p.detach().clone() for p in trainable(base)]
    momentum = [torch.zeros_like(p) for p in anchor]
    for i, batches in enumerate(zip(*streams, strict=True)):
        for r, o, batch in zip(reps, opts, batches, strict=True):
            grads(r, batch)
            step(r, o)
        if (i + 1) % K:
            continue
        mean = average_into(reps)
        if method == "diloco":
            with torch.no_grad():
                for a, m, v in zip(anchor, mean, momentum, strict=True):
                    delta = a - m                       # the outer "gradient"
                    v.mul_(0.9).add_(delta)
                    a.sub_(0.7 * (delta + 0.9 * v))     # Nesterov
                for r in reps:
                    for p, a in zip(trainable(r), anchor, strict=True):
                        p.copy_(a)
    if method == "average" and len(streams[0]) % K:
        average_into(reps)
    return reps[0]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target = trained_target(150 if args.quick else 400)
    batches = 64 if args.quick else 256                      # per replica: 512 or 2048 samples
    streams = [stream(target, r, batches) for r in range(N)]
    tokens = text_sequences(16, 64, seed=4321)              # held out: seeds no stream uses
    held = list(zip(tokens, target_hidden(target, tokens), strict=True))
    keys: dict[str, Any] = {"replicas": N, "steps_per_round": K, "samples_per_replica": batches * B}
    n_params = sum(p.numel() for p in trainable(new_drafter(target)))
    lr = DrafterSettings().lr
    for m in METHODS:
        for suffix, rate in (("", lr), ("_lr4x", 4 * lr)):
            d = train(m, target, streams, rate)
            keys[f"acceptance_{m}{suffix}"] = float(measure(d, held, None, k=4).acceptance_length)
    per_round = 2 * 4 * n_params                             # fp32 up to the aggregator and back
    keys["bytes_per_sample_average"] = keys["bytes_per_sample_diloco"] = per_round / (K * B)
    keys["bytes_per_sample_gradients"] = per_round / B
    keys["bytes_per_sample_single"] = 0.0
    print_table(f"bench-combine ({N} replicas, {batches * B} samples each)", keys)
    write_results("combine", keys, args.quick)


if __name__ == "__main__":
    main()
