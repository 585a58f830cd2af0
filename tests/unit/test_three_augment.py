"""3-Augment (``data.augment.three_augment``) against DeiT III's composition (deit/augment.py's
``new_data_aug_generator``; DeiT is not installed, so its few classes are re-implemented here from
their code: each one a PIL call, composed as DeiT III composes them, with torchvision's
``ColorJitter`` itself). Our ops run on uint8 tensors; for the same draws their pixels are PIL's,
bit for bit, and the draws are distributed as DeiT III's."""
from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter, ImageOps
from torchvision import transforms
from torchvision.transforms import functional as TF

from data_pipeline.errors import ConfigError
from data_pipeline.loading import three_augment as T
from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.shards.decode import open_image
from pretrain.config import AugmentConfig, load_config

RNG = np.random.default_rng(0)


def _images():
    """Noise and smooth pictures, square, thin and tiny (the box filter's edge cases)."""
    for h, w in [(224, 224), (48, 64), (7, 300), (300, 5), (2, 3), (1, 1)]:
        noise = RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
        yield noise
        yield np.asarray(Image.fromarray(noise).filter(ImageFilter.GaussianBlur(3)))


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).permute(2, 0, 1).contiguous()


def _pixels(img: Image.Image) -> torch.Tensor:
    return _tensor(np.asarray(img.convert("RGB")))


# DeiT III's ops (deit/augment.py, at p=1.0: RandomChoice picks one, then it always applies)
def deit_grayscale(img):
    return transforms.Grayscale(3)(img)


def deit_solarization(img):
    return ImageOps.solarize(img)


def deit_blur(img, radius):
    return img.filter(ImageFilter.GaussianBlur(radius=radius))


def test_each_op_is_pils_pixel_for_pixel():
    """Grayscale, solarize, blur (DeiT III's radii, their ends and float32 draws between) and the
    three colour-jitter adjustments (at factors across and beyond 0.7..1.3), image by image."""
    sigmas = [0.1, 2.0, 0.5, 1.0] + [float(torch.empty(1).uniform_(0.1, 2.0)) for _ in range(4)]
    factors = [0.7, 1.3, 1.0, 0.0, 2.5] + [float(torch.empty(1).uniform_(0.7, 1.3)) for _ in range(4)]
    for a in _images():
        img, x = Image.fromarray(a), _tensor(a)
        assert torch.equal(T.grayscale(x), _pixels(deit_grayscale(img)))
        assert torch.equal(T.solarize(x), _pixels(deit_solarization(img)))
        for s in sigmas:
            assert torch.equal(T.gaussian_blur(x, s), _pixels(deit_blur(img, s))), (a.shape, s)
        for f in factors:
            assert torch.equal(T.brightness(x, f), _pixels(TF.adjust_brightness(img, f))), (a.shape, f)
            assert torch.equal(T.contrast(x, f), _pixels(TF.adjust_contrast(img, f))), (a.shape, f)
            assert torch.equal(T.saturation(x, f), _pixels(TF.adjust_saturation(img, f))), (a.shape, f)


def _op_draws_then(seed: int) -> tuple:
    """(op, radius, generator state after them): where ColorJitter's draws start."""
    gen = torch.Generator().manual_seed(seed)
    op = int(torch.randint(0, 3, (1,), generator=gen))
    radius = float(torch.empty(1).uniform_(0.1, 2.0, generator=gen)) if op == 2 else 0.0
    return op, radius, gen.get_state()


def test_the_composition_is_deit_iiis_for_the_same_draws():
    """For a fixed choice of op (and blur radius), DeiT III's secondary transforms, ``RandomChoice``
    of the three then torchvision's ``ColorJitter(0.3, 0.3, 0.3)`` drawing from the stream where our
    op draws left it, give our pixels on both paths (PIL's calls on the CPU, the tensor ops on a
    GPU); and our jitter draws are ``ColorJitter.get_params``' own."""
    jitter = transforms.ColorJitter(0.3, 0.3, 0.3)
    ops = Counter()
    pictures = list(_images())[:4]
    for seed in range(60):
        a = pictures[seed % 4]
        img, x = Image.fromarray(a), _tensor(a)
        d = T.draw(torch.Generator().manual_seed(seed))
        op, radius, state = _op_draws_then(seed)
        assert (d.op, d.radius) == (op, radius)
        ops[op] += 1
        chosen = (deit_grayscale, deit_solarization, lambda im: deit_blur(im, radius))[op](img)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.set_state(state)
            order, b, c, s, _ = transforms.ColorJitter.get_params(jitter.brightness, jitter.contrast,
                                                                  jitter.saturation, None)
            torch.random.default_generator.set_state(state)
            want = jitter(chosen)
        assert d.order == tuple(order.tolist()) and d.factors == (b, c, s)
        assert torch.equal(T.apply_pil(x, d), _pixels(want)), seed  # a CPU sample's path
        assert torch.equal(T.apply_tensor(x, d), _pixels(want)), seed  # a GPU sample's path
    assert min(ops.values()) >= 10  # every op was compared


def test_draws_are_distributed_as_deit_iiis():
    """One op of three uniformly (DeiT III: ``RandomChoice``), the blur's radius uniform on
    0.1..2 (``random.uniform``), every jitter order and factors uniform on 0.7..1.3."""
    draws = [T.draw(torch.Generator().manual_seed(s)) for s in range(3000)]
    ops = Counter(d.op for d in draws)
    assert set(ops) == {0, 1, 2} and all(abs(n - 1000) < 100 for n in ops.values()), ops
    radii = np.array([d.radius for d in draws if d.op == 2])
    assert radii.min() >= 0.1 and radii.max() <= 2.0 and abs(radii.mean() - 1.05) < 0.05
    assert all(d.radius == 0.0 for d in draws if d.op != 2)
    factors = np.array([d.factors for d in draws])
    assert factors.min() >= 0.7 and factors.max() <= 1.3 and np.allclose(factors.mean(0), 1.0, atol=0.01)
    assert len({d.order for d in draws}) == 24


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(next(_images())).save(buf, "PNG")
    return buf.getvalue()


def test_the_sample_transform_applies_it_after_the_crop_and_flip():
    """In the loader's transform, 3-Augment takes the cropped and flipped uint8 sample and draws
    from the sample's stream where the crop and flip left it: a function of the seed, on the CPU
    or replayed for a deferred decode."""
    plain = SampleTransform(AugmentConfig(), 32, train=True)
    three = SampleTransform(AugmentConfig(three_augment=True), 32, train=True)
    data = _png()
    assert three.replays and not plain.replays
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        three._draw(224, 224, gen)
        want = T.apply(plain(open_image({"png": data}, 10**9), seed), T.draw(gen))
        assert torch.equal(three(open_image({"png": data}, 10**9), seed), want)


def test_the_config_refuses_it_beside_randaugment():
    assert load_config(None, ["data.augment.three_augment=true"]).data.augment.three_augment
    with pytest.raises(ConfigError, match="data.augment.three_augment: replaces RandAugment"):
        load_config(None, ["data.augment.three_augment=true", "data.augment.randaugment_ops=2"])
