"""Bring your own trainer: torch.distributed.pipelining Schedule1F1B over 2 stages on the builtin
text, feeding a spectrain drafter through spectrain_workloads.hooks (manifest: pipelining.yaml).
Outside a SpecTrainJob attach() returns a no-op publisher: `torchrun --nproc-per-node 2 THIS [STEPS]`."""
import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from spectrain_workloads import hooks
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
VOCAB, DIM, HEADS, LAYERS_PER_STAGE, SEQ, BATCH, MICROBATCHES = 264, 128, 4, 2, 128, 8, 4


class Part(nn.Module):
    """One pipeline stage: [token embedding] + decoder layers [+ final norm + LM head]."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS_PER_STAGE))
        self.norm = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # tokens [b, T] or hidden [b, T, H]
        h = self.embed(x) if self.embed is not None else x
        mask = nn.Transformer.generate_square_subsequent_mask(h.size(1))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h)) if self.head is not None else h   # logits [b, T, V] or hidden


def main() -> None:
    torch.set_num_threads(1)                       # one core per rank, as one GPU per rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first, last = rank == 0, rank == 1
    torch.manual_seed(rank)
    part = Part(first, last)
    pub = hooks.attach(hidden_dim=DIM, seq_len=SEQ)     # a no-op outside a SpecTrainJob
    schedule = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu")), MICROBATCHES,
                            loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    # With `arch: Eagle3` in the manifest the drafter reads the inputs of three of the 4 layers
    # (default 1, 2, 3; stage 0 publishes layer 1's); with `arch: Eagle` this does nothing.
    layers = {rank * LAYERS_PER_STAGE + i: layer for i, layer in enumerate(part.layers)}   # global id -> layer
    pipe = hooks.instrument_schedule(schedule, pub, final_norm=part.norm, feature_layers=layers,
                                     num_layers=2 * LAYERS_PER_STAGE)
    opt = torch.optim.AdamW(part.parameters(), lr=3e-3)
    loader = TokenLoader(load_corpus("builtin:python-stdlib", max_bytes=1 << 20), LoaderSpec(seq_len=SEQ, batch_size=BATCH))
    for step in range(STEPS):
        if step % 20 == 0:                         # the drafter borrows the current embedding / LM head
            pub.share_weights(embedding=part.embed.weight if first else None, lm_head=part.head.weight if last else None)
        x, y = loader.batch(step)
        pipe.set_tokens(x)
        losses: list[torch.Tensor] = []
        schedule.step(x) if first else schedule.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(torch.stack(losses).detach().mean()) if last else None
        pub.step_end(step, loss=loss, tokens=BATCH * SEQ)
        if last:
            print(f"step {step} loss {loss!r}", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in part.parameters())).hexdigest()
    print(f"rank {rank} weights {digest}", flush=True)
    pub.close()
    dist.barrier()                                 # no rank tears gloo down while a peer is still in
    dist.destroy_process_group()                   # its last collective (the peer would abort at exit)


if __name__ == "__main__":
    main()
