"""An elastic resume continues the plain-PyTorch trajectory. vit-train through the deepspeed runner
on 2 ranks, from a known timm file (``model.init_from``), runs AdamW steps (weight decay on weight
matrices, clipping, warmup then cosine decay), checkpoints at step N and fails in step N + 1; the
same run resumes on 1 rank (DeepSpeed universal checkpointing, two micro-batches a step) and
finishes step N + K. Its weights then equal timm's model trained by ``torch.optim.AdamW``,
``clip_grad_norm_`` and torch's schedulers for all N + K steps on the samples the runs recorded,
read back by key from the tar shards: the Adam moments, bias correction's step count and the
schedule's position must all carry over the resume. Its EMA of the weights (train.ema_decay with
warmup, kept as each rank's pieces and loaded into the one rank's) equals timm's ``ModelEmaV3``
stepped on that reference."""
import pytest
import torch
from dist_utils import TINY_MODEL
from reference_utils import (
    FIXED_CROP,
    FP32_BOUND,
    NOISE_FACTOR,
    decay_groups,
    read_back,
    recorded_steps,
    reference_schedule,
    timm_model,
    timm_start,
    train_reference,
    update_error,
)

pytestmark = pytest.mark.slow

N, K, BATCH, MICRO = 3, 2, 16, 8
LR, WD, WARMUP, MIN_RATIO, CLIP, EMA = 1e-3, 0.05, 2, 0.1, 0.25, 0.8  # test_vit's norms: 0.4-0.6


def reference(start: dict, batches: list, split: int = 0, lose_moments_at: int = 0,
              arch: dict | None = None) -> tuple[dict, list[float], dict]:
    """timm's model (``arch``: its options) from ``start`` after AdamW steps on ``batches``: the weights,
    the gradient norms and timm's ModelEmaV3 of the steps. ``lose_moments_at``: Adam's state dropped
    after that many steps, as a resume that lost it would."""
    from timm.utils.model_ema import ModelEmaV3

    model = timm_model(start, TINY_MODEL, **(arch or {}))
    ema = ModelEmaV3(model, decay=EMA, use_warmup=True)
    opt = torch.optim.AdamW(decay_groups(model, WD), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = reference_schedule(opt, WARMUP, N + K, "cosine", MIN_RATIO)
    cut = lose_moments_at or len(batches)
    norms = train_reference(model, opt, sched, batches[:cut], clip=CLIP, split=split,
                            after_step=lambda t: ema.update(model, step=t))
    opt.state.clear()
    norms += train_reference(model, opt, sched, batches[cut:], clip=CLIP, split=split,
                             after_step=lambda t: ema.update(model, step=cut + t))
    return ({n: p.detach() for n, p in model.named_parameters()}, norms,
            {n: p.detach() for n, p in ema.module.named_parameters()})


# ZeRO-3: the universal loader with the most repairs (elastic.py); with registers and the MAP head, whose
# tensors (reg_token, attn_pool.*) ZeRO-3 partitions and the universal checkpoint carries like any other
# (a superset of the plain model's: the plain ViT's elastic ZeRO-3 resume is in test_elastic_ckpt.py too)
@pytest.mark.parametrize("stage, arch", [(3, dict(reg_tokens=4, global_pool="map"))], ids=["z3-reg4-map"])
def test_an_elastic_resume_from_2_ranks_to_1_continues_the_plain_pytorch_trajectory(tiny_run, shards, tmp_path,
                                                                                     stage, arch):
    from pretrain.weights.export import load_run_weights

    init = tmp_path / "start.safetensors"
    start = timm_start(init, TINY_MODEL, **arch)
    common = (f"model.init_from={init}", *(f"model.{k}={v}" for k, v in arch.items()), f"train.steps={N + K}",
              "optim.name=adamw", f"optim.lr={LR}",
              "optim.betas=[0.9,0.999]", "optim.eps=1e-8", f"optim.weight_decay={WD}", f"optim.grad_clip={CLIP}",
              f"optim.warmup_steps={WARMUP}", "optim.schedule=cosine", f"optim.min_lr={MIN_RATIO * LR}",
              "optim.label_smoothing=0.0", *FIXED_CROP, "data.record_samples=true", f"train.global_batch_size={BATCH}",
              f"train.micro_batch_size={MICRO}", f"checkpoint.every_steps={N}", f"zero.stage={stage}",
              "train.precision=fp32", f"train.ema_decay={EMA}", "train.ema_warmup=true")
    r = tiny_run(*common, via="deepspeed", ranks=2).run(300, VITSCALE_FAULT=f"crash_in_step:{N + 1}")
    assert r.returncode != 0 and f"injected crash in step {N + 1}" in r.stderr, r.stderr[-3000:]
    r = tiny_run(*common, via="deepspeed", ranks=1).run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was saved on 2 rank(s), resuming on 1" in r.stderr, r.stderr[-3000:]
    assert f"resuming from step {N}" in r.stderr, r.stderr[-3000:]

    steps = recorded_steps(tmp_path / "run")  # each step's keys: rank 0's then rank 1's, or rank 0's two micro-batches
    assert sorted(steps) == list(range(1, N + K + 1)) and {len(k) for k in steps.values()} == {BATCH}, steps
    images, labels = read_back(shards, [k for t in sorted(steps) for k in steps[t]], 64)
    batches = [(images[i:i + BATCH], labels[i:i + BATCH]) for i in range(0, len(images), BATCH)]
    ref, norms, ref_ema = reference(start, batches, arch=arch)
    assert min(norms) > CLIP, norms  # every step is clipped: the clip is tested too
    # The reference's own noise (reference_utils.NOISE_FACTOR): the same steps summed over our micro-batches,
    # on the pixels normalised by another exact formula. Our loader rounds its normalisation otherwise than
    # read_back (up to 1 ulp a pixel), and AdamW's per-element scaling makes that as large as the reduction
    # order: either alone moves the reference by about our error, and ours is as close to the fp64 run as both.
    pixels = torch.round((images * 0.5 + 0.5) * 255)
    other = [((pixels[i:i + BATCH] - 127.5) / 127.5, labels[i:i + BATCH]) for i in range(0, len(images), BATCH)]
    twin, _, twin_ema = reference(start, other, split=MICRO, arch=arch)

    ours, info = load_run_weights(tmp_path / "run")
    assert info["step"] == N + K
    error, _ = update_error(start, ours, ref)
    noise, _ = update_error(start, twin, ref)
    assert error <= max(FP32_BOUND, NOISE_FACTOR * noise), (error, noise)
    # what the check can see: a resume that kept the weights and the schedule but lost Adam's state
    lost, _ = update_error(start, reference(start, batches, lose_moments_at=N, arch=arch)[0], ref)
    assert lost > 10 * max(FP32_BOUND, NOISE_FACTOR * noise), (lost, noise)
    # the EMA: exported from the pieces the 1-rank run saved (it loaded the 2 ranks' pieces at the resume)
    ours_ema, _ = load_run_weights(tmp_path / "run", ema=True)
    ema_error, _ = update_error(start, ours_ema, ref_ema)
    ema_noise, _ = update_error(start, twin_ema, ref_ema)
    assert ema_error <= max(FP32_BOUND, NOISE_FACTOR * max(noise, ema_noise)), (ema_error, ema_noise, noise)
    print(f"elastic 2 -> 1 rank, ZeRO-{stage} {arch or ''}, {N} + {K} AdamW steps: relative error {error:.2g} "
          f"(reference noise {noise:.2g}; moments lost at the resume: {lost:.2g}); EMA {ema_error:.2g}")
