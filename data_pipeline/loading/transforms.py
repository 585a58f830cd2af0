"""Image transforms (torchvision.transforms.v2) with per-sample seeding, draft-mode decoding, and
batch-level Mixup/CutMix.

Pre-training: the ViT paper's Inception-style random resized crop + horizontal flip, optionally
RandAugment (AugReg) or DeiT III's 3-Augment (``three_augment.py``). Evaluation: resize the shorter
side to ``img_size / eval_crop_pct``, center crop. Each sample's randomness comes from a seed
derived from its identity (see ``plan.mix_seed``): the crop box and flip are drawn from a generator
of the transform's own, seeded with it, by the calls ``RandomResizedCrop`` and
``RandomHorizontalFlip`` make (so the same values); 3-Augment continues that stream, RandAugment
continues it on torch's default generator inside ``fork_rng``. The caller's RNG stream is untouched
(this matters with ``workers=0``, where transforms run in the training process), and augmentation
is reproducible on resume, whichever worker decodes the sample.

Decoding cost: the crop is chosen from the JPEG header's size *before* decoding. Then, with
``data.worker_decoder: nvimgcodec`` (``shards/crop_decode.py``), only the crop's rows and columns
of a plain JPEG (RGB or grey, baseline, no EXIF rotation, intact markers) are decoded, with the
same pixels as that window of a full decode (for most such files one walk over the markers gives
the size, without PIL: :meth:`SampleTransform.window_sample`); otherwise PIL decodes the whole
image, in draft mode at 1/2..1/8 scale whenever the crop still has at least ``img_size`` pixels
per side. Either way the crop box and every other draw are the same. Resizing runs on uint8 tensors
(torch's vectorised antialiased kernel); samples leave the worker as uint8, and the training
process normalises and mixes the batch (``batch.decode.BatchDecoder``).
"""
from __future__ import annotations

import math
import platform
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from data_pipeline.loading import three_augment
from data_pipeline.shards import crop_decode
from data_pipeline.shards.decode import draft, exif_orientation, load_rgb, oriented_size


@dataclass
class Deferred:
    """A JPEG that the training process decodes (``data.decode_device``: cpu, cuda or dali), with what its
    worker drew for it from the sample's seed."""
    data: Optional[bytes]  # the file (None once packed into its batch: see ``span``)
    size: tuple  # (W, H) from the header
    box: Optional[tuple]  # training: the crop (top, left, h, w) in the full image; None: evaluation
    flip: bool
    seed: int  # the sample's seed: RandAugment replays from it
    span: Optional[tuple] = None  # (start, end) of the file in its batch's ``blob``
    counted: bool = True  # a failure to decode counts as corrupt (False: counted on an earlier pass)


# torchvision resizes uint8 bilinearly with torch's own uint8 kernel on these CPUs (else in float32)
_NATIVE_U8_RESIZE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
    or platform.machine() in ("aarch64", "arm64")


def resize_u8(x: torch.Tensor, size: int) -> torch.Tensor:
    """``F.resize(x, [size, size], antialias=True)`` of a uint8 (3, h, w) CPU tensor: the same
    ``interpolate`` call on the same strides, without torchvision's dispatch in front of it;
    torchvision's own call where it would resize in float32."""
    c, h, w = x.shape
    if not _NATIVE_U8_RESIZE:
        return F.resize(x, [size, size], antialias=True)
    if (h, w) == (size, size):
        return x
    image = x.reshape(1, c, h, w)
    strides = image.stride()
    if image.is_contiguous(memory_format=torch.channels_last) and x.numel() != strides[0]:
        # as torchvision does: a (1, C, H, W) channels-last view whose batch stride says so, so that
        # the output is channels-last too
        image = image.as_strided((1, c, h, w), (x.numel(),) + strides[1:])
    out = torch.nn.functional.interpolate(image, size=[size, size], mode="bilinear", align_corners=False,
                                          antialias=True)
    return out.reshape(c, size, size)


