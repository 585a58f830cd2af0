"""The performance model (pretrain/perf/perfmodel.py) against the built models, the published runs,
DeepSpeed's own bytes and buffers on 2 real CPU ranks, and this machine's measured step time."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from dist_utils import REPO, deepspeed_cmd, run_job

from pretrain.config import ConfigError, load_config
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import check_zeropp_device, deepspeed_config
from pretrain.models import arch
from pretrain.models.vit import create_model
from pretrain.perf import advice, collectives, memory, perfmodel
from pretrain.perf.hardware import GPUS, gpu_key
from pretrain.perf.perfmodel import Layout, predict
from pretrain.perf.published import calibrate, published_table


@pytest.mark.parametrize("name", arch.list_models())
def test_parameter_counts_match_the_built_model(name):
    """The torch-free counts the model prices are those of the modules pretrain.models.vit builds."""
    for kw in ({}, dict(qk_norm=True, init_values=1e-5, representation_size=64, global_pool="avg", num_classes=10,
                        img_size=64),
               dict(reg_tokens=4, class_token=False, global_pool="map", pos_embed="sincos2d", num_classes=10,
                    img_size=64)):
        with torch.device("meta"):
            m = create_model(name, **kw)
        params = sum(p.numel() for p in m.parameters())
        largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
        kk = dict(kw)
        kk["layer_scale"] = bool(kk.pop("init_values", None))
        assert arch.param_count(name, **kk) == (params, largest)
        if not arch.model_defaults(name)["stem_layers"]:  # what ZeRO-3 partitions: each tensor
            assert sorted(arch.param_tensors(name, **kk)) == sorted(p.numel() for p in m.parameters()), kw
    with torch.device("meta"):
        m = create_model(name, num_classes=10, img_size=64)
    built = sorted(p.numel() for p in m.parameters())
    if arch.model_defaults(name)["stem_layers"]:  # the ResNet stem is one entry: its total
        assert sum(arch.param_tensors(name, 64, 10)) == sum(built)
    else:
        assert sorted(arch.param_tensors(name, 64, 10)) == built
        # the modules DeepSpeed's ZeRO-3 hooks: all of them, or none inside a leaf block
        for leaf in (False, True):
            for rate in (0.0, 0.5):  # model.patch_drop_rate: its module exists only when on
                with torch.device("meta"):
                    m = create_model(name, num_classes=10, img_size=64, patch_drop_rate=rate)
                lay = Layout(name, "h100-sxm", micro_batch=1, img_size=64, num_classes=10, zero=3, leaf_blocks=leaf,
                             patch_drop_rate=rate)
                inside = {id(x) for blk in m.blocks for x in blk.modules() if x is not blk}
                hooked = sum(1 for x in m.modules() if not (leaf and id(x) in inside))
                assert collectives.zero3_hooked(lay) == hooked, (name, leaf, rate)
        # with registers and the MAP head: their tensors, the pool's modules (and patch dropout's when on)
        opts = dict(reg_tokens=4, global_pool="map")
        with torch.device("meta"):
            m = create_model(name, num_classes=10, img_size=64, **opts)
        assert sorted(arch.param_tensors(name, 64, 10, **opts)) == sorted(p.numel() for p in m.parameters())
        for rate in (0.0, 0.5):
            with torch.device("meta"):
                m = create_model(name, num_classes=10, img_size=64, patch_drop_rate=rate, **opts)
            lay = Layout(name, "h100-sxm", micro_batch=1, img_size=64, num_classes=10, zero=3, leaf_blocks=False,
                         patch_drop_rate=rate, **opts)
            assert collectives.zero3_hooked(lay) == sum(1 for _ in m.modules()), rate


def test_nemo_rows_model_the_sequence_nemo_runs():
    """NeMo's ViT backbone prepends ``class_token_length`` [class] tokens (8 unless set, and its
    ViT-g/14 training config does not set it: NeMo's model table says 264 tokens for g/14), and its
    head is a hidden-wide dense layer and tanh before the classifier: the published throughputs are
    for that model, so the rows the constants are solved from price the same one."""
    nemo_class_tokens, patches = 8, (224 // 14) ** 2
    rows = [r for r in published_table() if r["name"].startswith("NeMo")]
    assert len(rows) == 4
    for r in rows:
        shape = Layout(**r["layout"]).shape()
        assert shape.seq_len == patches + nemo_class_tokens == 264, (r["name"], shape.seq_len)
        assert r["layout"]["representation_size"] == shape.width, r["name"]


def test_published_runs_within_stated_tolerance():
    rows = published_table()
    calibrated = {}
    for r in rows:
        assert r["source"] and r["why"], r["name"]
        assert abs(r["error"]) <= r["tolerance"], \
            f"{r['name']}: predicted {r['predicted']:.3f}, published {r['published']}"
        if r.get("calibration"):
            gpu = r["layout"]["gpu"]
            assert gpu not in calibrated, f"two calibration points for {gpu}"
            calibrated[gpu] = calibrate(Layout(**r["layout"]), r["published"])
    # the table's constants are the ones the named points give; every other row is a prediction
    for gpu, eff in calibrated.items():
        assert GPUS[gpu].efficiency == pytest.approx(eff, abs=0.002), gpu
    assert sum(not r.get("calibration") for r in rows) >= 6
    for key, g in GPUS.items():
        assert "calibrated" in g.calibration or "borrowed" in g.calibration, key


def test_collective_times_follow_nccl_tests_formulas():
    lay = Layout("vit_base_patch16_224", "a100-80gb", nodes=2, gpus_per_node=8, network="dgx-a100")
    inter = 1600 / 8 * 1e9 * collectives.LINK_EFFICIENCY["inter"]
    ar = collectives.Collective("all_reduce", 1e9, 1, 16, True)
    ag = collectives.Collective("all_gather", 1e9, 1, 16, True)
    lat = collectives.LATENCY_S["inter"]
    assert collectives.collective_seconds(lay, ar) == pytest.approx(1e9 * 2 * 15 / 16 / inter + lat)
    assert collectives.collective_seconds(lay, ag) == pytest.approx(1e9 * 15 / 16 / inter + lat)
    # inside one node the NVLink rate applies
    one = replace(lay, nodes=1)
    intra = 2400 / 8 * 1e9 * collectives.LINK_EFFICIENCY["intra"]
    assert collectives.busbw(one, False) == pytest.approx(intra)
    # explicit bandwidths override the preset
    slow = replace(lay, inter_node_gbps=100)
    assert collectives.busbw(slow, True) == pytest.approx(100 / 8 * 1e9 * collectives.LINK_EFFICIENCY["inter"])


def test_reduce_dtype_and_zeropp_are_priced():
    base = Layout("vit_gigantic_patch14_224", "h100-sxm", nodes=4, micro_batch=16, zero=3, max_reuse_distance=0)
    p = predict(base)
    params = p.params

    def kinds(lay):
        return {c.what: c for c in collectives.collectives(lay, params)}

    c = kinds(base)
    fwd, bwd = c["weights, forward"], c["weights released after the forward, backward"]
    assert fwd.bytes * fwd.calls == pytest.approx(bwd.bytes * bwd.calls)
    assert kinds(replace(base, quantized_weights=True))["weights, forward"].bytes == pytest.approx(fwd.bytes / 2)
    hpz = replace(base, hpz_partition_size=8)
    b2 = kinds(hpz)["weights released after the forward, backward (hpZ secondary)"]
    assert b2.ranks == 8 and not b2.crosses_nodes and bwd.crosses_nodes
    assert predict(hpz).memory_gb_per_gpu["hpz_secondary"] == pytest.approx(2 * params / 8 / 2 ** 30)
    assert predict(hpz).exposed_comm_seconds <= p.exposed_comm_seconds
    qg = kinds(replace(base, quantized_gradients=True))["gradients, int4 (qgZ)"]
    assert qg.kind == "all_to_all"
    assert qg.bytes * qg.calls == pytest.approx(c["gradients"].bytes * c["gradients"].calls / 8)
    # bf16 reduction halves the gradient bytes of fp32 reduction
    z2 = Layout("vit_large_patch16_224", "a100-80gb", nodes=2, zero=2)
    full, half = (predict(replace(z2, reduce_dtype=d)).comm_bytes_per_gpu["all_reduce"] for d in ("fp32", "bf16"))
    assert half == pytest.approx(full / 2)
    # with DeepSpeed's default reuse distance a sub-billion model is gathered once per micro-step
    assert "weights released after the forward, backward" not in kinds(replace(base, model="vit_large_patch16_224",
                                                                               max_reuse_distance=10 ** 9))


def test_search_ranks_fitting_layouts(capsys):
    rows = advice.search(Layout("vit_huge_patch14_224", "a100-40gb", nodes=4, global_batch=4096))
    assert rows and all(r.fits for r in rows)
    ips = [r.images_per_second for r in rows]
    assert all(b <= a * 1.005 for a, b in zip(ips, ips[1:]))  # best first; ties within 0.5 % by micro batch
    # ViT-H at large micro batches does not fit 40 GB without checkpointing: the search knows
    assert not predict(Layout("vit_huge_patch14_224", "a100-40gb", nodes=4, micro_batch=128, zero=1)).fits
    assert any(r.layout["checkpointing"] for r in rows) or max(r.layout["micro_batch"] for r in rows) < 128


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "launch.cli", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_plan_command_json_search_and_config(tmp_path):
    r = _plan("--model", "vit_large_patch16_224", "--gpu", "h100-sxm", "--nodes", "8", "--gpus-per-node", "8",
              "--micro-batch", "64", "--global-batch", "4096", "--zero", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("images_per_second", "images_per_second_per_gpu", "mfu", "step_seconds", "compute_seconds",
                "exposed_comm_seconds", "comm_bytes_per_gpu", "memory_gb_per_gpu", "fits", "bottleneck"):
        assert key in out, key
    assert set(out["comm_bytes_per_gpu"]) == {"all_reduce", "all_gather"}
    assert 0 < out["mfu"] < 1 and out["fits"]
    r = _plan("--model", "vit_large_patch16_224", "--gpu", "a100-80gb", "--nodes", "2", "--global-batch", "2048",
              "--search", "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["rank", "zero", "micro"] and len(lines) == 4
    r = _plan("--config", "configs/vit_l16_in21k.yaml", "--world-size", "64", "--gpu", "h100-sxm")
    assert r.returncode == 0, r.stderr
    assert "vit_large_patch16_224 on 8 x 8 h100-sxm" in r.stdout and "bottleneck" in r.stdout
    r = _plan("--model", "vit_nope", "--gpu", "h100-sxm")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "vit_nope" in r.stderr
    r = _plan("--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--micro-batch", "48", "--global-batch", "1000")
    assert r.returncode == 2 and "--global-batch" in r.stderr


def test_check_prints_the_prediction():
    r = subprocess.run([sys.executable, "-m", "launch.cli", "check", "--config", "configs/vit_l16_in21k.yaml",
                        "--world-size", "16", "--gpu", "h100-sxm", "--gpu-memory-gb", "80"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert "predicted on 2 x 8 h100-sxm:" in r.stdout and "MFU" in r.stdout, r.stdout + r.stderr


def test_zeropp_keys_reach_deepspeed_and_are_checked():
    cfg = load_config("configs/tiny_cpu.yaml", ["zero.stage=3", "zero.hpz_partition_size=2",
                                                "zero.quantized_weights=true", "zero.reduce_bucket_size=500000000",
                                                "zero.stage3_prefetch_bucket_size=50000000"])
    ds = deepspeed_config(cfg.optim, cfg.train, cfg.zero, 2)["zero_optimization"]
    assert ds["zero_hpz_partition_size"] == 2 and ds["zero_quantized_weights"] is True
    assert ds["zero_quantized_gradients"] is False
    with pytest.raises(ConfigError, match="zero.hpz_partition_size"):
        load_config("configs/tiny_cpu.yaml", ["zero.stage=2", "zero.hpz_partition_size=2"])
    with pytest.raises(ConfigError, match="zero.quantized_weights=true needs CUDA"):
        check_zeropp_device(ZeroConfig(stage=3, quantized_weights=True), cuda=False)
    check_zeropp_device(ZeroConfig(stage=3, hpz_partition_size=2), cuda=False)  # hpZ has no kernel


@pytest.fixture(scope="module")
def ds_bytes(tmp_path_factory):
    out = tmp_path_factory.mktemp("perf") / "bytes.json"
    r = run_job(deepspeed_cmd("tests.jobs.perf_bytes_job", str(out)), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def _job_layout(stage: int, world: int, precision: str = "") -> Layout:
    return Layout("vit_tiny_patch16_224", "cpu", nodes=1, gpus_per_node=world, micro_batch=2, global_batch=4 * world,
                  img_size=32, num_classes=10, zero=stage, precision=precision or ("fp32" if stage == 0 else "bf16"),
                  reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000, peak_tflops=1.0, efficiency=1.0,
                  hbm_gbs=10.0, memory_gb=24, intra_node_gbps=10.0)


@pytest.mark.parametrize("stage, precision", [(0, ""), (1, ""), (2, ""), (3, ""), (1, "bf16-autocast"),
                                              (3, "bf16-autocast")])
def test_collective_bytes_equal_deepspeeds(ds_bytes, stage, precision):
    """Per optimizer step, by collective type: the model's bytes (nccl-tests' S) against what
    DeepSpeed's comms logger saw. The logger records an all-gather's input (one rank's shard),
    so S is that times the world size. Allowed on top: DeepSpeed pads flat partitions to a
    multiple of the world size x 2 elements, and all-reduces a few scalars (overflow flag, norm).
    bf16-autocast: the fp32 module's weights are gathered in fp32, twice bf16's bytes."""
    world = ds_bytes["world"]
    got = ds_bytes["stages"][f"{stage}-{precision}" if precision else str(stage)]
    params = got["params"]
    assert params == memory.analytic_shape("vit_tiny_patch16_224", img_size=32, num_classes=10).params
    model: dict[str, float] = {}
    for c in collectives.collectives(_job_layout(stage, world, precision), params):
        model[c.kind] = model.get(c.kind, 0.0) + c.bytes * c.calls
    seen = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0}
    for name, op in got["ops"].items():
        kind = next(k for k in seen if k in name)
        seen[kind] += op["bytes"] * (world if kind == "all_gather" else 1)
    pad = 2 * world * 4 * 4  # padded elements x fp32, per accumulated micro-step
    for kind in seen:
        want = model.get(kind, 0.0)
        assert want <= seen[kind] <= want + pad + 16, (stage, kind, want, seen[kind])
    assert seen["all_reduce"] + seen["all_gather"] + seen["reduce_scatter"] > params  # something was measured


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_equal_what_optimizers_hold(ds_bytes, stage):
    """Master weights, Adam moments and fp32 gradient buffers read off the live optimizer of each
    stage, against pretrain.perf.memory's bytes; then the model against DeepSpeed's own estimators."""
    world = ds_bytes["world"]
    got = ds_bytes["stages"][str(stage)]
    params = got["params"]
    held = {role: sum(n * (4 if "float32" in dt else 2) for n, dt in t) for role, t in got["optimizer"].items()}
    assert all("float32" in dt for t in got["optimizer"].values() for _, dt in t)
    precision = "fp32" if stage == 0 else "bf16"
    states = memory.model_state_bytes(params, stage=stage, world=world, precision=precision)
    slack = 4 * 2 * world * 3  # partition padding, fp32, master + 2 moments
    if stage == 0:  # torch's AdamW on the module's fp32 weights: moments only beside them
        assert held["master"] == states["weights"] and held["moments"] == states["optimizer"]
        return
    # the model's optimizer bytes: master + moments (+ the fp32 gradient partition of ZeRO-2/3)
    fp32_grad_partition = 0 if stage == 1 else 4 * params / world
    assert held["master"] + held["moments"] == pytest.approx(states["optimizer"] - fp32_grad_partition, abs=slack)
    if stage == 1:  # BF16_Optimizer: a whole fp32 accumulation buffer beside the bf16 gradients
        assert got["optimizer_class"] == "BF16_Optimizer"
        assert held["grad_buffers"] == pytest.approx(states["gradients"] - 2 * params, abs=slack)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    ours = sum(v for k, v in states.items() if k != "cpu")
    if stage == 2:
        _, ds = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)
        assert ours == pytest.approx(ds, abs=1)
    if stage == 3:  # DeepSpeed counts 18 B/param over N plus 4 B per element of the largest layer;
        # ours 20 over N (the bf16 gradient partition too), the gathered layer in zero_buffer_bytes
        largest = memory.analytic_shape("vit_tiny_patch16_224", img_size=32, num_classes=10).largest_layer
        _, ds, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=world, cpu_offload=False,
                                                         cpu_offload_params=False)
        assert ours - 2 * params / world == pytest.approx(ds - 4 * largest, abs=1)


def test_training_records_the_prediction_for_known_gpus():
    assert gpu_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu_key("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    # the PCIe cards are their own types: a lower peak and no NVLink ring, not an SXM's
    assert (gpu_key("NVIDIA H100 PCIe"), gpu_key("NVIDIA H100 NVL"), gpu_key("NVIDIA H200 NVL")) == (
        "h100-pcie", "h100-nvl", "h200-nvl")
    assert gpu_key("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert gpu_key("cpu") is None
    cfg = load_config("configs/vit_l16_in21k.yaml")
    rec = perfmodel.run_record(cfg, 16, 8, "NVIDIA H100 80GB HBM3")
    want = predict(perfmodel.layout_from_config(cfg, nodes=2, gpus_per_node=8, gpu="h100-sxm"))
    assert rec["gpu"] == "h100-sxm" and rec["mfu"] == want.mfu and rec["images_per_second"] == want.images_per_second
    assert perfmodel.run_record(cfg, 16, 8, None) is None


def test_hpz_runs_on_gloo_with_the_losses_of_plain_zero3(tmp_path):
    """hpZ (zero.hpz_partition_size=2 on 4 ranks) builds its secondary partitions and trains to
    the same losses as ZeRO-3 without it: the secondary copy changes where weights are gathered
    from, not what is computed."""
    out = tmp_path / "hpz.json"
    r = run_job(deepspeed_cmd("tests.jobs.hpz_job", str(out), ranks=4), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["2"]["hpz_in_config"] == 2 and got["2"]["secondary"] == [2], got  # secondary groups of 2 ranks
    assert got["2"]["losses"] == got["1"]["losses"]
