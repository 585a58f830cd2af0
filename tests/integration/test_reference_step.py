"""One optimizer step of our training engine against plain PyTorch on the same global batch: an
outside reference, so a DeepSpeed default that changes under us fails here, not in a run."""
import json

import pytest

from dist_utils import deepspeed_cmd, run_job

pytestmark = pytest.mark.slow


def test_sgd_step_equals_plain_pytorch_with_and_without_clipping(tmp_path):
    """ZeRO-3 + activation checkpointing on 2 ranks, fp32. grad_clip 0 must not clip (DeepSpeed
    clips at 1.0 when its key is absent); grad_clip 0.5 clips as torch's clip_grad_norm_ does."""
    out = tmp_path / "steps.json"
    r = run_job(deepspeed_cmd("tests.jobs.clip_reference_job", str(out), "0.0", "0.5"), timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for clip, case in res.items():
        assert case["reference_grad_norm"] > 2.0, case  # a clip at 1.0 or 0.5 changes the step
        assert case["relative_error"] <= 1e-5, (clip, case)
