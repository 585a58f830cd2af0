"""vit-launch plan's answers are possible ones: a property test over a grid of layouts, micro batches
ranked as GEMM shapes and kernel launches rank them, the kernel counts and the GEMM curve against
their references (our model's own kernels, XLA's measured H100 GEMMs), and impossible inputs refused
in one line (exit 2) naming the flag."""
import collections
import itertools
import json
from dataclasses import replace

import pytest

from launch.cli import main
from pretrain.perf import inputs, kernels
from pretrain.perf.perfmodel import Layout, predict

MODELS = ("vit_base_patch16_224", "vit_large_patch16_224", "vit_huge_patch14_224")


def grid():
    for model, zero, nodes, micro, ckpt in itertools.product(MODELS, (1, 2, 3), (1, 4, 32), (1, 8, 64),
                                                            (False, True)):
        for hpz, qw in ([(1, False), (8, False), (1, True)] if zero == 3 else [(1, False)]):
            yield Layout(model=model, gpu="h100-sxm", nodes=nodes, gpus_per_node=8, micro_batch=micro, zero=zero,
                         checkpointing=ckpt, hpz_partition_size=hpz, quantized_weights=qw)


def test_every_layout_of_the_grid_has_a_possible_prediction():
    seen = 0
    for lay in grid():
        p = predict(lay)
        where = (lay.model, lay.zero, lay.nodes, lay.micro_batch, lay.checkpointing, lay.hpz_partition_size,
                 lay.quantized_weights)
        assert 0 <= p.exposed_comm_seconds <= p.comm_seconds + 1e-12, (where, p.exposed_comm_seconds, p.comm_seconds)
        assert p.images_per_second > 0 and p.step_seconds > 0, where
        assert 0 < p.mfu <= p.hfu <= 1, (where, p.mfu, p.hfu)
        assert all(v >= 0 for v in p.memory_gb_per_gpu.values()), (where, p.memory_gb_per_gpu)
        assert p.step_seconds >= p.compute_seconds >= p.launch_seconds >= 0, where
        assert 0 < p.images_per_second <= p.input_images_per_second + 1e-6, where  # never faster than its loaders
        assert (p.zero3_hook_seconds > 0) == (lay.zero == 3) and p.zero3_hook_seconds <= p.compute_seconds, where
        seen += 1
    assert seen == 3 * 3 * 3 * 2 * (1 + 1 + 3)  # models x nodes x micro batches x checkpointing x (stage 1, 2, 3 x 3)


@pytest.mark.parametrize("model", MODELS)
def test_at_a_fixed_global_batch_small_micro_batches_lose_and_large_ones_plateau(model):
    """Same global batch, same GPUs: 8 images per micro-step run small GEMMs and issue as many kernels
    per micro-step as 128 do, so they must be slower; from 64 to 128 little is left to win, except
    under ZeRO-3, whose host hooks cost the same per micro-step whatever its size."""
    for zero, nodes in itertools.product((1, 2, 3), (1, 4)):
        ips = {mb: predict(Layout(model=model, gpu="h100-sxm", nodes=nodes, micro_batch=mb, global_batch=4096,
                                  zero=zero)).images_per_second for mb in (8, 16, 32, 64, 128)}
        where = (model, zero, nodes, {k: round(v) for k, v in ips.items()})
        assert ips[8] < 0.9 * ips[32], where
        assert all(ips[a] <= ips[b] for a, b in itertools.pairwise(sorted(ips))), where
        if zero < 3:
            assert ips[128] < 1.1 * ips[64], where


def test_a_narrow_model_at_small_micro_batches_waits_for_kernel_launches():
    small = predict(Layout(model="vit_tiny_patch16_224", gpu="h100-sxm", micro_batch=8))
    assert small.launch_seconds > 0 and small.bottleneck.startswith("kernel launches"), small.bottleneck
    assert predict(Layout(model="vit_tiny_patch16_224", gpu="h100-sxm", micro_batch=256)).launch_seconds == 0


