"""Bring your own trainer: a plain DistributedDataParallel loop (2 replicas) on the builtin text,
feeding a spectrain drafter through spectrain_workloads.hooks (manifest: ddp.yaml): a Communication
window per gradient bucket, the final hidden states of each microbatch, an Imbalance watch on the
step's barrier. Outside a SpecTrainJob attach() returns a no-op publisher: `torchrun --nproc-per-node 2 THIS`."""
import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spectrain_workloads import hooks
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 150
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, BUCKET_MB = 264, 128, 4, 4, 128, 4, 1.0


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:   # tokens [b, T]
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        h = self.norm(h)
        return self.head(h), h                                                  # logits [b, T, V], hidden [b, T, H]


def main() -> None:
    torch.set_num_threads(1)                       # one core per rank, as one GPU per rank
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                           # every replica starts from the same weights
    model = Model()
    pub = hooks.attach(hidden_dim=DIM, seq_len=SEQ)     # a no-op outside a SpecTrainJob
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    hooks.ddp_comm_hook(ddp, pub)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    loader = TokenLoader(load_corpus("builtin:python-stdlib", max_bytes=1 << 20),
                         LoaderSpec(seq_len=SEQ, batch_size=BATCH, data_parallel=world, replica=rank))
    for step in range(STEPS):
        if step % 20 == 0:                         # the drafter borrows the current embedding / LM head
            pub.share_weights(embedding=model.embed.weight, lm_head=model.head.weight)
        x, y = loader.batch(step)
        logits, hidden = ddp(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        pub.hidden_states(hidden.detach(), x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with pub.imbalance():                      # waiting here for the slower replica is its lateness
            dist.barrier()
        pub.step_end(step, loss=loss.item(), tokens=BATCH * SEQ)
        print(f"step {step} loss {loss.item()!r}", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"rank {rank} weights {digest}", flush=True)
    pub.close()
    dist.barrier()                                 # no rank tears gloo down while a peer is still in
    dist.destroy_process_group()                   # its last collective (the peer would abort at exit)


if __name__ == "__main__":
    main()
