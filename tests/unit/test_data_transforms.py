"""Decoding and transforms: PIL draft mode keeps the result of a full decode, crops keep their
coordinates, Mixup/CutMix targets stay distributions."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from data_pipeline.loading.transforms import SampleTransform, mix_batch
from data_pipeline.shards.decode import draft, open_image
from data_pipeline.shards.demo_data import HUES, draw
from pretrain.config import AugmentConfig


def _big_smooth(fmt: str) -> bytes:
    img = draw("star", HUES["star"], np.random.default_rng(0)).resize((640, 480), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_draft_scales_jpeg_decode_only_when_enough_pixels_remain():
    img, sx, sy = draft(open_image({"jpg": _big_smooth("JPEG")}, 10**9), 160, 120)
    assert img.size == (160, 120) and sx == sy == 0.25
    img, sx, _ = draft(open_image({"jpg": _big_smooth("JPEG")}, 10**9), 400, 300)  # 1/2 would be too small
    assert img.size == (640, 480) and sx == 1.0
    img, sx, _ = draft(open_image({"png": _big_smooth("PNG")}, 10**9), 160, 120)  # PNG has no DCT scaling
    assert img.size == (640, 480) and sx == 1.0


def test_drafted_transforms_match_full_decode():
    jpeg, png = _big_smooth("JPEG"), _big_smooth("PNG")
    for train, aug in ((False, AugmentConfig()), (True, AugmentConfig(crop_scale=[0.3, 1.0]))):
        tf = SampleTransform(aug, 48, train=train)
        for seed in range(4):
            lazy = open_image({"jpg": jpeg}, 10**9)
            a = tf(lazy, seed)
            b = tf(open_image({"png": png}, 10**9), seed)  # same crop (same header size), full decode
            assert lazy.size[0] < 640, "draft mode was not used"
            assert a.shape == b.shape == (3, 48, 48) and a.dtype == torch.uint8
            assert (a.float() - b.float()).abs().mean() < 5, (train, seed)


def test_train_transform_is_a_function_of_the_seed():
    tf = SampleTransform(AugmentConfig(randaugment_ops=2), 32, train=True)
    png = _big_smooth("PNG")
    a, b, c = (tf(open_image({"png": png}, 10**9), s) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cutmix_targets_follow_the_pasted_area():
    x = torch.stack([torch.zeros(3, 16, 16), torch.ones(3, 16, 16)])
    y = torch.eye(2)
    for seed in range(5):
        mx, my = mix_batch(x, y, AugmentConfig(cutmix_alpha=1.0), seed)
        pasted = mx[0, 0].mean().item()  # image 0 is zeros: the ones came from image 1
        assert abs(my[0, 1].item() - pasted) < 1e-6 and torch.allclose(my.sum(1), torch.ones(2))
        mx, my = mix_batch(x, y, AugmentConfig(mixup_alpha=0.5), seed)
        assert torch.allclose(mx[0], torch.full_like(mx[0], my[0, 1].item()))


def test_crop_and_flip_draws_are_torchvisions():
    """The transform draws its crop box and flip from a generator of its own; they must be the
    values torchvision's ``RandomResizedCrop.make_params`` and ``RandomHorizontalFlip`` draw from
    torch's default generator under the same seed (exact resume and the sample log depend on it),
    for sizes that take the first try, many tries, and make_params' central-crop fallback."""
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    sizes = [(667, 500), (500, 667), (256, 341), (224, 224), (32, 24), (3, 2), (1, 1), (2000, 9), (9, 2000)]
    sizes += [(int(w), int(h)) for w, h in rng.integers(1, 1200, (30, 2))]
    for aug in (AugmentConfig(), AugmentConfig(crop_scale=[0.3, 0.9], crop_ratio=[0.5, 2.0], hflip=0.3)):
        tf = SampleTransform(aug, 224, train=True)
        ref = v2.RandomResizedCrop(224, scale=tuple(aug.crop_scale), ratio=tuple(aug.crop_ratio))
        fallbacks = 0
        for W, H in sizes:
            for seed in [int(s) for s in rng.integers(0, 2**63 - 1, 25)]:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    p = ref.make_params([torch.empty(1, 1, 1).expand(1, H, W)])
                    flip = bool(torch.rand(1) < aug.hflip)
                    after = torch.rand(1)  # where the default generator stands next (RandAugment's draws)
                gen = torch.Generator().manual_seed(seed)
                assert tf._draw(W, H, gen) == ((p["top"], p["left"], p["height"], p["width"]), flip), (W, H, seed)
                assert torch.equal(torch.rand(1, generator=gen), after)
                fallbacks += (p["top"], p["left"]) == ((H - p["height"]) // 2, (W - p["width"]) // 2)
        assert fallbacks > 0  # the long thin sizes reached the central-crop fallback


def test_resize_u8_is_torchvisions_resize():
    """``resize_u8`` calls the kernel torchvision's ``F.resize`` calls, for the layouts the loader
    gives it (HWC arrays from a decoder, CHW tensors)."""
    from torchvision.transforms.v2 import functional as F

    from data_pipeline.loading.transforms import resize_u8

    rng = np.random.default_rng(1)
    for h, w in [(300, 350), (224, 224), (37, 500), (500, 37), (1, 2), (225, 224)]:
        hwc = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for x in (hwc.permute(2, 0, 1), hwc.permute(2, 0, 1).contiguous(), hwc[:, ::1].permute(2, 0, 1)[:, :, 1:]):
            assert torch.equal(resize_u8(x, 224), F.resize(x, [224, 224], antialias=True)), (h, w, x.stride())