def _kernels_of_a_training_step(checkpointing: bool, autocast: bool, **model_kw) -> collections.Counter:
    """Kernels (aten ops that are not views) of one forward + backward of our ViT-Ti/16, read with a
    dispatch mode on CPU: the second step, when every parameter's gradient is accumulated."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.models.vit import create_model

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, **model_kw)
    model.set_grad_checkpointing(checkpointing)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    step()
    with Count() as c:
        step()
    return c.ops


@pytest.mark.parametrize("checkpointing, autocast", [(False, False), (True, False), (False, True), (True, True),
                                                     ("selective", False), ("selective", True)])
def test_kernel_counts_are_those_our_model_issues(checkpointing, autocast):
    ops = _kernels_of_a_training_step(checkpointing, autocast)
    want = kernels.kernels_per_micro_step(12, checkpointing, autocast=autocast)
    assert sum(ops.values()) == want["total"], (sorted(ops.items()), want)
    gemms = ops["mm"] + ops["addmm"] + ops["convolution"] + ops["convolution_backward"]
    attention = sum(v for k, v in ops.items() if "scaled_dot_product" in k)
    assert (gemms, attention) == (want["gemm"], want["attention"]), (sorted(ops.items()), want)


def test_dropout_and_stochastic_depth_kernels_are_those_our_model_issues():
    """Eager, without checkpointing. Stochastic depth: the mask's draw and scaling and the product
    forward, the product backward, in each block after the first (its rate rises from 0), as on
    CPU. Dropout: CPU decomposes each forward into a draw, a scaling and a product (CUDA's fused
    native_dropout is one kernel) and the backward into one product: one kernel forward and one
    backward per site on the GPU, i.e. one per product counted here."""
    base = _kernels_of_a_training_step(False, False)
    path = _kernels_of_a_training_step(False, False, drop_path_rate=0.1)
    extra = {k: path[k] - base[k] for k in path if path[k] != base[k] and k != "new_empty"}  # an allocation
    assert sum(extra.values()) == kernels.dropout_kernels(12, 0, False, 11), extra
    drop = _kernels_of_a_training_step(False, False, drop_rate=0.1)
    assert drop["bernoulli_"] == 12 * kernels.DROPOUT_SITES["block"] + kernels.DROPOUT_SITES["other"]
    assert drop["mul"] - base["mul"] == kernels.dropout_kernels(12, 0, True, 0)
    eager = kernels.kernels_per_micro_step(12, dropout=True, drop_path_blocks=11)
    assert eager["total"] - kernels.kernels_per_micro_step(12)["total"] == kernels.dropout_kernels(12, 0, True, 11)
    assert kernels.kernels_per_micro_step(12, compile="model", dropout=True, drop_path_blocks=11) == \
        kernels.kernels_per_micro_step(12, compile="model")  # fused into their neighbours


def test_selective_checkpointing_sits_between_none_and_whole_blocks():
    """Op by op, ViT-L/16 keeps about 70 % of its activations and repeats no matmul: faster than
    recomputing whole blocks, slower than none (its element-wise work runs again), MFU = HFU."""
    base = Layout("vit_large_patch16_224", "h100-sxm", gpus_per_node=1, micro_batch=128, num_classes=21843)
    none, op_level, whole = (predict(replace(base, checkpointing=c)) for c in (False, "selective", True))
    assert whole.images_per_second < op_level.images_per_second < none.images_per_second
    assert op_level.hfu == pytest.approx(op_level.mfu) and whole.hfu > whole.mfu
    acts = [p.memory_gb_per_gpu["activations"] for p in (whole, op_level, none)]
    assert acts[0] < acts[1] < acts[2] and acts[1] / acts[2] == pytest.approx(0.7, abs=0.05)
    assert op_level.elementwise_seconds > none.elementwise_seconds
    assert op_level.kernels_per_step - none.kernels_per_step == 24 * kernels.RECOMPUTE_KERNELS["elementwise"]


def test_zero2_gradient_hooks_cost_the_host_once_per_parameter_tensor():
    """DeepSpeed's ZeRO-2 hook per parameter tensor (benchmarks/engine_host.py) is host time: it
    lengthens a micro-step only where the host is the bound (a narrow model, one image)."""
    from pretrain.models.vit import create_model
    from pretrain.perf.compute import compute_seconds

    tensors = kernels.kernels_per_micro_step(12)["accumulate"]
    assert tensors == sum(1 for _ in create_model("vit_tiny_patch16_224").parameters())
    tiny = Layout("vit_tiny_patch16_224", "h100-sxm", gpus_per_node=1, micro_batch=1, zero=1)
    one, two = compute_seconds(tiny, 1), compute_seconds(replace(tiny, zero=2), 1)
    hook = kernels.ENGINE_HOOK_SECONDS
    assert two["host"] - one["host"] == pytest.approx(tensors * (hook[("bf16", 2)] - hook[("bf16", 1)]))
    assert two["total"] > one["total"] and two["host"] > two["gpu"]
    large = Layout("vit_large_patch16_224", "h100-sxm", gpus_per_node=1, micro_batch=64, zero=1)
    assert compute_seconds(replace(large, zero=2), 64)["total"] == compute_seconds(large, 64)["total"]


# XLA's default matmul table, measured bf16 GEMMs on H100 (openxla/xla,
# xla/service/gpu/model/matmul_interpolator_data.h, sm_90, batch 1): (m, n, k) -> TFLOP/s
XLA_H100 = {(256, 256, 512): 11.46, (512, 512, 512): 40.72, (1024, 1024, 512): 145.57, (256, 4096, 1024): 225.20,
            (2048, 256, 1024): 135.85, (1024, 2048, 2048): 524.29, (4096, 512, 1024): 370.77,
            (2048, 4096, 1024): 594.21, (4096, 1024, 4096): 738.47, (4096, 4096, 4096): 783.33}


def test_gemm_curve_follows_xlas_measured_h100_table():
    """The shape curve the model prices every GEMM with, at cuBLAS's own asymptote, against XLA's
    measurements from the smallest (5.9 us, 1 % of peak) to the largest (79 % of peak)."""
    for (m, n, k), tflops in XLA_H100.items():
        t = kernels.gemm_seconds(m, n, k, 989.4e12, kernels.CUBLAS_EFFICIENCY, 132)
        assert 2 * m * n * k / t / 1e12 == pytest.approx(tflops, rel=0.12), (m, n, k)


def test_zero3_exposed_communication_stays_within_its_collectives():
    """The layout a user reported: ViT-L/16 on 64 H100 with hpZ 8 showed 14.6 ms exposed of 5.4."""
    p = predict(Layout(model="vit_large_patch16_224", gpu="h100-sxm", nodes=8, gpus_per_node=8, micro_batch=32,
                       zero=3, hpz_partition_size=8))
    assert p.exposed_comm_seconds <= p.comm_seconds


@pytest.mark.parametrize("args, says", [
    (["--micro-batch", "0"], "--micro-batch 0 (must be >= 1)"),
    (["--micro-batch", "-4"], "--micro-batch -4 (must be >= 1)"),
    (["--nodes", "0"], "--nodes 0 (must be >= 1)"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 (must be >= 1)"),
    (["--nodes", "2", "--inter-node-gbps", "-5"], "--inter-node-gbps -5.0 (must be > 0)"),
    (["--zero", "3", "--hpz", "3"], "--hpz 3 (must divide --gpus-per-node 8"),
    (["--zero", "2", "--hpz", "8"], "with --zero 2 (DeepSpeed runs it only with ZeRO-3)"),
    (["--zero", "1", "--quantized-weights"], "with --zero 1 (DeepSpeed runs it only with ZeRO-3)"),
    (["--decode-rate", "-1"], "--decode-rate -1.0 (must be > 0)"),
    (["--cpu-cores", "0"], "--cpu-cores 0 (must be >= 1)"),
    (["--loader-workers", "-1"], "--loader-workers -1 (must be >= 0)"),
])
def test_impossible_layouts_are_one_line_and_exit_2(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "vit_large_patch16_224", "--gpu", "h100-sxm", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("args, says", [
    (["--nodes", "0"], "--nodes 0 (must be >= 1)"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 (must be >= 1)"),
    (["--world-size", "8", "--gpus-per-node", "0"], "--gpus-per-node 0 (must be >= 1)"),
    (["--world-size", "8", "--search", "--top", "-1"], "--top -1 (must be >= 1)"),
])
def test_a_config_layout_below_one_node_or_gpu_is_one_line(args, says, capsys):
    """With --config the world is divided by the nodes and GPUs given before any layout is built:
    a count below one is the flag's line, as without a config, not a ZeroDivisionError; a --top
    below one would have dropped rows from the ranking's end."""
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", "configs/vit_b16_in1k.yaml", "--gpu", "h100-sxm", *args])
    assert (e.value.code, capsys.readouterr().err) == (2, f"vit-launch: error: {says}\n")


