"""Compute of a ViT training job in the performance model: one GPU's forward + backward of a
micro-batch and its optimizer step, in seconds.

Matmul work: every GEMM of the micro-step (each linear's forward, input gradient and weight
gradient, the patch embedding and the head; the blocks' forward again with activation
checkpointing, none under op-level checkpointing) at the rate its shape reaches
(``pretrain.perf.kernels.gemm_seconds``: a fixed cost per call, wave quantization over the GPU's
SMs, a fixed prologue/epilogue per tile, fitted to XLA's measured H100 GEMMs), and the fused
attention kernels at the plain rate. The rate's asymptote is ``peak x efficiency``, ``efficiency``
the one calibrated constant per GPU type (``pretrain.perf.hardware.GPUS``, each naming its
calibration point or the GPU it borrows from; ``pretrain.perf.published`` solves it). Element-wise
work (LayerNorms, GELU over the MLP width, residual adds, softmax without a fused attention kernel)
moves bytes, not flops: it is priced at :data:`HBM_EFFICIENCY` of the memory bandwidth plus each
kernel's launch gap, which is why narrow models (ViT-B) reach a lower MFU than wide ones and why
the gap grows on GPUs whose flops outgrew their bandwidth (H100 against A100). ``torch.compile``
fuses element-wise chains: half that traffic and half those kernels.
``train.precision=bf16-autocast`` keeps the LayerNorms and residual adds on an fp32 stream and
casts every weight to bf16 in each forward (6 B/param of traffic per micro-step).
``model.drop_rate`` and ``model.drop_path_rate`` add their masks' and products' traffic and, eager,
their kernels. The host issues every kernel (``pretrain.perf.kernels.host_seconds``) and runs
DeepSpeed's ZeRO-1/2 gradient handling, per parameter tensor (``engine_hook_seconds``); a
micro-step takes the longer of the GPU's time and the host's, so small micro-batches of narrow
models wait for kernel launches. Under ZeRO-3 the host's module hooks
(``pretrain.perf.kernels.zero3_hook_seconds``) and ZeRO-3's measured work beyond them
(``zero3_work_seconds``) add to the micro-step. Model FLOPs (MFU) stay ``analytic_flops`` x 2 x 3;
hardware FLOPs (HFU) add the recomputed forward (its matmuls: ``train.activation_checkpointing:
selective`` recomputes only element-wise work, which moves bytes, so its HFU is its MFU and its
cost is one more forward pass of element-wise traffic and kernels in every block). The optimizer
step reads and writes its fp32 states once per step (memory bound).

``layout`` is a ``pretrain.perf.perfmodel.Layout``; pure arithmetic, no torch import.
"""
from __future__ import annotations

from dataclasses import replace

from pretrain.config import compile_mode
from pretrain.models import arch
from pretrain.perf import kernels, memory
from pretrain.perf.collectives import GB, zero3_hooked
from pretrain.perf.hardware import gpu_of

# Element-wise kernels reach about this fraction of the HBM bandwidth on the data sheets
# (STREAM-like copy kernels measure 80-90 % on A100 and H100).
HBM_EFFICIENCY = 0.8
# Adam / AdamW step: read master, grad, m, v (4 x 4 B), write master, m, v (3 x 4 B) and the
# bf16 copy (2 B): bytes per parameter the step moves on its shard.
OPTIMIZER_BYTES_PER_PARAM = 30
# the element-wise traffic left by torch.compile (train.compile), against eager: each block's
# chains fused (LayerNorm with its cast, bias + GELU, residual adds) about two to one; the whole
# model also fuses the work between blocks (a block's last residual add into the next LayerNorm)
# and around them (patch embedding's add and concatenation, final norm, pooling, loss)
COMPILED_TRAFFIC = {"blocks": 0.5, "model": 0.45}
# the weights' EMA (train.ema_decay) after the step: read master and average, write the average
EMA_BYTES_PER_PARAM = 12
# model.drop_rate compiled: the draw and the product fuse into the neighbouring kernel; what is left
# is the one-byte mask, written forward and read backward (eager: ``_regulariser_bytes``)
DROPOUT_COMPILED_BYTES = 1


