"""The per-GPU memory estimate: the activation formula against the bytes autograd really keeps for
a backward pass, and the model-state split by ZeRO stage against DeepSpeed's own estimator."""
import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from pretrain.config import load_config
from pretrain.config.schema import ModelConfig
from pretrain.models.vit import create_model
from pretrain.perf import memory


def training_model(name, img, dtype, checkpointing, **kw):
    """The model in training mode with its checkpointing, and its weights' storages (not counted)."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, img_size=img, **kw).to(dtype).train()
    model.set_grad_checkpointing(checkpointing)
    return model, {p.untyped_storage().data_ptr() for p in model.parameters()}


def saved_activation_bytes(name, img, batch, dtype, checkpointing, autocast=False, **kw):
    """Bytes of the distinct tensors autograd saves in one training forward (weights excluded):
    exactly what stays alive until backward. ``autocast``: the forward under torch.autocast(bf16),
    whose bf16 weight copies are not the weights and count."""
    model, weights = training_model(name, img, dtype, checkpointing, **kw)
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()  # views of one storage count once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(torch.randn(batch, 3, img, img, dtype=dtype))
    return sum(n for ptr, n in seen.items() if ptr not in weights)


@pytest.mark.parametrize("img, batch, dtype, precision", [
    (224, 2, torch.bfloat16, "bf16"),  # s = 197: the ViT paper's sequence length
    (64, 4, torch.float32, "fp32"),
    # an fp32 module under autocast: fp32 LayerNorm inputs, and a bf16 copy of every weight (most of it here)
    (64, 4, torch.float32, "bf16-autocast"),
])
def test_activation_formula_matches_autograd(img, batch, dtype, precision):
    torch.set_num_threads(1)
    shape = memory.model_shape(ModelConfig(name="vit_tiny_patch16_224", img_size=img, num_classes=10))
    measured = saved_activation_bytes("vit_tiny_patch16_224", img, batch, dtype, checkpointing=False,
                                      autocast=precision == "bf16-autocast")
    est = memory.activation_bytes(shape, batch, precision=precision)
    assert est == pytest.approx(measured, rel=0.03), (est, measured)


def test_activation_formula_with_patch_dropout_matches_autograd():
    """The blocks keep the activations of the tokens patch dropout kept (the image batch is whole)."""
    torch.set_num_threads(1)
    shape = memory.model_shape(ModelConfig(name="vit_tiny_patch16_224", img_size=96, num_classes=10))
    measured = saved_activation_bytes("vit_tiny_patch16_224", 96, 4, torch.float32, checkpointing=False,
                                      patch_drop_rate=0.5)
    est = memory.activation_bytes(memory.trained_shape(shape, None, 0.5), 4, precision="fp32")
    assert est == pytest.approx(measured, rel=0.05), (est, measured)
    assert est < 0.6 * memory.activation_bytes(shape, 4, precision="fp32")


def test_checkpointing_keeps_only_block_inputs():
    """Forward with checkpointing saves each block's input; the estimate adds one block's full
    set for its recompute in backward, which this forward-only count does not see."""
    torch.set_num_threads(1)
    shape = memory.model_shape(ModelConfig(name="vit_tiny_patch16_224", img_size=224, num_classes=10))
    measured = saved_activation_bytes("vit_tiny_patch16_224", 224, 2, torch.bfloat16, checkpointing=True)
    one_block = memory.block_activation_bytes(shape.seq_len, 2, shape.width, shape.heads)
    est = memory.activation_bytes(shape, 2, checkpointing=True) - one_block
    assert est == pytest.approx(measured, rel=0.10), (est, measured)
    # and checkpointing is worth it: several times less than keeping every block
    assert memory.activation_bytes(shape, 2, checkpointing=True) < memory.activation_bytes(shape, 2) / 4


def held_storage(t: torch.Tensor) -> int:
    """The address of ``t``'s memory; 0 for a tensor that holds none (the fake and functional tensors
    a compile earlier in the same process can leave behind, whose storage has no address)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def kept_activation_bytes(name, img, batch, dtype, checkpointing, autocast=False, **kw):
    """Bytes of the distinct non-weight tensors made in one training forward (and its input) that
    are still alive after it, the output aside: what the backward will use. Op-level checkpointing
    keeps its tensors in checkpoint's own cache, which ``saved_tensors_hooks`` do not see."""
    import gc

    from torch.utils._python_dispatch import TorchDispatchMode

    model, weights = training_model(name, img, dtype, checkpointing, **kw)
    made = {}

    def note(t):
        made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    note(t)
            return out

    x = torch.randn(batch, 3, img, img, dtype=dtype)
    note(x)
    with Made(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    gc.collect()
    # (type, not isinstance: a deprecated torch.distributed alias warns when its class is asked)
    alive = {held_storage(t) for t in gc.get_objects() if issubclass(type(t), torch.Tensor)}
    alive.discard(y.untyped_storage().data_ptr())
    return sum(n for ptr, n in made.items() if ptr in alive and ptr not in weights)


@pytest.mark.parametrize("img, batch, dtype, precision", [
    (224, 2, torch.bfloat16, "bf16"),
    (64, 4, torch.float32, "fp32"),
    (64, 4, torch.float32, "bf16-autocast"),  # the weights' bf16 copies are recomputed too
])
def test_selective_checkpointing_keeps_matmul_outputs(img, batch, dtype, precision):
    """Op by op, each block keeps its input, its linears' and attention's outputs (22 s b h + 4 a s b
    bytes in bf16, against 32 s b h + 4 a s b); the estimate adds one block's recompute, which a
    forward does not see. Measured without checkpointing the same way, to show the two methods agree."""
    torch.set_num_threads(1)
    shape = memory.model_shape(ModelConfig(name="vit_tiny_patch16_224", img_size=img, num_classes=10))
    s, h, a = shape.seq_len, shape.width, shape.heads
    autocast = precision == "bf16-autocast"
    none = kept_activation_bytes("vit_tiny_patch16_224", img, batch, dtype, False, autocast=autocast)
    assert memory.activation_bytes(shape, batch, precision=precision) == pytest.approx(none, rel=0.03)
    op_level = kept_activation_bytes("vit_tiny_patch16_224", img, batch, dtype, "selective", autocast=autocast)
    recompute = (memory.block_activation_bytes(s, batch, h, a, precision=precision)
                 - memory.selective_block_bytes(s, batch, h, a, precision=precision)
                 + (2 * shape.block_params if autocast else 0))
    est = memory.activation_bytes(shape, batch, precision=precision, checkpointing="selective") - recompute
    assert est == pytest.approx(op_level, rel=0.03), (est, op_level)
    if precision == "bf16":
        assert memory.selective_block_bytes(s, batch, h, a) == 22 * s * batch * h + 4 * a * s * batch
        assert op_level < 0.75 * none


def test_model_states_by_zero_stage():
    p, n = 1_000_000, 8
    per_gpu = {s: sum(v for k, v in memory.model_state_bytes(p, stage=s, world=n, precision="bf16").items()
                      if k != "cpu") for s in (0, 1, 2, 3)}
    assert per_gpu[0] == 20 * p  # bf16 weights 2 + grads 2 + fp32 master 4 + fp32 grads 4 + Adam 8
    assert per_gpu[1] == (2 + 6 + 12 / n) * p  # BF16_Optimizer: whole bf16 + fp32 grads, master + Adam sharded
    assert per_gpu[2] == (2 + 18 / n) * p  # ... and 16-bit gradients
    assert per_gpu[3] == 20 / n * p  # ... and weights
    # ZeRO-2 equals DeepSpeed's own estimator (without offload): 2 + 18/N bytes per parameter
    _, ds_gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=n, cpu_offload=False)
    assert per_gpu[2] == pytest.approx(ds_gpu, abs=1)
    off = memory.model_state_bytes(p, stage=2, world=n, precision="bf16", offload_optimizer=True)
    assert off["optimizer"] == 0 and off["cpu"] == 16 / n * p
    both = memory.model_state_bytes(p, stage=3, world=n, precision="bf16", offload_optimizer=True, offload_params=True)
    assert both["weights"] == 0 and both["gradients"] == 2 / n * p and both["cpu"] == (16 + 2) / n * p


