"""FLOP counting at its documented path: ``pretrain.flops.forward_flops(model, img_size=...)``
(fvcore's convention, attention included; ``pretrain/observability/flops.py``)."""
from pretrain.models.arch import analytic_flops
from pretrain.observability.flops import forward_flops, main, mfu, peak_tflops, train_flops_per_image

__all__ = ["analytic_flops", "forward_flops", "mfu", "peak_tflops", "train_flops_per_image"]

if __name__ == "__main__":
    main()
