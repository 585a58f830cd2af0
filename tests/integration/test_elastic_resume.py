"""Elastic resume through the real deepspeed runner: a run resumes on another number of ranks and
data workers (ZeRO-2: 2 ranks x 2 workers -> 1 x 1; ZeRO-3: 1 x 1 -> 2 x 2; ZeRO-1 with a resolution
schedule and patch dropout: 2 x 1 -> 1 x 2, across a resolution switch). The recorded samples
of the interrupted epoch are each sample exactly once, the loss carries on from where it was
instead of jumping back to a fresh model's, and the LR schedule goes on down its line."""
import collections
import json
import math

import pytest
from dist_utils import metrics

pytestmark = pytest.mark.slow


def run(tiny_run, shards, ranks, workers, stage, extra=(), **env):
    job = tiny_run(f"data.workers={workers}", "data.record_samples=true", "train.log_every_steps=1",
                   "checkpoint.every_steps=3", "checkpoint.keep_last=10", f"zero.stage={stage}", "optim.lr=1e-3",
                   "optim.warmup_steps=2", "optim.schedule=linear", "optim.min_lr=7e-4",
                   "train.steps=8",  # 128 samples / 16 per step: epoch 0 ends at step 8
                   *extra, shards=shards, via="deepspeed", ranks=ranks)
    return job.run(600, **env)


# steps 1-4 at 32 px, 5-6 at 48 px (micro 4), 7-8 at 64 px: switches before the checkpoint of step 6
# and right after it, so the resumed layout starts a phase
FEWER_TOKENS = ("train.resolution_schedule=[[0,32,8],[0.5,48,4],[0.75,64]]", "model.patch_drop_rate=0.5")


@pytest.mark.parametrize("stage, before, after, extra", [(2, (2, 2), (1, 1), ()), (3, (1, 1), (2, 2), ()),
                                                         (1, (2, 1), (1, 2), FEWER_TOKENS)])
def test_resume_on_another_layout_finishes_the_epoch_with_every_sample_once(demo_shards, tiny_run, tmp_path, stage,
                                                                            before, after, extra):
    shards = demo_shards(128, 48)  # 48 + 48 + 32: reader ranges cross shards
    out = tmp_path / "run"
    r = run(tiny_run, shards, *before, stage=stage, extra=extra, VITSCALE_FAULT="crash_in_step:7")  # saved step 6
    assert r.returncode != 0 and "injected crash in step 7" in r.stderr, r.stderr[-3000:]
    first = metrics(out)
    r = run(tiny_run, shards, *after, stage=stage, extra=extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"was saved on {before[0]} rank(s), resuming on {after[0]}" in r.stderr
    assert "resuming from step 6" in r.stderr
    assert (out / "checkpoints" / "step_00000006" / "universal" / "UNIVERSAL").is_file()
    keys = collections.Counter()
    for f in (out / "samples").glob("rank-*.tsv"):
        for line in f.read_text().splitlines():
            step, epoch, key = line.split("\t")
            assert int(epoch) == 0 and 1 <= int(step) <= 8
            keys[key] += 1
    assert len(keys) == 128 and set(keys.values()) == {1}, keys.most_common(3)
    m = metrics(out)
    assert sorted(m) == list(range(1, 9))
    # the curve continues: a fresh model's zero-initialised head gives exactly ln(10) at its first step,
    # and six steps move it (by 0.0145 on half the tokens, the slowest of the three cases)
    fresh = math.log(10)
    assert first[1]["loss"] == pytest.approx(fresh, abs=1e-4) and abs(first[6]["loss"] - fresh) > 0.01, first
    if extra:  # step 7 starts 64 px on half the tokens: a noisy step after a switch, but not a fresh model's
        assert abs(m[7]["loss"] - fresh) > 1e-3, m[7]
    else:
        assert abs(m[7]["loss"] - first[6]["loss"]) < abs(m[7]["loss"] - fresh), (first[6], m[7])
    # the schedule continues: the LR each step used goes on down the same line (1e-3 to 7e-4 after
    # the 2-step warmup); a schedule restarted by the resume would start its warmup again
    fall = first[5]["lr"] - first[6]["lr"]
    assert fall > 0 and [m[s]["lr"] for s in (7, 8)] == pytest.approx([first[6]["lr"] - fall * k for k in (1, 2)]), (
        first[6], m[7], m[8])
    assert json.loads((out / "summary.json").read_text())["step"] == 8
    if extra:  # each step at its phase's resolution, on either layout
        assert [m[s]["img_size"] for s in range(1, 9)] == [32] * 4 + [48] * 2 + [64] * 2