def test_vit_huge_needs_zero3_or_checkpointing_on_80gb():
    """ViT-H/14 at micro batch 256 in bf16: activations alone exceed an 80 GB GPU without
    checkpointing (s b h = 257 x 256 x 1280 per block, 32 blocks), fit with it: the case the
    pre-flight warning is for."""
    cfg = load_config("configs/vit_h14_jft.yaml", ["train.micro_batch_size=256", "train.activation_checkpointing=false",
                                                   "model.num_classes=1000", "model.drop_rate=0.0"])
    est = memory.estimate(cfg, world=16)
    assert est.params == pytest.approx(632e6, rel=0.02)  # the paper's 632M parameters (1000-class head)
    assert est.activations > 80 * memory.GB > est.total_if_checkpointing(True)


@pytest.mark.parametrize("opts", [dict(qk_norm=True), dict(init_values=1e-5), dict(qk_norm=True, init_values=1e-5)])
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_test_mem_g_shape_patch14_112"])
def test_activation_formula_with_qk_norm_layerscale_and_odd_mlp(name, opts):
    """qk_norm and LayerScale keep more for backward; a g/14-shaped MLP (48/11 of the width)
    scales the MLP terms: the formula follows autograd's saved bytes for each."""
    from pretrain.models.arch import register

    register("vit_test_mem_g_shape_patch14_112", patch_size=14, embed_dim=176, depth=2, num_heads=2, img_size=112,
             mlp_ratio=48 / 11)
    torch.set_num_threads(1)
    img = 112 if "112" in name else 224
    shape = memory.model_shape(ModelConfig(name=name, img_size=img, num_classes=10, **opts))
    assert shape.qk_norm == opts.get("qk_norm", False) and shape.layer_scale == ("init_values" in opts)
    measured = saved_activation_bytes(name, img, 2, torch.bfloat16, checkpointing=False, **opts)
    est = memory.activation_bytes(shape, 2, precision="bf16")
    assert est == pytest.approx(measured, rel=0.03), (est, measured)


