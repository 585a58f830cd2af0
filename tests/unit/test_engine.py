"""Training pieces as plain logic: DeepSpeed config dict, parameter groups, LR schedule, the
non-finite guard, checkpoint bookkeeping and throughput arithmetic (no process group)."""
import json

import pytest
import torch

from pretrain.checkpointing import checkpoint
from pretrain.config import ConfigError, load_config
from pretrain.distributed import rng
from pretrain.distributed.engine import deepspeed_config, param_groups
from pretrain.distributed.schedule import lr_multiplier
from pretrain.models.arch import analytic_flops
from pretrain.models.losses import classification_loss
from pretrain.models.vit import create_model
from pretrain.observability.flops import train_flops_per_image
from pretrain.observability.metrics import throughput
from pretrain.resilience.nonfinite import NonFiniteGuard, NonFiniteLoss


def loss_fn(logits, targets, multi_label, smoothing):
    return classification_loss(logits, targets, multi_label=multi_label, smoothing=smoothing)


def cfg(*overrides):
    return load_config("configs/tiny_cpu.yaml", list(overrides))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_per_stage(stage):
    precision = "fp32" if stage == 0 else "bf16"  # bf16 at stage 0 is refused (test_reduce_dtype)
    c = cfg(f"zero.stage={stage}", "train.global_batch_size=256", "train.micro_batch_size=16",
            f"train.precision={precision}", "optim.grad_clip=0.5")
    ds = deepspeed_config(c.optim, c.train, c.zero, world_size=4)
    assert ds["train_batch_size"] == 256 and ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["gradient_accumulation_steps"] == 4  # 256 / (16 x 4)
    assert ds["bf16"]["enabled"] == (precision == "bf16") and ds["gradient_clipping"] == 0.5
    z = ds["zero_optimization"]
    assert z["stage"] == stage
    assert ("overlap_comm" in z) == (stage >= 1)
    assert ("stage3_prefetch_bucket_size" in z) == (stage == 3)
    assert ("allgather_bucket_size" in z) == (stage in (1, 2))
    json.dumps(ds)  # plain data