def _elementwise_elems(d: int, m: int, heads: int, s: int, fused_attention: bool) -> float:
    """Elements read + written per token per block by the forward's element-wise kernels in
    eager mode: two LayerNorms (read, write: 2 d each), the head split of q, k, v and the merge of
    the attention output (copies: 6 d + 2 d), two residual adds (read 2, write 1: 3 d each), the
    GELU over the MLP width (2 m); biases ride in the matmuls' epilogues. Without a fused
    attention kernel the scores are written, softmaxed (read, write) and read again by the
    product with V: 4 heads s per token."""
    return 18 * d + 2 * m + (0 if fused_attention else 4 * heads * s)


def _regulariser_bytes(layout, e: int, d: int, mlp: int, tokens: int, depth: int, recomputed: int,
                       drop_path_blocks: int, compiled: bool) -> float:
    """HBM bytes of ``model.drop_rate``'s dropout (three sites a block: 2 d + MLP width elements per
    token; forward, backward, the recomputed blocks' forward) and, eager, of stochastic depth (two
    residual branches of d per token and block: the product read and written forward and
    backward; compiled it fuses into the residual add). Eager, CUDA's fused dropout reads the
    input and writes the output and a one-byte mask, its backward reads the gradient and the mask
    and writes the gradient: ``2 e + 1`` bytes per element each way."""
    out = 0.0
    if layout.drop_rate > 0:
        per = DROPOUT_COMPILED_BYTES if compiled else 2 * e + 1
        out += per * (2 * d + mlp) * tokens * (2 * depth + recomputed)
    if drop_path_blocks and not compiled:
        out += 2 * d * 2 * e * tokens * (2 * drop_path_blocks + max(0, recomputed - (depth - drop_path_blocks)))
    return out