def test_zero3_build_needs_one_layer_of_host_memory_not_the_model():
    """ViT-G/14 (1.84 B parameters): without ZeRO-3 each rank builds the whole fp32 model in host
    memory (7.4 GB, 8 ranks a node: 59 GB); under ZeRO-3 (deepspeed.zero.Init) one layer at a time."""
    cfg = load_config("configs/vit_h14_jft.yaml", ["model.name=vit_gigantic_patch14_224", "model.qk_norm=true",
                                                   "model.init_values=1e-5", "zero.stage=3"])
    z3 = memory.estimate(cfg, world=64)
    assert z3.params == pytest.approx(1.843e9 + 1664 * 18291, rel=0.002)
    assert z3.host_build == 4 * (18291 * 1664 + 18291)  # the largest layer (here the JFT head), fp32
    cfg.zero.stage = 2
    z2 = memory.estimate(cfg, world=64)
    assert z2.host_build == 4 * z2.params > 60 * z3.host_build


def test_zero3_gathers_a_whole_leaf_block_at_once():
    """With zero.leaf_blocks (the default; train.compile too) each Transformer block is one ZeRO-3
    leaf module, gathered whole: the estimate's gathered weights + gradients grow from the largest
    single module to one block. Both counted on real modules (meta device: no memory): timm's
    ViT-L/16 block, and the largest module's own parameters in our built model."""
    from timm.models.vision_transformer import Block as TimmBlock

    with torch.device("meta"):
        block = sum(p.numel() for p in TimmBlock(dim=1024, num_heads=16, mlp_ratio=4.0, qkv_bias=True).parameters())
        model = create_model("vit_large_patch16_224", num_classes=1000, defer_init=True)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())

    def buffers(*over, classes=1000):
        cfg = load_config("configs/vit_l16_in21k.yaml", [f"model.num_classes={classes}", "zero.stage=3",
                                                         "train.precision=bf16", "train.compile=false", *over])
        return memory.estimate(cfg, world=16).buffers

    leaf, per_module = buffers(), buffers("zero.leaf_blocks=false")
    assert leaf - per_module == 2 * 2 * (block - largest)  # bf16 weights and gradients of the block's rest
    assert (leaf - per_module) / 1e6 == pytest.approx(33.6, abs=0.1)  # 8.4 M parameters more
    assert buffers("zero.leaf_blocks=false", "train.compile=true") == leaf  # compiled blocks are leaves too
    # ImageNet-21k's head (21,843 classes: 22.4 M parameters, one module) is larger than a block:
    # it is the largest gathered unit either way
    assert buffers(classes=21843) == buffers("zero.leaf_blocks=false", classes=21843)


