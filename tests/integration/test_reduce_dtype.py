"""Gradient accumulation and reduction dtype under bf16 (``train.reduce_dtype``): the live engines
DeepSpeed builds from ``pretrain.distributed.engine.deepspeed_config`` on 2 ranks, and what bf16 reduction
loses that fp32 keeps: 16 accumulated micro-batches, one gradient of 1 and the rest 1e-3 (the
small ones are below bf16's resolution next to the large one)."""
import json
import math

import pytest

from dist_utils import deepspeed_cmd, run_job
from pretrain.config import ConfigError
from pretrain.config.schema import OptimConfig, TrainConfig, ZeroConfig
from pretrain.distributed.engine import deepspeed_config

GAS, SMALL, WORLD = 16, 1e-3, 2


def exact_norm() -> float:
    """The averaged gradient of the one-weight model, in exact arithmetic: DeepSpeed divides each
    micro-batch's loss by the accumulation steps and averages over ranks."""
    total = (1.0 + (GAS - 1) * SMALL) + GAS * SMALL  # rank 0, rank 1
    per_element = total / GAS / WORLD
    return math.sqrt(4) * per_element


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduce") / "cases.json"
    r = run_job(deepspeed_cmd("tests.jobs.reduce_dtype_job", str(out)), timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(out.read_text())


def test_default_is_fp32_reduction_at_every_stage(cases):
    for stage in (1, 2, 3):
        assert cases[f"z{stage}-fp32"]["comm"] == "torch.float32", cases
        assert cases[f"z{stage}-bf16"]["comm"] == "torch.bfloat16", cases
    # what DeepSpeed builds: ZeRO-1 with fp32 accumulation is its BF16_Optimizer
    assert cases["z1-fp32"]["optimizer"] == "BF16_Optimizer"
    assert cases["z1-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert cases["z2-fp32"]["optimizer"] == cases["z2-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert cases["z3-fp32"]["optimizer"] == cases["z3-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_bf16_reduction_loses_small_gradients_that_fp32_keeps(cases):
    want = exact_norm()
    for stage in (1, 2, 3):
        fp32, bf16 = cases[f"z{stage}-fp32"]["grad_norm"], cases[f"z{stage}-bf16"]["grad_norm"]
        assert abs(fp32 - want) / want < 1e-3, (stage, fp32, want)  # fp32 keeps every small gradient
        assert abs(bf16 - want) / want > 5e-3, (stage, bf16, want)  # bf16 rounds them away


def test_default_config_and_stage0_refusal():
    train = TrainConfig(precision="bf16", global_batch_size=8, micro_batch_size=4)
    cfg = deepspeed_config(OptimConfig(), train, ZeroConfig(stage=2), 2)
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and cfg["communication_data_type"] == "fp32"
    assert cfg["bf16"] == {"enabled": True, "check_grad_overflow": False}
    with pytest.raises(ConfigError, match="zero.stage=0 with train.precision=bf16"):
        deepspeed_config(OptimConfig(), train, ZeroConfig(stage=0), 2)
    fp32 = deepspeed_config(OptimConfig(), TrainConfig(precision="fp32", global_batch_size=8, micro_batch_size=4),
                            ZeroConfig(stage=0), 2)
    assert "communication_data_type" not in fp32 and fp32["bf16"] == {"enabled": False}
