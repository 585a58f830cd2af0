"""FLOP accounting: fvcore counts, an analytic formula that agrees with them, the device's peak, MFU.

Convention (fvcore's, and the one papers quote for ViT "GFLOPs"): one multiply-add = one flop.
fvcore skips ``aten::scaled_dot_product_attention``; we add a handle so attention is counted
(Q K^T and A V: 2 * N^2 * D multiply-adds per layer). Norm layers count 5 per element, as fvcore
(so ``qk_norm`` adds 2 x 5 N D per block: its LayerNorms over queries and keys). Element-wise ops
are not counted, as fvcore: residual adds, GELU, and LayerScale's per-channel multiply (``init_values``).

Training cost (for MFU) uses 2 flops per multiply-add and backward = 2 x forward, so
``train_flops_per_image = 6 * forward_macs``. Activation checkpointing re-runs the blocks'
forward in backward: that work is *hardware* FLOPs (HFU), not model FLOPs (MFU).
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from data_pipeline.errors import Parser
from pretrain.models.arch import analytic_flops, img_size_problem, list_models, model_defaults
from pretrain.models.vit import VisionTransformer, create_model


def _sdpa_flop_jit(inputs, outputs) -> int:
    """aten::scaled_dot_product_attention(q, k, v, ...): Q K^T plus A V multiply-adds."""
    from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(inputs[i]) for i in range(3))
    *batch, nq, d = q
    nk, dv = k[-2], v[-1]
    b = math.prod(batch)
    return b * nq * nk * d + b * nq * nk * dv


def _count_input(model: torch.nn.Module, img_size) -> torch.Tensor:
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    p = next(model.parameters())
    return torch.zeros(1, 3, h, w, device=p.device, dtype=p.dtype)


def forward_flops(model: VisionTransformer, img_size=None, by_module: bool = False, train: bool = False):
    """Forward multiply-adds of one image, counted by fvcore with attention included.

    A model built on the meta device is materialised (uninitialised) on a copy first, so the
    largest variants can be counted without initialising their weights.
    ``by_module=True`` returns fvcore's per-module dict instead of the total. ``img_size``: another
    resolution than the model's is counted as training runs it (position embeddings resampled).
    ``train=True``: a training forward (patch dropout on; the tokens it keeps are counted).
    """
    from fvcore.nn import FlopCountAnalysis

    img_size = img_size or model.img_size
    if next(model.parameters()).is_meta:
        model = copy.deepcopy(model).to_empty(device="cpu")
    was_training = model.training
    model.train(train)
    try:
        fca = FlopCountAnalysis(model, (_count_input(model, img_size),))
        fca.set_op_handle("aten::scaled_dot_product_attention", _sdpa_flop_jit)
        fca.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
        return dict(fca.by_module()) if by_module else int(fca.total())
    finally:
        model.train(was_training)


# -------------------------------------------------------------------------------- training/MFU
def train_flops_per_image(forward_macs: float, recompute_macs: float = 0.0) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) for one image's forward + backward.

    Model FLOPs: 2 flops per multiply-add, backward twice the forward -> 6 x forward_macs.
    Hardware FLOPs add the forward re-run by activation checkpointing (2 x recompute_macs).
    """
    model = 6.0 * forward_macs
    return model, model + 2.0 * recompute_macs


def peak_tflops(device_name: Optional[str] = None) -> Optional[float]:
    """Dense bf16 peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), from the performance
    model's GPU table (``pretrain.perf.hardware``), so measured and predicted MFU divide by the same
    peak; None for a device not in it."""
    from pretrain.perf.hardware import GPUS, gpu_key

    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    key = gpu_key(device_name)
    return GPUS[key].peak_tflops if key else None


def mfu(flops_per_image: float, images_per_sec_per_device: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: achieved FLOP/s per device over the device's peak (fraction)."""
    if not peak:
        return None
    return flops_per_image * images_per_sec_per_device / (peak * 1e12)


def main(argv=None) -> None:
    ap = Parser(prog="vit-flops", description="Forward GFLOPs (multiply-adds) of a ViT variant")
    ap.add_argument("model", choices=list_models())
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--fvcore", action="store_true", help="also count with fvcore (builds the model)")
    args = ap.parse_args(argv)
    defaults = model_defaults(args.model)
    img = defaults["img_size"]
    if args.img_size is not None:  # as training's model.img_size
        problem = img_size_problem(args.model, args.img_size)
        if problem:
            ap.error(f"--img-size {args.img_size}: {problem}")
        img = args.img_size
    if args.num_classes < 0:
        ap.error(f"--num-classes {args.num_classes}: must be >= 0 (0: no head)")
    an = analytic_flops(args.model, img, args.num_classes)
    print(f"{args.model} @ {img}: analytic {an / 1e9:.2f} GFLOPs")
    if args.fvcore:
        with torch.device("meta"):
            m = create_model(args.model, img_size=img, num_classes=args.num_classes)
        print(f"fvcore {forward_flops(m) / 1e9:.2f} GFLOPs")


if __name__ == "__main__":
    main()
