"""Gradient accumulation and reduction dtype under bf16 (``train.reduce_dtype``): the live engines
DeepSpeed builds from ``pretrain.distributed.engine.deepspeed_config`` on 2 ranks, and what bf16 reduction
loses that fp32 keeps: 16 accumulated micro-batches, one gradient of 1 and the rest 2**-10 (the
small ones are below bf16's resolution next to the large one)."""
import json

import pytest
from dist_utils import deepspeed_cmd, run_job

from pretrain.config import ConfigError
from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import deepspeed_config

BUCKETS = dict(reduce_bucket_size=500_000_000, stage3_prefetch_bucket_size=50_000_000)  # `auto` needs the model

GAS, SMALL, WORLD = 16, 2.0 ** -10, 2


def exact_norm() -> float:
    """The averaged gradient of the one-weight model (4 elements), in exact arithmetic: DeepSpeed
    divides each micro-batch's loss by the accumulation steps and averages over ranks."""
    total = (1.0 + (GAS - 1) * SMALL) + GAS * SMALL  # rank 0, rank 1
    return 2 * total / GAS / WORLD


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduce") / "cases.json"
    r = run_job(deepspeed_cmd("tests.jobs.reduce_dtype_job", str(out)), timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(out.read_text())


def error(case: dict) -> float:
    return abs(case["grad_norm"] - exact_norm()) / exact_norm()


def test_default_is_fp32_reduction_at_every_stage(cases):
    for stage in (1, 2, 3):
        assert cases[f"bf16-z{stage}-fp32"]["comm"] == "torch.float32", cases
        assert cases[f"bf16-z{stage}-bf16"]["comm"] == "torch.bfloat16", cases
    # what DeepSpeed builds: ZeRO-1 with fp32 accumulation is its BF16_Optimizer
    assert cases["bf16-z1-fp32"]["optimizer"] == "BF16_Optimizer"
    assert cases["bf16-z1-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert cases["bf16-z2-fp32"]["optimizer"] == cases["bf16-z2-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert cases["bf16-z3-fp32"]["optimizer"] == cases["bf16-z3-bf16"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    # bf16-autocast: the module stays fp32; only with reduce_dtype=bf16 does DeepSpeed mark the Linear for bf16
    built = {0: "SGD", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    for stage, optimizer in built.items():
        fp32, bf16 = cases[f"bf16-autocast-z{stage}-fp32"], cases[f"bf16-autocast-z{stage}-bf16"]
        assert fp32["module_dtype"] == bf16["module_dtype"] == "torch.float32", cases
        assert fp32["weight_comm"] == "None" and bf16["weight_comm"] == "torch.bfloat16", cases
        assert fp32["optimizer"] == bf16["optimizer"] == optimizer, cases


def test_bf16_reduction_loses_small_gradients_that_fp32_keeps(cases):
    """bf16 (DeepSpeed's) accumulates in bf16 too: the small gradients vanish next to the large one."""
    for stage in (1, 2, 3):
        assert error(cases[f"bf16-z{stage}-fp32"]) < 1e-3, (stage, cases)  # fp32 keeps every small gradient
        assert error(cases[f"bf16-z{stage}-bf16"]) > 5e-3, (stage, cases)  # bf16 rounds them away


def test_autocast_accumulates_in_fp32_and_rounds_only_the_reduction(cases):
    """Under bf16-autocast the gradients accumulate on the fp32 parameters: with an fp32 reduction the
    step is exact (every value here is a power of two apart), with a bf16 one only the reduced sums
    are rounded, once (at most 2**-8 relative), not every small gradient lost as in bf16."""
    for stage in (0, 1, 2, 3):
        assert error(cases[f"bf16-autocast-z{stage}-fp32"]) < 1e-6, (stage, cases)
        assert 1e-4 < error(cases[f"bf16-autocast-z{stage}-bf16"]) < 2 ** -8, (stage, cases)


def test_default_config_and_stage0_refusal():
    train = TrainConfig(global_batch_size=8, micro_batch_size=4)
    assert train.precision == "bf16"
    cfg = deepspeed_config(OptimConfig(), train, ZeroConfig(stage=2, **BUCKETS), 2)
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and cfg["communication_data_type"] == "fp32"
    assert cfg["bf16"] == {"enabled": True, "check_grad_overflow": False, "immediate_grad_update": False,
                           "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    assert cfg["fp16"] == cfg["torch_autocast"] == {"enabled": False}
    with pytest.raises(ConfigError, match="zero.stage=0 with train.precision=bf16"):
        deepspeed_config(OptimConfig(), train, ZeroConfig(stage=0, **BUCKETS), 2)
    auto = TrainConfig(precision="bf16-autocast", global_batch_size=8, micro_batch_size=4)
    # no refusal: fp32 gradients at ZeRO-0
    cfg = deepspeed_config(OptimConfig(), auto, ZeroConfig(stage=0, **BUCKETS), 2)
    assert cfg["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert cfg["bf16"] == {"enabled": False} and cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    fp32 = deepspeed_config(OptimConfig(), TrainConfig(precision="fp32", global_batch_size=8, micro_batch_size=4),
                            ZeroConfig(stage=0, **BUCKETS), 2)
    assert fp32["communication_data_type"] == "fp32" and fp32["bf16"] == fp32["torch_autocast"] == {"enabled": False}
    with pytest.raises(ConfigError, match="train.reduce_dtype=bf16 with train.precision=fp32"):
        deepspeed_config(OptimConfig(), TrainConfig(precision="fp32", reduce_dtype="bf16", global_batch_size=8,
                                                    micro_batch_size=4), ZeroConfig(stage=1, **BUCKETS), 2)


def test_auto_buckets_reduce_during_the_backward():
    """ZeRO-2 on 2 ranks: with ``zero.reduce_bucket_size: auto`` (a quarter of the tiny ViT's
    parameters at most) the first gradient reduction starts before the autograd pass has produced
    its last gradient; with DeepSpeed's 5e8 (larger than the model) every reduction waits for the end
    of the backward, overlapping nothing."""
    r = run_job(deepspeed_cmd("tests.jobs.reduce_overlap_job", json.dumps(["auto", 500_000_000])), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if "RESULT " in ln).split("RESULT ", 1)[1])
    auto, whole = got["auto"], got["500000000"]
    assert auto["bucket"] <= auto["params"] / 4, auto
    early = [s for s in auto["starts_before_end"] if s < 0]
    assert len(early) >= 2, auto  # several buckets reduced while autograd still computes gradients
    assert whole["starts_before_end"] and min(whole["starts_before_end"]) >= 0, whole