def test_deepspeed_config_offload_and_errors():
    c = cfg("zero.stage=2", "zero.offload_optimizer=true", "optim.grad_clip=0", "train.precision=fp32")
    ds = deepspeed_config(c.optim, c.train, c.zero, world_size=2)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"]["enabled"] is False  # 0: no clipping, said explicitly
    with pytest.raises(ConfigError, match="offload_optimizer needs zero.stage >= 1"):
        c0 = cfg("zero.stage=0", "zero.offload_optimizer=true")
        deepspeed_config(c0.optim, c0.train, c0.zero, 2)
    with pytest.raises(ConfigError, match="not divisible"):
        deepspeed_config(c.optim, c.train, c.zero, world_size=3)
    c3 = cfg("zero.stage=3", "zero.offload_params=true", "train.precision=fp32")
    ds3 = deepspeed_config(c3.optim, c3.train, c3.zero, world_size=2)
    assert ds3["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in ds3["zero_optimization"]
    with pytest.raises(ConfigError, match="zero.offload_params needs zero.stage=3 .* got zero.stage=2"):
        c2 = cfg("zero.stage=2", "zero.offload_params=true")
        deepspeed_config(c2.optim, c2.train, c2.zero, 2)


def test_param_groups_exclude_bias_norm_posembed_cls_from_decay():
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"} <= nd
    assert {"blocks.0.attn.qkv.weight", "patch_embed.proj.weight", "head.weight"} <= d
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert len(d) + len(nd) == len(list(m.parameters()))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_lr_schedule_warmup_then_decay(schedule):
    c = cfg(f"optim.schedule={schedule}", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.0")
    f = lr_multiplier(c.optim.schedule, c.optim.warmup_steps, 110, c.optim.min_lr / c.optim.lr)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert f(110) == pytest.approx(0.0, abs=1e-9)
    assert f(60) == pytest.approx(0.5)  # halfway: linear 0.5, cosine 0.5 too


def test_nonfinite_guard_skips_then_stops_naming_steps():
    g = NonFiniteGuard(limit=3)
    assert g.check(True, 1) and not g.check(False, 2) and g.check(True, 3)
    assert g.total == 1
    g.check(False, 7)
    g.check(False, 8)
    with pytest.raises(NonFiniteLoss, match="3 non-finite losses in a row at steps 7-9"):
        g.check(False, 9)


def test_loss_functions():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    hard = torch.tensor([0, 1])
    assert loss_fn(logits, hard, False, 0.0) == pytest.approx(torch.nn.functional.cross_entropy(logits, hard).item())
    soft = torch.nn.functional.one_hot(hard, 3).float()
    assert loss_fn(logits, soft, False, 0.0) == pytest.approx(loss_fn(logits, hard, False, 0.0).item())
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, multi, reduction="sum") / 2
    assert loss_fn(logits, multi, True, 0.0) == pytest.approx(expected.item())


def test_checkpoint_completeness_and_pruning(tmp_path):
    for step, complete in [(2, True), (4, True), (6, True), (8, False)]:
        d = tmp_path / checkpoint.tag_for(step)
        d.mkdir()
        if complete:
            (d / checkpoint.COMPLETE).write_text("{}")
    assert checkpoint.latest_complete(tmp_path).name == "step_00000006"
    (tmp_path / "step_00000003").mkdir()  # a crash left this half-written, older than the newest
    checkpoint._prune(tmp_path, keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    # the newest incomplete one may still be in the middle of being written: kept
    assert left == ["step_00000004", "step_00000006", "step_00000008"]
    assert checkpoint.latest_complete(tmp_path / "absent") is None


def test_rng_state_round_trip():
    import random

    import numpy as np
    state = rng.rng_state()
    json.dumps(state)
    a = (random.random(), np.random.rand(), torch.rand(3))
    rng.set_rng_state(json.loads(json.dumps(state)))
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_throughput_and_mfu_numbers():
    fwd = analytic_flops("vit_large_patch16_224")
    model_f, hw_f = train_flops_per_image(fwd, analytic_flops("vit_large_patch16_224", breakdown=True)["blocks"])
    m = throughput(images=8 * 4000, elapsed=10.0, world_size=8, flops_model=model_f, flops_hw=hw_f, peak=989.4)
    assert m["images_per_sec"] == 3200 and m["images_per_sec_per_device"] == 400
    assert m["tflops_per_device"] == pytest.approx(model_f * 400 / 1e12)
    assert m["mfu"] == pytest.approx(model_f * 400 / 989.4e12) and m["hfu"] > m["mfu"]
    assert "mfu" not in throughput(100, 1.0, 1, model_f, hw_f, peak=None)


# ------------------------------------------------------------------ fused AdamW, non-finite gate
@pytest.mark.parametrize("accelerator, cuda, fused", [("cuda", True, True), ("cpu", True, False),
                                                      ("cpu", False, False), ("cuda", False, False)])
def test_fused_adamw_follows_the_accelerator_not_the_parameters(accelerator, cuda, fused):
    """The optimizer is built while the parameters are still on the CPU; DeepSpeed moves them to
    its accelerator afterwards, so the choice must come from the accelerator."""
    from pretrain.distributed.engine import use_fused_adamw

    assert use_fused_adamw(accelerator, cuda) is fused


def test_nonfinite_gate_zeroes_gradients_even_through_nan_activations():
    """NaN inputs make NaN activations: zeroing the loss would still backpropagate NaN (NaN * 0).
    The guard's hook selects zeros for every parameter's gradient instead; finite micro-batches
    pass unchanged and gradients accumulate as before."""
    model = create_model("vit_tiny_patch16_224", num_classes=10, img_size=32)
    guard = NonFiniteGuard(3, model.parameters())
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    loss_fn(model(x), y, False, 0.0).backward()
    good = {n: p.grad.clone() for n, p in model.named_parameters()}
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    loss = loss_fn(model(bad), y, False, 0.0)
    assert not torch.isfinite(loss)
    guard.ok.fill_(False)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, good[n]), n  # nothing added, no NaN
    guard.ok.fill_(True)
    guard.close()
    loss_fn(model(bad), y, False, 0.0).backward()  # without the gate: NaN everywhere
    assert not torch.isfinite(model.head.weight.grad).all()


def test_nonfinite_verdict_reads_pending_flags_in_order():
    guard = NonFiniteGuard(3)
    for step, ok in [(1, True), (2, False), (2, False), (3, True), (4, False)]:
        guard.pending.append((step, torch.tensor(ok)))
    guard.verdict()
    assert guard.total == 3 and guard.in_a_row == 1 and not guard.pending
    guard.pending += [(5, torch.tensor(False)), (6, torch.tensor(False))]
    with pytest.raises(NonFiniteLoss, match="3 non-finite losses in a row at steps 4-6"):
        guard.verdict()


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "bf16"), (2, "bf16"), (2, "fp32"), (3, "bf16")])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_every_deepspeed_default_we_rely_on_is_explicit(stage, precision, clip):
    """DeepSpeed's own parser reads our config back with the values we mean, whatever its defaults:
    a release that changes one fails here, not in a run. The defect this guards: without the key,
    DeepSpeed clips the gradient norm at 1.0, so optim.grad_clip=0 silently clipped."""
    from deepspeed.runtime.config import DeepSpeedConfig

    c = cfg(f"zero.stage={stage}", "train.global_batch_size=32", "train.micro_batch_size=16",
            f"train.precision={precision}", f"optim.grad_clip={clip}")
    ds = deepspeed_config(c.optim, c.train, c.zero, world_size=1)
    parsed = DeepSpeedConfig(json.loads(json.dumps(ds)))  # as a runner would hand it over
    assert parsed.gradient_clipping == clip
    assert parsed.prescale_gradients is False and parsed.gradient_predivide_factor == 1.0
    assert parsed.gradient_accumulation_steps == 2 and parsed.train_micro_batch_size_per_gpu == 16
    assert parsed.bfloat16_config.enabled == (precision == "bf16") and not parsed.float16_config.enabled
    assert parsed.zero_allow_untested_optimizer is True
    z = parsed.zero_config
    assert z.stage == stage
    if stage >= 1:
        assert (z.reduce_bucket_size, z.overlap_comm, z.contiguous_gradients) == (
            c.zero.reduce_bucket_size, c.zero.overlap_comm, c.zero.contiguous_gradients)
        assert z.round_robin_gradients is False and z.load_from_fp32_weights is True
    if stage in (1, 2):
        assert z.reduce_scatter is True and z.allgather_partitions is True
        assert z.allgather_bucket_size == c.zero.allgather_bucket_size and z.use_multi_rank_bucket_allreduce is True
    if stage == 3:
        assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (
            c.zero.stage3_prefetch_bucket_size, c.zero.stage3_param_persistence_threshold)
        assert z.max_live_parameters == z.max_reuse_distance == z.sub_group_size == 1_000_000_000
        assert z.gather_16bit_weights_on_model_save is False
    if precision == "bf16":  # gradients accumulated and reduced in fp32 (train.reduce_dtype)
        assert parsed.grad_accum_dtype == "fp32" and parsed.communication_data_type == torch.float32