def test_a_config_batch_that_does_not_fit_the_world_says_what_to_change(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", "configs/vit_l16_in21k.yaml", "--world-size", "128", "--gpu", "h100-sxm"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "train.micro_batch_size=32" in err and "--global-batch" not in err, err


def test_search_lists_images_per_second_best_first(capsys):
    assert main_rc(["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--nodes", "4",
                    "--global-batch", "4096", "--search", "--top", "40"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    ips = [float(r[6].replace(",", "")) for r in rows]
    assert len(ips) > 5 and ips == sorted(ips, reverse=True)


@pytest.mark.parametrize("ckpt", ["true", "selective", "false"])
def test_the_levers_line_says_what_the_checkpointing_adds_to_the_step(ckpt, capsys):
    """The shipped L/16 config on 64 H100s with every block checkpointed, op by op, or none: the
    levers line prices the recompute as the step against the same layout without checkpointing,
    the inverse of the `false` lever's gain below it (none when nothing is recomputed)."""
    assert main_rc(["plan", "--config", "configs/vit_l16_in21k.yaml", "--world-size", "64", "--gpu", "h100-sxm",
                    f"train.activation_checkpointing={ckpt}"]) == 0
    out = capsys.readouterr().out
    levers = next(ln for ln in out.splitlines() if ln.lstrip().startswith("levers"))
    gains = dict(g.rsplit(" ", 1) for g in out.split("other levers")[1].strip().split("; "))
    if ckpt == "false":
        assert "step time" not in levers and "train.activation_checkpointing=false" not in gains, out
        return
    cost = levers.split(" step time")[0].rsplit("+", 1)[1]
    assert gains["train.activation_checkpointing=false"] == f"+{cost}", (levers, gains)
    assert int(cost.rstrip("%")) >= (20 if ckpt == "true" else 1), levers
    assert main_rc(["plan", "--config", "configs/vit_l16_in21k.yaml", "--world-size", "64", "--gpu", "h100-sxm",
                    f"train.activation_checkpointing={ckpt}", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert f"+{got['checkpointing_cost']:.0%}" == f"+{cost}"


def main_rc(argv) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_a_layout_the_loaders_cannot_feed_is_input_bound_and_says_what_fixes_it(capsys):
    """ViT-B/16 on a DGX H100 node from shards stored at ImageNet's native size: the GPUs could take
    more than the CPU workers decode; pre-resized shards and GPU decode each raise the input rate."""
    base = dict(model="vit_base_patch16_224", gpu="h100-sxm", micro_batch=128)
    native = predict(Layout(**base, stored_side=500))
    assert native.input_bound and native.images_per_second == native.input_images_per_second
    assert "input pipeline" in native.bottleneck and "--resize-shorter 256" in native.bottleneck
    assert "data.decode_device: cuda" in native.bottleneck
    resized = predict(Layout(**base))
    assert resized.input_images_per_second > 3 * native.input_images_per_second  # (500 / 256)^2 fewer pixels
    gpu = predict(Layout(**base, stored_side=500, decode="cuda"))
    assert gpu.input_images_per_second > native.input_images_per_second
    slow = predict(Layout(**base, decode_rate=10.0))  # a measured rate replaces the default
    assert slow.input_bound and slow.input_images_per_second == 10.0 * (112 - 8)
    assert main_rc(["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--micro-batch", "128",
                    "--stored-side", "500"]) == 0
    out = capsys.readouterr().out
    assert "INPUT-BOUND" in out and "input pipeline" in out


def test_loader_workers_share_the_cores_the_ranks_leave():
    """A node's loader rate is its workers' cores x the per-worker rate: the job's data.workers per
    rank when given, and never more cores than the scheduler gives them beside the ranks."""
    per = inputs.CPU_DECODE_PER_WORKER
    assert inputs.node_rate("cpu", 112, 8).images_per_second == pytest.approx(104 * per)  # one per free core
    assert inputs.node_rate("cpu", 112, 8, workers=10).images_per_second == pytest.approx(80 * per)
    assert inputs.worker_cores(2, 2, 2, rank_cores=0.02) == pytest.approx(1.96)  # idle ranks leave their cores
    assert inputs.worker_cores(2, 2, 1) == pytest.approx(2 / 3)  # busy ranks: one equal share each
    assert inputs.worker_cores(16, 8, 16) == pytest.approx(16 * 16 / 24)  # oversubscribed: equal shares
    from pretrain.config import load_config
    from pretrain.perf.perfmodel import layout_from_config

    cfg = load_config("configs/vit_l16_in21k.yaml")  # data.workers: 10
    p = predict(layout_from_config(cfg, nodes=1, gpus_per_node=8, gpu="h100-sxm"))
    assert p.input_images_per_second == pytest.approx(8 * cfg.data.workers * per), p.input_limit


@pytest.mark.parametrize("device,path", [("worker", "cpu"), ("cuda", "cuda"), ("dali", "dali"), ("cpu", "rank")])
def test_the_plan_of_a_config_decodes_where_its_data_decode_device_says(device, path):
    """A config's data.decode_device is the plan's decode path: DALI is priced as the GPU decode it is
    (and says its rate is nvJPEG's), and decode in the training processes is one decoder per GPU."""
    from pretrain.config import load_config
    from pretrain.perf.perfmodel import layout_from_config

    cfg = load_config("configs/vit_l16_in21k.yaml", [f"data.decode_device={device}"])
    lay = layout_from_config(cfg, nodes=1, gpus_per_node=8, gpu="h100-sxm")
    p = predict(replace(lay, stored_side=500))
    assert lay.decode == path and p.layout["decode"] == path
    workers = inputs.node_rate("cpu", 112, 8, 500, workers=cfg.data.workers).images_per_second
    if path in ("cuda", "dali"):
        assert p.input_images_per_second > workers
        assert ("priced at nvJPEG" in p.input_limit) == (path == "dali"), p.input_limit
    elif path == "rank":  # 8 decoding processes instead of 80 workers
        assert p.input_images_per_second == pytest.approx(workers * 8 / 80), p.input_limit
        assert "training processes" in p.input_limit and "data.decode_device: cuda" in p.bottleneck
    else:
        assert p.input_images_per_second == pytest.approx(workers)


def test_too_few_loader_workers_say_so(capsys):
    assert main_rc(["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--micro-batch", "128",
                    "--loader-workers", "4"]) == 0
    out = capsys.readouterr().out
    assert "INPUT-BOUND" in out and "32 workers" in out and "more loader workers (data.workers" in out, out


# ZeRO-3 steps measured on one GPU (bf16, one rank; benchmarks/results/zero3-leaf-blocks-h200.md):
# (gpu, model, micro batch, leaf blocks) -> extra ms of the ZeRO-3 step over the ZeRO-1 step of the same run
ZERO3_MEASURED = {("h200", "vit_large_patch16_224", 64, True): 210.9 - 72.1,
                  ("h200", "vit_large_patch16_224", 64, False): 316.6 - 72.1,
                  ("h200", "vit_large_patch16_224", 16, True): 125.8 - 50.0,
                  ("h200", "vit_large_patch16_224", 16, False): 276.3 - 50.0,
                  ("h200", "vit_base_patch16_224", 64, True): 68.7 - 26.8,
                  ("h200", "vit_base_patch16_224", 64, False): 147.7 - 26.8,
                  ("h100-sxm", "vit_large_patch16_224", 64, False): 390.5 - 79.9}


@pytest.mark.parametrize("gpu,model,micro,leaf", list(ZERO3_MEASURED))
def test_zero3_extra_over_zero1_is_the_measured_one(gpu, model, micro, leaf):
    """What ZeRO-3 adds to a one-GPU step (its hooks, and the work that grows with the micro-step's
    GPU time and the parameters) against every measured row: two of them set the work's two terms,
    the hook layouts' differences the cost per module; the other rows are predictions."""
    lay = Layout(model, gpu, gpus_per_node=1, micro_batch=micro, zero=3, leaf_blocks=leaf)
    zero3, zero1 = predict(lay), predict(replace(lay, zero=1))
    extra = zero3.step_seconds - zero1.step_seconds
    assert extra == pytest.approx(zero3.zero3_hook_seconds + zero3.zero3_work_seconds, rel=1e-6)
    assert 0.85 <= extra * 1e3 / ZERO3_MEASURED[(gpu, model, micro, leaf)] <= 1.15, extra


def test_zero3_pays_its_host_hooks_per_module_and_leaf_blocks_pay_fewer(capsys):
    """Leaf blocks hook 33 modules of ViT-L/16 instead of 465; checkpointing runs the forward hooks
    again and recomputes (more work); other stages have neither."""
    lay = Layout("vit_large_patch16_224", "h100-sxm", gpus_per_node=1, micro_batch=64, zero=3, leaf_blocks=False)
    per_module, leaf, zero1 = predict(lay), predict(replace(lay, leaf_blocks=True)), predict(replace(lay, zero=1))
    assert leaf.zero3_hook_seconds == pytest.approx(per_module.zero3_hook_seconds * 33 / 465)
    assert leaf.zero3_work_seconds == pytest.approx(per_module.zero3_work_seconds)
    ckpt = predict(replace(lay, checkpointing=True))
    assert ckpt.zero3_hook_seconds == pytest.approx(1.5 * per_module.zero3_hook_seconds)
    assert ckpt.zero3_work_seconds > per_module.zero3_work_seconds
    assert zero1.zero3_hook_seconds == zero1.zero3_work_seconds == 0.0
    assert main_rc(["plan", "--model", "vit_large_patch16_224", "--gpu", "h100-sxm", "--zero", "3",
                    "--no-leaf-blocks"]) == 0
    out = capsys.readouterr().out
    assert "per-module hooks" in out.splitlines()[0] and "ZeRO-3 hooks on the host" in out


def test_input_advice_suggests_more_workers_only_when_each_rank_can_have_one():
    assert "more loader workers" not in inputs.advice("cpu", 256, idle_cores=5, gpus_per_node=8)  # 0 per rank
    assert "16 cores per node are idle, 2 more per rank" in inputs.advice("cpu", 256, idle_cores=16, gpus_per_node=8)


def test_the_plan_s_levers_include_the_zero_stage_as_training_would_run_it():
    """`vit-launch plan`'s "other levers" turn the ZeRO stage too: ViT-H/14 on 256 H100s at ZeRO-3
    (micro 16) is told ZeRO-2 (which fits) is over 3x faster. A whole-model compile is priced as
    training runs it at ZeRO-3 (its blocks compiled) and not offered there, and ZeRO++ belongs to
    ZeRO-3 alone."""
    from pretrain.perf.advice import lever_gains

    h14 = Layout("vit_huge_patch14_224", "h100-sxm", nodes=32, micro_batch=16, global_batch=4096,
                 num_classes=18291, zero=3, hpz_partition_size=8)
    base = predict(h14).images_per_second
    gains = dict(lever_gains(h14))
    two = replace(h14, zero=2, hpz_partition_size=1)
    assert gains["zero.stage=2"] == pytest.approx(predict(two).images_per_second / base) and gains["zero.stage=2"] > 3
    assert "train.compile=model" not in gains and "train.compile=blocks" in gains
    l16 = Layout("vit_large_patch16_224", "h100-sxm", nodes=8, micro_batch=64, global_batch=4096, zero=2,
                 compile="model")
    gains = dict(lever_gains(l16))
    three = predict(replace(l16, zero=3, compile="blocks")).images_per_second / predict(l16).images_per_second
    assert gains["zero.stage=3"] == pytest.approx(three) and gains["zero.stage=3"] < 1
    assert "zero.stage=1" in gains and "zero.stage=2" not in gains


def test_the_plan_does_not_advise_compiling_blocks_where_the_whole_model_compiles():
    """At ZeRO 0-2 the model prices `train.compile=blocks` above the whole model's compile for ViT-L/16
    on 64 H100s (its gradients reach the reduction block by block), where vit-train measured it at
    0.80x `model` and below eager on one H200: the levers offer `model` and off there, never
    `blocks`, also to a layout that compiles blocks; leaving ZeRO-3 a blocks compile becomes the whole
    model's, and at ZeRO-3 `blocks` is the compile offered."""
    from pretrain.config import load_config
    from pretrain.perf.advice import lever_gains
    from pretrain.perf.perfmodel import layout_from_config

    l16 = layout_from_config(load_config("configs/vit_l16_in21k.yaml"), nodes=8, gpus_per_node=8,
                             gpu="h100-sxm")
    assert (l16.zero, l16.compile) == (2, "model")
    assert predict(replace(l16, compile="blocks")).images_per_second > predict(l16).images_per_second
    gains = dict(lever_gains(l16))
    assert "train.compile=false" in gains and not any("compile=blocks" in k for k in gains)
    blocks = replace(l16, compile="blocks")
    gains = dict(lever_gains(blocks))
    model = predict(l16).images_per_second / predict(blocks).images_per_second
    assert gains["train.compile=model"] == pytest.approx(model)
    one = predict(replace(blocks, zero=1)).images_per_second / predict(blocks).images_per_second
    assert gains["zero.stage=1"] == pytest.approx(one)  # the stage alone: not ZeRO-3's way out
    eager = replace(l16, compile="")
    assert "train.compile=model" in dict(lever_gains(eager)) and "train.compile=blocks" not in dict(lever_gains(eager))
    z3 = replace(l16, zero=3, compile="blocks")
    gains = dict(lever_gains(z3))
    two = predict(replace(l16, compile="model")).images_per_second / predict(z3).images_per_second
    assert gains["zero.stage=2 train.compile=model"] == pytest.approx(two)
    assert "train.compile=false" in gains and "train.compile=model" not in gains
    assert "train.compile=blocks" in dict(lever_gains(replace(z3, compile="")))
    gains = dict(lever_gains(replace(z3, compile="model")))  # ZeRO-3 runs it as blocks; ZeRO-2 as written
    assert gains["zero.stage=2"] == pytest.approx(two) and "train.compile=blocks" not in gains


def test_a_config_s_plan_says_what_its_whole_run_costs(capsys):
    """With --config, `vit-launch plan` prices the whole run: train.steps x the config's global
    batch (the images it trains on, whatever --micro-batch says) at the predicted img/s, in hours
    and GPU-hours; a model without a config has no run to price."""
    import json

    from pretrain.config import load_config

    t = load_config("configs/vit_h14_jft.yaml").train
    hours = {}
    for extra in ([], ["--micro-batch", "8"]):
        assert main_rc(["plan", "--config", "configs/vit_h14_jft.yaml", "--world-size", "256", "--gpu", "h100-sxm",
                        "--json", *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        hours[len(extra)] = h = t.steps * t.global_batch_size / got["images_per_second"] / 3600
        assert got["run"]["hours"] == pytest.approx(h) and got["run"]["gpu_hours"] == pytest.approx(256 * h)
        assert got["run"]["steps"] == t.steps == 1_035_644 and got["run"]["global_batch"] == 4096
    assert hours[2] > hours[0]  # micro 8 is slower (the plan's search ranks it below 16): the same images take longer
    assert main_rc(["plan", "--config", "configs/vit_h14_jft.yaml", "--world-size", "256", "--gpu", "h100-sxm"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  run ")]
    assert line == [f"  run             1,035,644 steps x 4,096 images (the config's): {hours[0]:,.1f} h on 256 GPUs, "
                    f"{256 * hours[0]:,.0f} GPU-hours; the steps alone, start-up, evaluations and checkpoint "
                    "saves on top"], line
    assert main_rc(["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm"]) == 0
    assert "  run " not in capsys.readouterr().out


ARCH_OVERRIDES = (["model.qk_norm=true"], ["model.init_values=null"], ["model.representation_size=1024"],
                  ["model.pos_embed=sincos2d"],
                  ["model.qk_norm=true", "model.reg_tokens=4", "model.class_token=false", "model.global_pool=map"],
                  ["model.qk_norm=true", "model.init_values=null", "model.global_pool=avg",
                   "model.representation_size=768"])


@pytest.mark.parametrize("arch", ARCH_OVERRIDES, ids=lambda o: ",".join(x.split(".")[1] for x in o))
@pytest.mark.parametrize("train", [["train.micro_batch_size=512", "train.activation_checkpointing=false"],
                                   ["train.micro_batch_size=512", "train.activation_checkpointing=auto"],
                                   ["zero.stage=2", "train.activation_checkpointing=auto"],
                                   ["train.micro_batch_size=512", "zero.stage=3", "zero.hpz_partition_size=2",
                                    "train.activation_checkpointing=auto"]],
                         ids=["512-none", "512-auto", "zero2-auto", "zero3-hpz-auto"])
def test_the_plan_prices_the_model_the_config_builds(arch, train):
    """The plan's memory is the estimate `vit-launch check` and training size the job by (the resolved
    config's, from its whole model section: LayerScale, qk_norm, the pre-logits layer, the position
    embedding, the tokens and pooling), so both say alike whether it fits, and the plan's `auto`
    checkpointing is the count training picks (the DeiT III L/16 recipe, LayerScale on, 4 H100s);
    at ZeRO-3 with hpZ too, whose kept-gathered weights and secondary partition are in both."""
    from pretrain.config import load_config
    from pretrain.perf import levers, memory
    from pretrain.perf.hardware import GPUS
    from pretrain.perf.perfmodel import layout_from_config

    cfg = load_config("configs/deit3_l16_in1k.yaml", [*arch, *train])
    budget = GPUS["h100-sxm"].memory_gb * memory.GB
    resolved, _ = levers.resolve(cfg, 4, gpus_per_node=4, gpu="h100-sxm", network="dgx-h100", memory_bytes=budget)
    est = memory.estimate(resolved, 4)  # what `check` and training's start-up estimate
    built = memory.model_shape(cfg.model)
    lay = layout_from_config(cfg, nodes=1, gpus_per_node=4, gpu="h100-sxm")
    p = predict(lay)
    assert p.params == built.params == est.params, (p.params, built.params)
    assert p.memory_gb_per_gpu["total"] == pytest.approx(est.total / memory.GB, rel=1e-9), (arch, train)
    assert p.fits == (est.total <= budget * memory.MEMORY_HEADROOM)
    fewest = next((n for n in range(built.depth + 1) if predict(replace(lay, checkpointing=n)).fits), built.depth)
    if "train.activation_checkpointing=auto" in train:
        assert lay.checkpointing == fewest, (arch, train, lay.checkpointing, fewest)


def test_the_plan_gives_bytes_sent_and_memory_in_one_labelled_unit(capsys):
    """Every GB on the plan's screen is 2^30 bytes (the memory estimate's unit, `vit-launch check`'s
    and train/peak_memory_gb's): the bytes each GPU sends, from --json's comm_bytes_per_gpu, are
    printed in it too, and the line says so."""
    flags = ["plan", "--model", "vit_large_patch16_224", "--gpu", "h100-sxm", "--nodes", "2", "--zero", "3"]
    assert main_rc([*flags, "--json"]) == 0
    sent = json.loads(capsys.readouterr().out)["comm_bytes_per_gpu"]
    assert main_rc(flags) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  sent per GPU")]
    words = ", ".join(f"{k} {v / 2 ** 30:.2f} GB" for k, v in sent.items())
    assert line == f"  sent per GPU    {words} per step (GB of 2^30 bytes, as the memory below)", line
