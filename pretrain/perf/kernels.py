"""What a training micro-step costs kernel by kernel: GEMMs priced by their shape, and the kernels a
ViT issues, each of which the host must launch. Numbers only, no torch.

GEMM time against shape (``gemm_seconds``): a GEMM of ``m x k`` by ``k x n`` takes

    GEMM_FIXED_S + 2 m n k x (1 + GEMM_TAIL x SMs / tiles) x (1 + GEMM_K_FILL / k) / (peak x efficiency)

with ``tiles = m n / (128 x 256)`` output tiles of cuBLAS's largest bf16 tile, times the pieces its k
loop is split into when there are fewer tiles than SMs (split-K, pieces of :data:`GEMM_SPLIT_K`).
The first factor is wave quantization smoothed over sizes (the last wave of tiles leaves SMs idle;
NVIDIA's "Matrix Multiplication Background" guide, section 3.2), the second the fixed prologue and
epilogue of every tile, whose main loop runs ``k`` steps. The constants are a least-squares fit (in
log time) to XLA's published table of measured bf16 GEMMs on H100 (openxla/xla,
``xla/service/gpu/model/matmul_interpolator_data.h``, ``sm_90``: the 98 shapes with batch 1 and m,
n, k from 256 to 4096): median error 2.5 %, 11 % at worst but for one split-K shape (256 x 256 x
4096, measured 55 % faster); the fit's asymptote is :data:`CUBLAS_EFFICIENCY` of the data-sheet
peak. Small GEMMs lose on all three terms: a ViT-B micro-batch of 8 images is 1,576 rows, and its
qkv GEMM runs at about 60 % of the rate the same GEMM reaches with 128 images. The model keeps the
fit's shape for every GPU type (with that type's SM count) and replaces the asymptote by the type's
calibrated efficiency.

Kernel launches (``host_seconds``): eager PyTorch issues every kernel from Python through the
dispatcher, autograd and ``cuLaunchKernel``; the GPU runs them asynchronously, so the host limits the
step only when it needs longer to issue a micro-step's kernels than the GPU needs to run them (small
micro-batches of narrow models). The counts are our model's own (:data:`BLOCK_KERNELS`, read off
``pretrain.models.vit`` with a dispatch mode in ``tests/unit/test_plan_properties.py``).

ZeRO-3 (``zero3_hook_seconds``, ``zero3_work_seconds``): DeepSpeed hooks every module that is not
inside a leaf module (pre/post forward and backward: trace, fetch, release), a fixed host cost per
hooked module whatever the micro-batch (``benchmarks/zero3_hooks.py`` fits it on the CPU at hand; the
partitioned tensors' count adds nothing measurable). It is not hidden behind the GPU's work: the fetch
waits on a CUDA event two fetches back (``PartitionedParameterCoordinator.fetch_sub_module``), so the
host cannot run far ahead. On a GPU that is not all: one H200 (bf16, one rank; ViT-L/16 at micro
batch 16 and 64, ViT-B/16 at 64; per-module hooks and leaf blocks:
benchmarks/results/zero3-leaf-blocks-h200.md) measured a ZeRO-3 step's extra over ZeRO-1 as the
hooks (the two hook layouts differ by 0.25-0.37 ms per hooked module, 0.32 on average) plus work
that grows with the micro-step's GPU time (about as much again) and with the parameters gathered
(0.13 ms per million). What that work is was not measured apart (one rank: no collective crosses a
link); the two terms are fitted on ViT-L/16's two leaf-block rows and predict the other four rows'
extra within 0.94-1.12x, and the H100's per-module row's (390.5 ms against ZeRO-1's 79.9) at 0.90x.
"""
from __future__ import annotations

# --- GEMM shape curve: fitted to XLA's H100 table (module docstring)
GEMM_FIXED_S = 5.16e-6  # launch, prologue and epilogue of one cuBLAS call (the smallest GEMMs take 5.9 us)
GEMM_TAIL = 0.128  # tiles per SM the last partial wave costs, averaged over sizes
GEMM_K_FILL = 217  # a tile's pipeline fill and epilogue, in steps of its k loop
GEMM_TILE = 128 * 256  # outputs per tile (cuBLAS's largest bf16 tile on A100 / H100)
GEMM_SPLIT_K = 3395  # with fewer tiles than SMs, cuBLAS splits the k loop into pieces of about this many
CUBLAS_EFFICIENCY = 0.970  # the fit's asymptote: large GEMMs, cuBLAS alone, of the data-sheet peak