def test_the_deepspeed_section_merges_and_contradictions_are_one_line():
    from pretrain.distributed.engine import check_with_deepspeed

    c = cfg("zero.stage=3", "optim.grad_clip=1.0", "train.precision=fp32")
    extra = {"comms_logger": {"enabled": True}, "gradient_clipping": 1.0,  # a repeat of ours is fine
             "zero_optimization": {"stage": 3, "ignore_unused_parameters": False}}  # ... and a new ZeRO key
    ds = deepspeed_config(c.optim, c.train, c.zero, 2, extra)
    assert ds["comms_logger"] == {"enabled": True} and ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["ignore_unused_parameters"] is False
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == c.zero.stage3_prefetch_bucket_size
    check_with_deepspeed(ds)  # DeepSpeed's own parser takes it
    for bad, needle in [({"zero_optimization": {"stage": 2}}, "deepspeed.zero_optimization.stage=2 contradicts 3, "
                                                               "which vitscale sets from zero.stage: change that instead"),
                        ({"bf16": {"enabled": True}}, "sets from train.precision"),
                        ({"optimizer": {"type": "Adam"}}, "deepspeed.optimizer: vitscale builds the optimizer itself"),
                        ({"zero_optimization": {"stage3_max_live_parameters": 5}},
                         "stage3_max_live_parameters=5 contradicts 1000000000, which vitscale sets itself")]:
        with pytest.raises(ConfigError) as e:
            deepspeed_config(c.optim, c.train, c.zero, 2, bad)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:  # DeepSpeed's parser: an unknown ZeRO key
        check_with_deepspeed(deepspeed_config(c.optim, c.train, c.zero, 2, {"zero_optimization": {"stag3": 1}}))
    msg = str(e.value)
    assert msg.startswith("deepspeed: DeepSpeed refuses the merged config:") and "stag3" in msg and "\n" not in msg, msg