def compute_seconds(layout, images: int) -> dict[str, float]:
    """Seconds of one GPU's forward + backward over ``images`` images (one micro-batch), by part:
    ``matmul`` (every GEMM at its shape's rate and the attention kernels), ``elementwise`` (their
    bytes at HBM speed and each kernel's launch gap), ``gpu`` (the two), ``host`` (issuing the
    kernels), ``launch_wait`` (what the GPU waits for the host), ``zero3_hooks`` (ZeRO-3's module hooks
    on the host), ``zero3_work`` (ZeRO-3's work beyond them) and ``total``."""
    g = gpu_of(layout)
    a = arch.model_defaults(layout.model)
    img = layout.img_size or a["img_size"]
    parts = arch.analytic_flops(layout.model, img, layout.num_classes, breakdown=True,
                                patch_drop_rate=layout.patch_drop_rate, **layout.arch)
    full = layout.shape(img)
    shape = memory.trained_shape(full, None, layout.patch_drop_rate)  # the blocks' tokens
    d, s, depth = shape.width, shape.seq_len, shape.depth
    n = kernels.recomputed_blocks(depth, layout.checkpointing)  # blocks whose forward runs again
    again = kernels.forward_again_blocks(depth, layout.checkpointing)  # ... its element-wise work
    mode = compile_mode(layout.compile, layout.zero)
    model_flops = 6.0 * parts["total"] * images
    recompute = 2.0 * parts["blocks"] * images * n / depth
    mlp = shape.mlp_hidden or 4 * d
    peak = g.peak_tflops * 1e12

    def gemm(m, n, k):
        return kernels.gemm_seconds(m, n, k, peak, g.efficiency, g.sms)

    rows = images * s
    t_blocks = (n * sum(gemm(*mnk) for mnk in kernels.block_gemms(rows, d, mlp, True))
                + (depth - n) * sum(gemm(*mnk) for mnk in kernels.block_gemms(rows, d, mlp, False)))
    patches = full.seq_len - full.prefix_tokens  # the patch embedding sees every patch
    t_other = 2 * gemm(images * patches, d, parts["embed"] / (patches * d))  # patch embedding: forward, weights
    c = layout.num_classes
    t_other += gemm(images, c, d) + gemm(images, d, c) + gemm(c, d, images)  # head: forward, both gradients
    # fused attention: 2 s^2 d multiply-adds per image and block forward, twice that backward
    attn_flops = 2.0 * 2 * s * s * d * images * (3 * depth + n)
    drop_path_blocks = depth - 1 if layout.drop_path_rate > 0 else 0  # the first block's rate is 0
    n_kernels = kernels.kernels_per_micro_step(depth, layout.checkpointing, mode, layout.precision == "bf16-autocast",
                                               dropout=layout.drop_rate > 0, drop_path_blocks=drop_path_blocks)
    fixed = kernels.GEMM_FIXED_S if g.sms else 0.0
    t_attn = attn_flops / (peak * g.efficiency) + n_kernels["attention"] * fixed
    t_mm = t_blocks + t_other + t_attn
    e = memory.activation_dtype_bytes(layout.precision)
    token_bytes = _elementwise_elems(d, mlp, shape.heads, s, layout.fused_attention) * e
    passes = 3 + again / depth  # backward's element-wise traffic ~ twice the forward's; the recompute once more
    if layout.precision == "bf16-autocast":  # LayerNorms (4 d) and residual adds (6 d) on the fp32 stream
        token_bytes += 10 * d * 2
    elem_bytes = token_bytes * s * depth * images * passes * COMPILED_TRAFFIC.get(mode, 1.0)
    if layout.precision == "bf16-autocast":  # each weight cast to bf16 per forward (and recompute): read 4, write 2 B
        elem_bytes += 6 * shape.params * (images / layout.micro_batch) * (1 + again / depth)
    elem_bytes += _regulariser_bytes(layout, e, d, mlp, s * images, depth, again, drop_path_blocks, bool(mode))
    gaps = (n_kernels["elementwise"] + n_kernels["accumulate"]) * (kernels.KERNEL_GAP_SECONDS if g.sms else 0.0)
    t_mem = elem_bytes / (g.hbm_gbs * GB * HBM_EFFICIENCY) + gaps
    gpu = t_mm + t_mem
    host = kernels.host_seconds(n_kernels["total"], depth, n, mode)
    host += kernels.engine_hook_seconds(n_kernels["accumulate"], layout.precision, layout.zero)  # one per tensor
    hooks = work = 0.0
    if layout.zero == 3:  # paced with the GPU, so added to the step, not hidden under it
        modules = zero3_hooked(replace(layout, leaf_blocks=layout.leaf_blocks or bool(mode)))
        # selective: the recompute calls a leaf block's inner forward (no hooks), or every module's
        hooks = kernels.zero3_hook_seconds(modules, (n if layout.leaf_blocks or mode else again) / depth)
        work = kernels.zero3_work_seconds(gpu, shape.params)
    return {"matmul": t_mm, "elementwise": t_mem, "gpu": gpu, "host": host, "launch_wait": max(0.0, host - gpu),
            "zero3_hooks": hooks, "zero3_work": work, "total": max(gpu, host) + hooks + work,
            "kernels": n_kernels["total"],
            "model_flops": model_flops,
            "hardware_flops": model_flops + recompute}


def optimizer_seconds(layout, params: int) -> float:
    """The optimizer step on this rank's shard at HBM bandwidth, with the EMA's pass when on."""
    g = gpu_of(layout)
    shard = params / (layout.world if layout.zero >= 1 else 1)
    moved = OPTIMIZER_BYTES_PER_PARAM + (EMA_BYTES_PER_PARAM if layout.ema else 0)
    return moved * shard / (g.hbm_gbs * GB * HBM_EFFICIENCY)