# --- kernels per micro-step, eager, forward + backward (counted on pretrain.models.vit: see the test)
# A pre-norm block: 12 GEMMs (4 linears forward, their input and weight gradients), the fused attention
# forward and backward, 16 element-wise kernels (4 LayerNorm forward/backward, 2 GELU, 4 residual adds
# and gradient sums, 4 bias-gradient sums, the head-merge copy and the q/k/v gradient stack) and 12
# gradient accumulations, one per parameter tensor (plain PyTorch adds into .grad once it exists;
# DeepSpeed's gradient hooks copy each gradient into its buffer every micro-step).
BLOCK_KERNELS = {"gemm": 12, "attention": 2, "elementwise": 16, "accumulate": 12}
# activation checkpointing re-runs a block's forward up to the last tensor the backward needs
# (torch.utils.checkpoint stops early): qkv, proj, fc1, attention, both LayerNorms, GELU, one add;
# op-level (train.activation_checkpointing: selective, in every block) the element-wise ones alone
RECOMPUTE_KERNELS = {"gemm": 3, "attention": 1, "elementwise": 4}
SELECTIVE_RECOMPUTE_KINDS = ("elementwise",)
# outside the blocks: patch embedding forward + weight gradient, position add, class token, final
# LayerNorm, head (3 GEMMs), loss forward/backward, and their parameters' gradient accumulations
OTHER_KERNELS = {"gemm": 5, "attention": 0, "elementwise": 13, "accumulate": 8}
# train.precision=bf16-autocast adds dtype casts (weights, biases and activations to bf16 forward,
# gradients back to fp32 for the fp32 parameters): per block, again per recomputed block, and outside
AUTOCAST_CASTS = {"block": 23, "recompute": 10, "other": 3}
# torch.compile of each block (train.compile) fuses its element-wise kernels about two to one (an
# estimate, as for their traffic); the GEMMs and the attention kernel stay library calls, the gradient
# accumulations stay eager. Compiling the whole model (train.compile: model) fuses the element-wise
# work outside the blocks the same way and the block boundaries' residual add into the next norm.
COMPILED_ELEMENTWISE = 8
COMPILED_MODEL_OTHER_ELEMENTWISE = 6
# model.drop_rate, eager: each nn.Dropout is one kernel forward (CUDA's fused native_dropout writes
# the output and its mask) and one backward; three in a block (after the attention projection, the
# GELU and fc2), one outside it (after the position embedding). model.drop_path_rate,
# eager: each residual branch's per-image mask (bernoulli, scaled in place) and the product forward,
# the product backward. Compiled, both fuse into their neighbours' kernels.
DROPOUT_SITES = {"block": 3, "other": 1}
DROPOUT_KERNELS = {"forward": 1, "backward": 1}
DROP_PATH_KERNELS = {"forward": 3, "backward": 1}  # per residual branch, two a block

# --- host cost of issuing kernels
# Eager PyTorch, per kernel with the view ops around it: about 5-7 us for an autograd op from Python
# (pytorch/pytorch#41383: 7 us with requires_grad, 5 us without) plus cuLaunchKernel's 3 us
# (meta-pytorch/tritonbench#1017); Inductor's launcher costs the same per kernel (6.8-9.1 us there).
# This 2-vCPU machine measures 14 us per kernel for our block's forward + backward at a trivial size.
HOST_SECONDS_PER_KERNEL = 8e-6
# a compiled region's call beyond its kernels: guards, device guard, AOTAutograd's wrapper (44 us for
# a one-kernel graph in tritonbench#1017 less that kernel's launch); once forward, once backward
COMPILED_CALL_HOST_SECONDS = 37e-6
# DeepSpeed's own host work per parameter tensor and micro-step beyond autograd's accumulation, by
# (train.precision, ZeRO stage): ZeRO-2's gradient hook copies each gradient into its bucket and
# books it; bf16 ZeRO-1 is the BF16_Optimizer, which accumulates at its step; bf16-autocast ZeRO-1's
# optimizer hooks each gradient too (as does fp32's, the same optimizer). benchmarks/engine_host.py
# measures 24-31, 2-4 and 11-18 us (bf16-autocast ZeRO-2 25) on a 2-vCPU machine that issues a
# kernel in 14 us; scaled here to the 8 us of a GPU machine's host.
ENGINE_HOOK_SECONDS = {("bf16", 1): 1.5e-6, ("bf16", 2): 16e-6, ("bf16-autocast", 1): 8e-6,
                       ("bf16-autocast", 2): 14e-6, ("fp32", 1): 8e-6, ("fp32", 2): 14e-6}
