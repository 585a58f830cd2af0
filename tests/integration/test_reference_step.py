"""Optimizer steps of our training engine against plain PyTorch on the same global batches: an
outside reference (written in tests/jobs/clip_reference_job.py from the algorithm), so a DeepSpeed
default that changes under us fails here, not in a run. All cases run in one 2-rank job."""
import json

import pytest

from dist_utils import deepspeed_cmd, run_job

pytestmark = pytest.mark.slow

# name -> what differs from one fp32 SGD step at ZeRO-3 without clipping, constant LR (the job's DEFAULTS);
# weight decay only on weight matrices (not biases, norms, position embedding, [class] token)
CASES = {
    "z3-ckpt-clip0": dict(ckpt=True, clip=0.0),  # 0 must not clip: DeepSpeed clips at 1.0 when its key is absent
    "z3-ckpt-clip0.5": dict(ckpt=True, clip=0.5),  # clips as torch's clip_grad_norm_ does
    # with warmup, then linear / cosine decay to a floor: the LR of every step against torch's schedulers
    "z0-sgd-momentum-linear-4steps": dict(stage=0, momentum=0.9, steps=4, clip=1.0, wd=0.05,
                                          schedule="linear", warmup=2, min_ratio=0.1),
    "z1-adamw-cosine-5steps": dict(stage=1, optim="adamw", steps=5, clip=1.0, wd=0.05,  # moments, bias correction
                                   schedule="cosine", warmup=2, min_ratio=0.1),
    "z2-adamw-accumulate2": dict(stage=2, optim="adamw", steps=2, gas=2, clip=1.0, wd=0.05),
    "z3-adamw-ckpt-accumulate2": dict(optim="adamw", steps=2, gas=2, ckpt=True, clip=1.0, wd=0.05),
    "z3-adamw-offload-params-2steps": dict(optim="adamw", steps=2, offload_params=True, clip=1.0, wd=0.05),
    "z1-bf16-sgd": dict(stage=1, precision="bf16", clip=1.0),
    # the losses users choose: label smoothing, and sigmoid targets summed over classes (ImageNet-21k, JFT)
    "z2-sgd-smoothing0.1": dict(stage=2, smoothing=0.1, clip=1.0),
    # (SGD: AdamW's per-element scaling turns the last-bit difference between two correct sigmoid
    # cross-entropy formulas, torch's and the reference's, into 2x the reference's own noise)
    "z1-sgd-multilabel-2steps": dict(stage=1, momentum=0.9, steps=2, multi_label=True, clip=1.0, wd=0.05),
}
FP32_BOUND = 1e-5  # relative error of the whole update: reduction order only
# AdamW divides each element by the root of its own squared-gradient average, so rounding in a tiny
# gradient becomes a full-sized difference in its update: the reference itself, summed over our
# micro-batches instead of the whole batch, drifts 4e-5 to 8e-5 from the whole-batch reference. Our
# error may be what the reference's own noise is, twice over.
NOISE_FACTOR = 2.0
# bf16: DeepSpeed runs the whole model in bf16 (8 significant bits: 2**-8 = 3.9e-3 per rounding),
# forward and backward, against an fp32 reference; the errors add up over 12 blocks. Measured:
# 2.4e-2 relative, cosine 0.99971.
BF16_BOUND, BF16_COSINE = 5e-2, 0.999


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "steps.json"
    r = run_job(deepspeed_cmd("tests.jobs.clip_reference_job", str(out), json.dumps(CASES)), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_steps_equal_plain_pytorch(steps, case):
    got = steps[case]
    clip = CASES[case].get("clip", 0.0)
    if clip:
        assert got["reference_grad_norm"] > clip, got  # the clip changes the step: it is tested too
    if CASES[case].get("precision") == "bf16":
        assert got["relative_error"] <= BF16_BOUND and got["cosine"] >= BF16_COSINE, got
    else:
        assert got["relative_error"] <= max(FP32_BOUND, NOISE_FACTOR * got["reference_noise"]), got
        assert got["masters_start_offset"] == 0.0, got  # fp32: DeepSpeed trains the given weights


def test_no_clip_would_have_been_seen(steps):
    """The first gradient is far above 1.0, so an unwanted clip at DeepSpeed's default changes the step."""
    assert steps["z3-ckpt-clip0"]["reference_grad_norm"] > 2.0


def test_bf16_masters_start_from_the_rounded_module(steps):
    """What DeepSpeed does in bf16: its fp32 masters are made from the bf16 module, so they start
    off the given fp32 weights by more than one SGD step at lr 0.1. Harmless for a random
    initialisation; for ``model.init_from`` training sets them from the file's fp32 values
    (tests/unit/test_init_from.py). Pinned so that a change in DeepSpeed is seen."""
    assert steps["z1-bf16-sgd"]["masters_start_offset"] > 0.5