def ends_at_eoi(data: bytes) -> bool:
    """Whether a JPEG ends with its End Of Image marker (zero padding after it allowed)."""
    return data[-64:].rstrip(b"\x00").endswith(b"\xff\xd9")


class SampleTransform:
    """lazy PIL image (header parsed) + seed -> uint8 tensor (3, img_size, img_size). ``window``:
    decode only the crop window of plain JPEGs (``data.worker_decoder: nvimgcodec``)."""

    def __init__(self, aug, img_size: int, train: bool, window: bool = False):
        self.size = int(img_size)
        self.train = train
        self.window = window
        if not train:
            self.resize = int(round(self.size / aug.eval_crop_pct))
        else:
            self.crop = v2.RandomResizedCrop(self.size, scale=tuple(aug.crop_scale), ratio=tuple(aug.crop_ratio),
                                             antialias=True)
            self.hflip = aug.hflip
            # the float32 logs RandomResizedCrop keeps and make_params passes to uniform_
            self._log_ratio = [float(x) for x in torch.log(torch.tensor(self.crop.ratio))]
            self.randaug = v2.RandAugment(num_ops=aug.randaugment_ops, magnitude=aug.randaugment_magnitude) \
                if aug.randaugment_ops > 0 else None
            self.three_augment = aug.three_augment

    @property
    def replays(self) -> bool:
        """Whether a sample has ops after its crop and flip, drawn from its seed (:meth:`replay`)."""
        return self.train and (self.randaug is not None or self.three_augment)

    def _draw(self, W: int, H: int, gen: torch.Generator) -> tuple[tuple[int, int, int, int], bool]:
        """The sample's crop box (top, left, h, w) in a W x H image and its flip, drawn from ``gen``
        (seeded by the caller) in a fixed order: the calls and
        arithmetic of ``RandomResizedCrop.make_params``, then ``RandomHorizontalFlip``'s draw
        (tests/unit/test_data_transforms.py compares them); RandAugment draws next."""
        area = H * W
        scale, log_ratio = self.crop.scale, self._log_ratio
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=gen).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=gen)).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= W and 0 < h <= H:
                top = torch.randint(0, H - h + 1, size=(1,), generator=gen).item()
                left = torch.randint(0, W - w + 1, size=(1,), generator=gen).item()
                break
        else:  # make_params' fallback: a central crop
            in_ratio = float(W) / float(H)
            if in_ratio < min(self.crop.ratio):
                w, h = W, int(round(W / min(self.crop.ratio)))
            elif in_ratio > max(self.crop.ratio):
                h, w = H, int(round(H * max(self.crop.ratio)))
            else:
                w, h = W, H
            top, left = (H - h) // 2, (W - w) // 2
        flip = self.hflip > 0 and bool(torch.rand(1, generator=gen) < self.hflip)  # as v2.RandomHorizontalFlip draws
        return (top, left, h, w), flip

    def _seeded(self, seed: int) -> torch.Generator:
        """This transform's generator, seeded with ``seed`` (made on first use in each process)."""
        gen = self.__dict__.get("_gen")
        if gen is None:
            gen = self._gen = torch.Generator()
        return gen.manual_seed(seed)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_gen", None)  # a generator is made afresh where the transform is used
        return state

    def _post(self, out: torch.Tensor, flip: bool, gen: torch.Generator) -> torch.Tensor:
        """Flip, then the sample's ops drawing from where ``gen`` stands: 3-Augment's, then
        RandAugment's (on torch's default generator, which ``v2.RandAugment`` uses, inside
        ``fork_rng``); the configuration allows one of the two."""
        if flip:
            out = out.flip(-1)
        if self.three_augment:
            out = three_augment.apply(out, three_augment.draw(gen))
        if self.randaug is None:
            return out
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.set_state(gen.get_state())
            return self.randaug(out)

    def replay(self, x: torch.Tensor, item: "Deferred") -> torch.Tensor:
        """The ops after the crop and flip (3-Augment or RandAugment) on the cropped (and flipped)
        sample ``x`` of ``item``, on its device, drawn where the sample's own stream stands after its
        crop and flip draws (replayed from its seed)."""
        gen = self._seeded(item.seed)
        self._draw(*item.size, gen)
        return self._post(x, False, gen)

    def window_sample(self, data: bytes, seed: int, max_pixels: int) -> Optional[torch.Tensor]:
        """The training sample of ``data`` when it is a JPEG that ``crop_decode.window_size`` reads
        (no PIL: one walk over its markers gives the size and the plain-file verdict) and the window
        decoder decodes; the same tensor as :meth:`__call__` gives for it. None (nothing counted):
        any other file, one over ``max_pixels`` or PIL's own limit, and one the decoder refuses; then
        the caller opens it with PIL and calls :meth:`__call__`, which decides as before."""
        if not (self.train and self.window):
            return None
        size = crop_decode.window_size(data)
        if size is None:
            return None
        W, H = size
        bomb = Image.MAX_IMAGE_PIXELS
        if W * H > max_pixels or (bomb is not None and W * H > 2 * bomb):  # open_image's verdicts
            return None
        gen = self._seeded(seed)
        return self._window(data, *self._draw(W, H, gen), gen)

    def _window(self, data: bytes, box: tuple, flip: bool, gen: torch.Generator) -> Optional[torch.Tensor]:
        """The crop ``box`` of JPEG ``data`` decoded alone, resized (as ``F.resized_crop`` does after
        its crop) and post-processed; None when the window decoder refuses the file."""
        pixels = crop_decode.decoder()(data, *box)
        if pixels is None:
            return None
        return self._post(resize_u8(torch.from_numpy(pixels).permute(2, 0, 1), self.size), flip, gen)

    def __call__(self, img: Image.Image, seed: int, data: Optional[bytes] = None) -> torch.Tensor:
        """``data``: the file ``img`` was opened from; with it (and ``window``) a plain JPEG's crop
        window alone is decoded, and a file that decoder refuses goes through PIL as before."""
        if not self.train:
            return self._eval(img)
        gen = self._seeded(seed)
        # The crop is drawn on the size as displayed (EXIF orientation 5..8 swaps it).
        if img.format == "JPEG":
            # from the header (the orientation sits before the pixel data), before decoding
            W, H = oriented_size(img)
            (top, left, h, w), flip = self._draw(W, H, gen)
            if data is not None and self.window and img.mode in ("RGB", "L") \
                    and exif_orientation(img) == 1 and crop_decode.plain(data):
                out = self._window(data, (top, left, h, w), flip, gen)
                if out is not None:
                    return out
            r = min(w, h) / self.size  # how much smaller the decode may be with no loss
            img, _, _ = draft(img, math.ceil(img.size[0] / r), math.ceil(img.size[1] / r))
            rgb = load_rgb(img)  # oriented; drafted images are smaller than (W, H)
        else:
            # PNG/WebP: decoded first, which costs nothing (no draft mode), since a PNG may carry
            # its orientation in a chunk after the pixel data, known only once decoded
            rgb = load_rgb(img)
            W, H = rgb.size
            (top, left, h, w), flip = self._draw(W, H, gen)
        sx, sy = rgb.size[0] / W, rgb.size[1] / H
        if sx != 1.0 or sy != 1.0:
            top, left = int(top * sy), int(left * sx)
            h = max(1, min(rgb.size[1] - top, round(h * sy)))
            w = max(1, min(rgb.size[0] - left, round(w * sx)))
        # uint8 tensor resize: torch's antialiased bilinear kernel is about 1.7x faster than PIL's
        out = F.resized_crop(F.pil_to_tensor(rgb), top, left, h, w, [self.size, self.size], antialias=True)
        return self._post(out, flip, gen)

    # ---------------------------------------- data.decode_device: the training process decodes
    def defer(self, img: Image.Image, data: bytes, seed: int, counted: bool = True) -> "Deferred | None":
        """For a JPEG the training process can decode as it is (baseline, RGB or grey, no EXIF
        rotation, at most ``(4 * img_size)^2`` pixels, ending in its EOI marker), what it needs: the
        file and what this sample drew. None: decode it here (:meth:`__call__`). Progressive JPEGs
        stay here because nvJPEG's hardware engine takes baseline only; large ones because draft
        mode decodes them here at 1/2..1/8 scale, and the cap bounds what a batch's decode needs on
        the GPU (3 bytes a pixel). A file without EOI at its end is most likely cut short: PIL
        rejects it here, where nvJPEG's batched decode, which parses only the header before it
        starts, may not fail on it (NVIDIA/DALI#3113) and would train on a half-grey image."""
        w, h = img.size
        if img.format != "JPEG" or img.mode not in ("RGB", "L") or img.info.get("progressive") \
                or w * h > (4 * self.size) ** 2 or exif_orientation(img) != 1 or not ends_at_eoi(data):
            return None
        if not self.train:
            return Deferred(data, img.size, None, False, seed, counted=counted)
        box, flip = self._draw(*img.size, self._seeded(seed))
        return Deferred(data, img.size, box, flip, seed, counted=counted)

    def finish(self, pixels: torch.Tensor, item: "Deferred") -> torch.Tensor:
        """Decoded uint8 (3, H, W) of ``item``, on any device -> uint8 (3, size, size): what
        :meth:`__call__` gives for the same sample (identical when no draft decode applied there)."""
        if item.box is None:
            return F.center_crop(F.resize(pixels, self.resize, antialias=True), [self.size, self.size])
        top, left, h, w = item.box
        out = F.resized_crop(pixels, top, left, h, w, [self.size, self.size], antialias=True)
        out = out.flip(-1) if item.flip else out
        return self.replay(out, item) if self.replays else out

    def _eval(self, img: Image.Image) -> torch.Tensor:
        w, h = img.size
        r = min(w, h) / self.resize
        img, _, _ = draft(img, math.ceil(w / r), math.ceil(h / r))
        x = F.pil_to_tensor(load_rgb(img))
        return F.center_crop(F.resize(x, self.resize, antialias=True), [self.size, self.size])