# what every other kernel costs the GPU beyond its work when issued back to back: the launch latency
# between kernels (NVIDIA's "Getting Started with CUDA Graphs": a 2.9 us kernel takes 3.8 us per
# launch in a stream)
KERNEL_GAP_SECONDS = 1e-6


def gemm_seconds(m: float, n: float, k: float, peak_flops: float, efficiency: float, sms: int) -> float:
    """Seconds of one GEMM ``(m x k) @ (k x n)``, or of ``k`` summed products for a weight gradient.
    ``sms == 0`` (a device whose tiles are not modelled, e.g. a CPU priced as a GPU type): flops at
    ``peak x efficiency``, no shape term."""
    flops = 2.0 * m * n * k
    if not sms:
        return flops / (peak_flops * efficiency)
    tiles = m * n / GEMM_TILE
    tiles *= max(1.0, min(k / GEMM_SPLIT_K, sms / tiles))  # split-K: work units for idle SMs
    shape = (1 + GEMM_TAIL * sms / tiles) * (1 + GEMM_K_FILL / k)
    return GEMM_FIXED_S + flops * shape / (peak_flops * efficiency)


def block_gemms(rows: int, width: int, mlp: int, recompute: bool = False) -> list[tuple[int, int, int]]:
    """The ``(m, n, k)`` of a block's GEMMs in one micro-step of ``rows`` tokens (images x sequence):
    each linear's forward, input gradient and weight gradient, plus the forward again when
    ``recompute`` (priced as the whole forward: the GPU suite's checkpointed steps cost more than the
    early-stopped recompute's flops)."""
    out = []
    for n, k in ((3 * width, width), (width, width), (mlp, width), (width, mlp)):
        out += [(rows, n, k), (rows, k, n), (n, k, rows)]
        if recompute:
            out.append((rows, n, k))
    return out


def recomputed_blocks(depth: int, checkpointing) -> int:
    """Blocks whose forward is recomputed whole in the backward: ``checkpointing`` as a block count
    (``True`` all of them; ``"selective"`` none: no matmul or attention runs again)."""
    if checkpointing == "selective":
        return 0
    return depth if checkpointing is True else max(0, min(int(checkpointing or 0), depth))


def forward_again_blocks(depth: int, checkpointing) -> int:
    """Blocks whose forward's element-wise work (norms, GELU, dropout, adds) runs again in the
    backward: the recomputed blocks, or every block under ``"selective"``."""
    return depth if checkpointing == "selective" else recomputed_blocks(depth, checkpointing)


def kernels_per_micro_step(depth: int, checkpointing=False, compile=False, autocast: bool = False,
                           dropout: bool = False, drop_path_blocks: int = 0) -> dict[str, int]:
    """Kernels one GPU issues per micro-step, by kind, and their ``total``. ``checkpointing``: the
    blocks recomputed (``True`` all; ``"selective"``: every block's element-wise kernels alone);
    ``compile``: ``"blocks"`` (or ``True``), ``"model"`` or off; ``autocast``:
    ``train.precision=bf16-autocast``'s casts, in the element-wise count (fused away when
    compiled); ``dropout`` (``model.drop_rate > 0``) and ``drop_path_blocks`` (the blocks whose
    stochastic depth rate is above 0), in the element-wise count when eager."""
    n = forward_again_blocks(depth, checkpointing)
    selective = checkpointing == "selective"
    mode = "blocks" if compile is True else (compile or "")
    out = {}
    for kind in ("gemm", "attention", "elementwise", "accumulate"):
        plain, extra = BLOCK_KERNELS[kind], RECOMPUTE_KERNELS.get(kind, 0)
        if selective and kind not in SELECTIVE_RECOMPUTE_KINDS:
            extra = 0
        other = OTHER_KERNELS[kind]
        if kind == "elementwise" and mode:
            plain, extra = COMPILED_ELEMENTWISE, RECOMPUTE_KERNELS[kind] // 2
            if mode == "model":
                other = COMPILED_MODEL_OTHER_ELEMENTWISE
        elif kind == "elementwise" and autocast:
            plain, extra = plain + AUTOCAST_CASTS["block"], extra + AUTOCAST_CASTS["recompute"]
            other += AUTOCAST_CASTS["other"]
        out[kind] = depth * plain + n * extra + other
        if kind == "elementwise" and not mode:
            out[kind] += dropout_kernels(depth, n, dropout, drop_path_blocks)
    out["total"] = sum(out.values())
    return out


