"""Training pieces as plain logic: DeepSpeed config dict, parameter groups, LR schedule, the
non-finite guard, checkpoint bookkeeping and throughput arithmetic (no process group)."""
import dataclasses
import json

import pytest
import torch

from pretrain.checkpointing import checkpoint
from pretrain.config import ConfigError, load_config
from pretrain.distributed import rng
from pretrain.distributed.engine import LEAF_BLOCK_CLASS, deepspeed_config, param_groups
from pretrain.distributed.schedule import lr_multiplier
from pretrain.models.arch import analytic_flops
from pretrain.models.losses import classification_loss
from pretrain.models.vit import create_model
from pretrain.observability.flops import train_flops_per_image
from pretrain.observability.metrics import throughput
from pretrain.perf import levers
from pretrain.resilience.nonfinite import NonFiniteGuard, NonFiniteLoss


def loss_fn(logits, targets, multi_label, smoothing):
    return classification_loss(logits, targets, multi_label=multi_label, smoothing=smoothing)


def cfg(*overrides):
    """The tiny config with its `auto` levers decided as a CPU rank decides them."""
    return levers.resolve(load_config("configs/tiny_cpu.yaml", list(overrides)), 1)[0]


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
    with pytest.raises(ConfigError, match="offload_optimizer needs zero.stage >= 1"):  # load refuses it too
        deepspeed_config(c.optim, c.train, dataclasses.replace(c.zero, stage=0), 2)
    with pytest.raises(ConfigError, match="not divisible"):
        deepspeed_config(c.optim, c.train, c.zero, world_size=3)
    c3 = cfg("zero.stage=3", "zero.offload_params=true", "train.precision=fp32")
    ds3 = deepspeed_config(c3.optim, c3.train, c3.zero, world_size=2)
    assert ds3["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in ds3["zero_optimization"]
    with pytest.raises(ConfigError, match="zero.offload_params needs zero.stage=3 .* got zero.stage=2"):
        deepspeed_config(c3.optim, c3.train, dataclasses.replace(c3.zero, stage=2), 2)


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


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_schedule_warmup_then_decay(schedule):
    """Every step's factor equals torch's own schedulers (LinearLR warmup, then LinearLR or
    CosineAnnealingLR down to optim.min_lr, or held) on the config's values."""
    from reference_utils import reference_schedule

    c = cfg(f"optim.schedule={schedule}", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1")
    f = lr_multiplier(c.optim.schedule, c.optim.warmup_steps, 110, c.optim.min_lr / c.optim.lr)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=c.optim.lr)
    sched = reference_schedule(opt, c.optim.warmup_steps, 110, schedule, c.optim.min_lr / c.optim.lr)
    for step in range(121):  # past the end: held at the floor
        if step <= 110:
            assert f(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        else:
            assert f(step) == f(110), step
        opt.step()  # (no gradient: nothing moves)
        sched.step()
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(110) == pytest.approx(1.0 if schedule == "constant" else 0.1)


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


def test_zero3_leaf_modules_name_our_block_class_unless_turned_off():
    """DeepSpeed finds leaf modules by the class path written into its config: it must be the class
    our models build their blocks from (a rename fails here, not as silently per-module hooks). The
    config alone makes them leaves, compiled blocks included (``compile_blocks`` flags nothing):
    DeepSpeed's own parser and the function ``deepspeed.initialize`` applies it with
    (``apply_zero_leaf_module_config``, before it installs its ZeRO-3 hooks) flag the 12 blocks of a
    real model."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config, z3_leaf_module

    from pretrain.models.layers import Block

    assert LEAF_BLOCK_CLASS == f"{Block.__module__}.{Block.__qualname__}"
    for over, want in ((["zero.leaf_blocks=false"], []), (["zero.leaf_blocks=false", "train.compile=true"],
                                                          [LEAF_BLOCK_CLASS]), ([], [LEAF_BLOCK_CLASS])):
        c = cfg("zero.stage=3", *over)
        ds = deepspeed_config(c.optim, c.train, c.zero, 1)
        assert ds["zero_optimization"]["leaf_module"]["classes"] == want
        model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
        apply_zero_leaf_module_config(model, DeepSpeedConfig(json.loads(json.dumps(ds))).zero_config.leaf_module)
        leaves = [m for m in model.modules() if z3_leaf_module(m)]
        assert leaves == (list(model.blocks) if want else []), over
    c = cfg("zero.stage=2")
    assert "leaf_module" not in deepspeed_config(c.optim, c.train, c.zero, 1)["zero_optimization"]


@pytest.mark.parametrize("stage,precision,reduce", [
    (0, "fp32", "fp32"), (2, "fp32", "fp32"), (1, "bf16", "fp32"), (2, "bf16", "fp32"), (3, "bf16", "fp32"),
    (3, "bf16", "bf16"), (0, "bf16-autocast", "fp32"), (1, "bf16-autocast", "fp32"), (3, "bf16-autocast", "fp32"),
    (3, "bf16-autocast", "bf16"), (1, "fp16", "fp32"), (3, "fp16", "fp32")])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_every_deepspeed_default_we_rely_on_is_explicit(stage, precision, reduce, clip):
    """DeepSpeed's own parser reads our config back with the values we mean, whatever its defaults:
    a release that changes one fails here, not in a run. The defect this guards: without the key,
    DeepSpeed clips the gradient norm at 1.0, so optim.grad_clip=0 silently clipped. Also the
    precision modes: bf16's overflow check, autocast's module list (DeepSpeed's default list would
    reduce the weight matrices' gradients in bf16), fp16's loss scaling."""
    from deepspeed.runtime.config import DeepSpeedConfig

    c = cfg(f"zero.stage={stage}", "train.global_batch_size=32", "train.micro_batch_size=16",
            f"train.precision={precision}", f"train.reduce_dtype={reduce}", f"optim.grad_clip={clip}")
    ds = deepspeed_config(c.optim, c.train, c.zero, world_size=1)
    parsed = DeepSpeedConfig(json.loads(json.dumps(ds)))  # as a runner would hand it over
    assert parsed.gradient_clipping == clip
    assert parsed.prescale_gradients is False and parsed.gradient_predivide_factor == 1.0
    assert parsed.gradient_accumulation_steps == 2 and parsed.train_micro_batch_size_per_gpu == 16
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
        assert z.module_granularity_threshold == 0  # DeepSpeed's own leaf choice stays off
        assert z.leaf_module.classes == [LEAF_BLOCK_CLASS]
        assert (z.leaf_module.names, z.leaf_module.name_suffixes) == ([], [])

    # precision: exactly one mode on, gradients accumulated in fp32 unless bf16 is told otherwise
    bf16, fp16 = parsed.bfloat16_config, parsed.float16_config
    assert (bf16.enabled, parsed.torch_autocast_enabled, fp16.enabled) == (
        precision == "bf16", precision == "bf16-autocast", precision == "fp16")
    wire = torch.bfloat16 if reduce == "bf16" else torch.float32
    assert parsed.communication_data_type == wire
    assert parsed.grad_accum_dtype == ("bf16" if precision == "bf16" and reduce == "bf16" else "fp32")
    if precision == "bf16-autocast":
        assert parsed.torch_autocast_dtype == torch.bfloat16
        assert parsed.torch_autocast_lower_precision_safe_modules == (
            ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv2d"] if reduce == "bf16" else [])
    if precision == "bf16":
        assert (bf16.check_grad_overflow, bf16.immediate_grad_update, bf16.bf16_master_weights_and_grads,
                bf16.bf16_optimizer_states) == (False, False, False, False)
    if precision == "fp16":  # dynamic loss scaling from 2**16, x2 after 1000 clean steps, /2 on the 2nd overflow
        assert fp16.loss_scale == 0 and fp16.auto_cast is False and fp16.fp16_master_weights_and_grads is False
        assert fp16.dynamic_loss_scale_args() == {"init_scale": 2 ** 16, "scale_window": 1000, "delayed_shift": 2,
                                                  "consecutive_hysteresis": False, "min_scale": 1}


@pytest.mark.parametrize("overrides, words", [
    (["train.precision=bf16", "zero.stage=0"], "zero.stage=0 with train.precision=bf16"),
    (["train.precision=fp16", "zero.stage=0"], "zero.stage=0 with train.precision=fp16"),
    (["train.precision=fp16", "train.reduce_dtype=bf16"], "train.reduce_dtype=bf16 with train.precision=fp16"),
    (["train.precision=bf16-autocast", "zero.stage=3", "zero.quantized_weights=true"],
     "zero.quantized_weights=true with train.precision=bf16-autocast"),
])
def test_precision_combinations_deepspeed_cannot_run_are_one_line(overrides, words):
    c = cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        deepspeed_config(c.optim, c.train, c.zero, world_size=2)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast", "fp16"])
def test_precision_is_refused_in_one_line_where_deepspeed_cannot_compute_it(precision):
    """DeepSpeed's CPU accelerator has fp16 only where oneDNN does (AVX-512 FP16 / AMX-FP16); its
    engine would raise deep inside ``deepspeed.initialize``."""
    from deepspeed.accelerator import get_accelerator

    from pretrain.distributed.precision import check_precision

    acc = get_accelerator()
    able = {"fp32": True, "bf16": acc.is_bf16_supported(), "bf16-autocast": acc.is_bf16_supported(),
            "fp16": bool(acc.is_fp16_supported())}[precision]
    if able:
        check_precision(precision)
        return
    with pytest.raises(ConfigError, match=f"train.precision={precision}: this .* does not support"):
        check_precision(precision)


def test_fp16_overflow_is_the_loss_scalers_and_a_nonfinite_loss_the_guards():
    """Under fp16 the guard and DeepSpeed's loss scaler act on different signals and do not undo
    each other. A finite loss whose scaled gradients overflow: the guard passes the gradients on and
    counts nothing; DeepSpeed's overflow check (``has_inf_or_nan``, what its ZeRO optimizers call
    on the gradients) sees the inf, so the scaler skips the step and lowers the scale. A non-finite
    loss: the guard zeroes the gradients and counts it; the overflow check sees nothing, so the
    scaler keeps its scale (a forward overflow is not cured by a smaller loss scale)."""
    from deepspeed.runtime.fp16.loss_scaler import has_inf_or_nan

    from pretrain.distributed.engine import FP16_LOSS_SCALING

    scale = 2.0 ** FP16_LOSS_SCALING["initial_scale_power"]
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    guard = NonFiniteGuard(3, [w])
    loss = (w * 2.0).sum().float()  # finite: 8
    assert torch.isfinite(loss) and guard.check(True, 1)
    (loss * scale).backward()  # d/dw = 2 x 65536 > 65504: inf in fp16
    assert has_inf_or_nan(w.grad) and guard.total == 0
    w.grad = None
    x = (w * float("inf")).sum().float()
    bad = x - x  # NaN: an overflow of the forward
    guard.ok.fill_(False)
    (bad * scale).backward()
    assert not has_inf_or_nan(w.grad) and torch.equal(w.grad, torch.zeros_like(w.grad))
    assert not guard.check(False, 2) and guard.total == 1
    guard.close()


def test_the_loss_scalers_floor_is_a_one_line_error():
    """DeepSpeed's scaler raises a bare Exception when fp16 gradients overflow at its minimum scale;
    training reports it as a NonFiniteLoss naming the step (exit 2, one line). DeepSpeed's own
    scaler raises it here; other exceptions pass unchanged."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from pretrain.resilience.nonfinite import scale_floor_as_error

    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    with pytest.raises(NonFiniteLoss, match="fp16 gradients overflow at the smallest loss scale at step 7"):
        with scale_floor_as_error(7):
            scaler.update_scale(True)
    with pytest.raises(ValueError, match="other"):
        with scale_floor_as_error(7):
            raise ValueError("other")


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
    for bad, needle in [({"zero_optimization": {"stage": 2}},
                         "deepspeed.zero_optimization.stage=2 contradicts 3, "
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


def test_selective_checkpointing_keeps_torch_s_own_linear():
    """DeepSpeed's ZeRO-3 memory-efficient F.linear adds the bias into the matmul's output in place,
    the output op-level checkpointing keeps: with it the recompute adds the bias twice and the
    gradients are not the model's. The ZeRO-3 config turns it off under `selective`, and one an
    earlier engine of the process left installed is put back before the engine is built."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from pretrain.distributed.engine import plain_linear_for_selective

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=4, img_size=32, depth=2)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)  # every layer with a gradient
        for blk in model.blocks:  # biases away from their zero start (a second step's)
            for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2):
                lin.bias.normal_(0, 0.1)
    x = torch.randn(2, 3, 32, 32)

    def grads(ckpt):
        model.zero_grad()
        model.set_grad_checkpointing(ckpt)
        model(x).square().sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    plain = grads(False)
    own = F.linear
    try:
        F.linear = zero3_linear_wrap
        assert not torch.allclose(grads("selective"), plain, rtol=1e-3)  # the hazard
        plain_linear_for_selective(True)  # whole blocks: nothing cached, left alone
        assert F.linear is zero3_linear_wrap
        plain_linear_for_selective("selective")
        assert F.linear is torch._C._nn.linear
        torch.testing.assert_close(grads("selective"), plain, rtol=1e-6, atol=1e-7)
    finally:
        F.linear = own
    c = cfg("zero.stage=3", "train.activation_checkpointing=selective")
    assert deepspeed_config(c.optim, c.train, c.zero, 1)["zero_optimization"]["memory_efficient_linear"] is False