def mix_labelled(images: torch.Tensor, targets: torch.Tensor, aug, seed: int, num_classes: int):
    """:func:`mix_batch` for a batch's own targets: integer class labels become one-hot rows first."""
    if targets.dtype == torch.int64:
        targets = torch.nn.functional.one_hot(targets, num_classes).float()
    return mix_batch(images, targets, aug, seed)


def mix_batch(images: torch.Tensor, targets: torch.Tensor, aug, seed: int):
    """Mixup / CutMix (AugReg) on a normalised batch with float (B, C) targets, pairing each sample
    with the batch reversed. Own code rather than ``v2.MixUp/CutMix`` because those accept only
    integer class labels, and multi-hot (JFT-style) targets need the same mixing. When both are on,
    each batch picks one with equal odds (timm's convention)."""
    rng = np.random.default_rng(seed)
    use_cutmix = aug.cutmix_alpha > 0 and (aug.mixup_alpha <= 0 or rng.random() < 0.5)
    alpha = aug.cutmix_alpha if use_cutmix else aug.mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    flipped = images.flip(0)
    if use_cutmix:
        H, W = images.shape[-2:]
        cut = math.sqrt(1.0 - lam)
        ch, cw = int(H * cut), int(W * cut)
        cy, cx = int(rng.integers(H)), int(rng.integers(W))
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, H)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, W)
        images = images.clone()
        images[:, :, y0:y1, x0:x1] = flipped[:, :, y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / float(H * W)  # the box was clipped: use its true area
    else:
        images = images.mul(lam).add_(flipped, alpha=1.0 - lam)
    return images, targets.mul(lam).add_(targets.flip(0), alpha=1.0 - lam)