def dropout_kernels(depth: int, recomputed: int, dropout: bool, drop_path_blocks: int) -> int:
    """Eager kernels of ``model.drop_rate`` (its sites in every block and outside them; the
    ``recomputed`` blocks' forward again) and of stochastic depth in the last ``drop_path_blocks``
    blocks (its rate rises from 0 at the first block; checkpointing recomputes the first blocks)."""
    out = 0
    if dropout:
        sites = depth * DROPOUT_SITES["block"] + DROPOUT_SITES["other"]
        out += sites * (DROPOUT_KERNELS["forward"] + DROPOUT_KERNELS["backward"])
        out += recomputed * DROPOUT_SITES["block"] * DROPOUT_KERNELS["forward"]
    if drop_path_blocks:
        again = max(0, recomputed - (depth - drop_path_blocks))
        out += 2 * drop_path_blocks * (DROP_PATH_KERNELS["forward"] + DROP_PATH_KERNELS["backward"])
        out += 2 * again * DROP_PATH_KERNELS["forward"]
    return out


def host_seconds(kernels: int, depth: int, checkpointing=False, compile=False) -> float:
    """Seconds the host needs to issue one micro-step's ``kernels``: each kernel's launch and each
    compiled region's call (a block's forward, its backward and its recompute; the whole model's
    forward and backward once)."""
    mode = "blocks" if compile is True else (compile or "")
    calls = 2 if mode == "model" else 2 * depth + recomputed_blocks(depth, checkpointing) if mode else 0
    return kernels * HOST_SECONDS_PER_KERNEL + calls * COMPILED_CALL_HOST_SECONDS


def engine_hook_seconds(tensors: int, precision: str, stage: int) -> float:
    """Host seconds DeepSpeed's ZeRO-1/2 gradient handling adds to one micro-step of ``tensors``
    parameter tensors (:data:`ENGINE_HOOK_SECONDS`; none at ZeRO-0, ZeRO-3 has its own term)."""
    key = (precision if precision in ("bf16", "bf16-autocast") else "fp32", stage)
    return tensors * ENGINE_HOOK_SECONDS.get(key, 0.0)


# --- ZeRO-3 (module docstring), fitted on the H200 rows: per hooked module, the mean of the
# per-module-hooks less leaf-blocks difference over the extra modules of the three pairs; the
# compute factor and the cost per gathered parameter from ViT-L/16's leaf-block rows at micro batch
# 16 and 64 (extra over ZeRO-1 75.8 and 138.8 ms, the hooks taken off).
ZERO3_MODULE_SECONDS = 0.3196e-3
ZERO3_COMPUTE_FACTOR = 1.016  # seconds of ZeRO-3 work per second of the micro-step's GPU time
ZERO3_PARAM_SECONDS = 0.130e-3 / 1e6  # per parameter gathered in a micro-step


def zero3_work_seconds(gpu_seconds: float, params: int) -> float:
    """Seconds ZeRO-3 adds to one micro-step beyond its hooks: in proportion to the micro-step's GPU
    time (``gpu_seconds``, recompute included) and to the ``params`` gathered."""
    return ZERO3_COMPUTE_FACTOR * gpu_seconds + ZERO3_PARAM_SECONDS * params


def zero3_hook_seconds(modules: int, checkpointing, module_s: float = ZERO3_MODULE_SECONDS) -> float:
    """Host seconds ZeRO-3 adds to one micro-step of ``modules`` hooked modules (forward and backward
    hooks; activation checkpointing runs the forward's again, half as much once more).
    ``checkpointing``: on or off, or the share of the blocks recomputed."""
    share = 1.0 if checkpointing is True else float(checkpointing or 0)
    return modules * module_s * (1.0 + 0.5 * min(share, 1.0))
