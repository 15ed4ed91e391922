"""Harvest any PyTorch trainer: the hooks a user's training script calls to feed its drafter.

    pub = attach()                                   # a no-op publisher outside a SpecTrainJob
    with pub.idle("Bubble", expected_s=None): ...    # any idle window, by hand
    pub.hidden_states(hidden, tokens)                # final-norm hidden [b, T, H], input ids [b, T]
    pub.step_end(step)
    pub.share_weights(embedding=emb.weight, lm_head=head.weight)   # once, by the stages holding them
    with pub.imbalance(): dist.barrier()             # waiting for slower ranks
    hooks = instrument_schedule(schedule, pub, final_norm=model.norm)   # torch.distributed.pipelining
    ddp_comm_hook(ddp_model, pub)                    # Communication window per DDP bucket
    instrument_fsdp(fsdp_model, pub)                 # ... per FSDP2 all-gather / reduce-scatter

docs/bring-your-trainer.md says what each adds and costs; torch_internals.py names every private
torch name the adapters use and the torch versions they were tested with.
"""

from spectrain_workloads.hooks.ddp import ddp_comm_hook
from spectrain_workloads.hooks.errors import HookError
from spectrain_workloads.hooks.fsdp import instrument_fsdp
from spectrain_workloads.hooks.pipelining import instrument_schedule
from spectrain_workloads.hooks.publisher import NOOP, NoopPublisher, Publisher, attach

__all__ = ["NOOP", "HookError", "NoopPublisher", "Publisher", "attach", "ddp_comm_hook", "instrument_fsdp",
           "instrument_schedule"]
