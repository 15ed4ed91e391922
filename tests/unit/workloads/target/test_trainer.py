"""target.trainer: the Pretrain layout (every rule at start); harvest.instrument: the instrumented-step pattern."""

from __future__ import annotations

import pytest

from spectrain_api.config import CheckpointSpec, JobConfig, Parallelism, TargetSpec
from spectrain_api.errors import ConfigError

pytestmark = pytest.mark.unit


def _cfg(**par: int | str) -> JobConfig:
    p = Parallelism(**{"schedule": "1F1B", **par})
    return JobConfig(target=TargetSpec(nodes=p.data * p.pipeline, parallelism=p,
                                       checkpoint=CheckpointSpec(claim_name="run")))


def test_bad_input_is_a_config_error_naming_the_field(tmp_path) -> None:
    from spectrain_workloads.target.trainer import make_layout

    layout = make_layout(_cfg(data=1, pipeline=2, microbatches=4), 2)
    assert layout.pipeline == 2 and layout.model.n_layers == 4
    assert make_layout(_cfg(data=1, pipeline=2, microbatches=4, schedule="Interleaved1F1B"), 2).schedule.chunks == 2
    cases = [
        (_cfg(data=1, pipeline=2, microbatches=4), 4,
         r"spec\.target\.parallelism: data \(1\) x pipeline \(2\) = 2 but WORLD_SIZE is 4"),
        (_cfg(data=1, pipeline=3, microbatches=4), 3, r"spec\.target\.parallelism\.pipeline: 3 stages do not divide "
         r"the model's 4 layers"),
        (_cfg(data=1, pipeline=4, microbatches=4, schedule="Interleaved1F1B"), 4,
         r"Interleaved1F1B .* 2 x pipeline = 8 must divide the model's 4 layers; set "
         r"spec\.target\.model\.overrides\.n_layers to a multiple of 8"),
    ]
    uneven = _cfg(data=1, pipeline=2, microbatches=3, schedule="Interleaved1F1B")
    uneven.target.data.batch_size = 6
    cases.append((uneven, 2, r"spec\.target\.parallelism\.microbatches: Interleaved1F1B needs a multiple of "
                             r"pipeline \(2\), got 3"))
    unknown = _cfg(data=1, pipeline=1)
    unknown.target.model.preset = "huge"
    cases.append((unknown, 1, r"spec\.target\.model\.preset 'huge' is unknown"))
    unreadable = _cfg(data=1, pipeline=1)
    unreadable.target.data.source = f"file://{tmp_path}/missing"
    cases.append((unreadable, 1, r"spec\.target\.data\.source .* does not exist"))
    odd = _cfg(data=1, pipeline=2, microbatches=3)
    odd.target.data.batch_size = 8
    cases.append((odd, 2, r"spec\.target\.data\.batchSize: 8 must be a multiple of .*microbatches \(3\)"))
    for cfg, world, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            make_layout(cfg, world)


def test_instrument_interleave_pattern_and_option() -> None:
    from spectrain_workloads.harvest.instrument import instrumented_step
    from spectrain_workloads.runtime import TargetOptions

    assert all(instrumented_step(s, 0) for s in range(10))
    # blocks of 2 in the order on off off on, then again
    assert [instrumented_step(s, 2) for s in range(16)] == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 4 + [True] * 2
    env = {"SPECTRAIN_RUN_DIR": "/tmp/x", "SPECTRAIN_INSTRUMENT_INTERLEAVE": "4"}
    assert TargetOptions.from_env(env).instrument_interleave == 4
    with pytest.raises(ConfigError, match="SPECTRAIN_INSTRUMENT_INTERLEAVE must be >= 0"):
        TargetOptions.from_env({**env, "SPECTRAIN_INSTRUMENT_INTERLEAVE": "-1"})
    with pytest.raises(ConfigError, match="SPECTRAIN_INSTRUMENT_INTERLEAVE='x' is not a valid int"):
        TargetOptions.from_env({**env, "SPECTRAIN_INSTRUMENT_INTERLEAVE": "x"})