def test_zero3_counts_the_weights_kept_for_the_backward_and_hpz_secondary():
    """Under DeepSpeed's stage3_max_reuse_distance ZeRO-3 keeps every partitioned weight (the tensors
    above stage3_param_persistence_threshold, counted on the built model) gathered from its forward
    to its backward use; above it (G/14) some are released and gathered again. hpZ adds its
    secondary partition where its groups are smaller than the world. Both are in the total that
    `check`, `auto` checkpointing and `plan` fit."""
    with torch.device("meta"):
        model = create_model("vit_large_patch16_224", num_classes=1000, defer_init=True)
    partitioned = sum(p.numel() for p in model.parameters() if p.numel() > 100_000)

    def est(*over, world=16, name="vit_large_patch16_224"):
        cfg = load_config("configs/vit_l16_in21k.yaml", [f"model.name={name}", "model.num_classes=1000",
                                                         "train.precision=bf16", *over])
        return memory.estimate(cfg, world=world)

    z3 = est("zero.stage=3")
    # at the end of the forward the gathered block and the prefetched weights, which the buffers
    # count, are among the kept ones: counted once
    shape = memory.model_shape(ModelConfig(name="vit_large_patch16_224"))
    in_buffers = shape.block_params + 2 * shape.block_params  # the block, the `auto` prefetch of two
    assert z3.gathered_weights == 2 * (partitioned - in_buffers) and z3.hpz_secondary == 0
    s = z3.states
    assert z3.total == pytest.approx(s["weights"] + s["gradients"] + s["optimizer"] + z3.buffers + z3.activations
                                     + z3.runtime + z3.gathered_weights)
    hpz = est("zero.stage=3", "zero.hpz_partition_size=8")
    assert hpz.hpz_secondary == 2 * hpz.params / 8 and hpz.total == pytest.approx(z3.total + hpz.hpz_secondary)
    assert est("zero.stage=3", "zero.hpz_partition_size=8", world=8).hpz_secondary == 0  # one group: no copy
    # DeepSpeed allocates the secondary partition in the parameters' dtype: an fp32 module's is fp32
    fp32 = est("zero.stage=3", "zero.hpz_partition_size=8", "train.precision=fp32")
    assert fp32.hpz_secondary == 4 * fp32.params / 8 and fp32.gathered_weights == 4 * (partitioned - in_buffers)
    # with the partitions offloaded, DeepSpeed puts the secondary partition in host memory too
    off = est("zero.stage=3", "zero.hpz_partition_size=8", "zero.offload_params=true")
    assert off.hpz_secondary == 0
    assert off.states["cpu"] == pytest.approx(est("zero.stage=3", "zero.offload_params=true").states["cpu"]
                                              + 2 * off.params / 8)
    assert est("zero.stage=2").gathered_weights == 0
    g14 = est("zero.stage=3", name="vit_gigantic_patch14_224", world=64)
    part = sum(memory.zero3_partitioned(memory.model_shape(ModelConfig(name="vit_gigantic_patch14_224")).tensors,
                                        100_000))
    assert 0 < g14.gathered_weights < 2 * part
