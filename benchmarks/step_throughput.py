"""Training-step throughput of our ViT against timm's model of the same config, same process.

    python benchmarks/step_throughput.py                       # CPU: ViT-S/16 @ 224, batch 8
    python benchmarks/step_throughput.py --model vit_large_patch16_224 --batch 64   # on a GPU

Each iteration is forward + backward + AdamW step. The two models alternate iteration by
iteration (so clock drift, thermal state and other load hit both alike) and the median step time
of each is compared. Prints ``ratio = ours / timm`` (target <= 1.0: ours no slower). On a GPU it
also runs bf16 autocast and prints images/s, TFLOP/s and MFU of our model (target for ViT-L/16:
MFU >= 50% on one H100), with FLOPs from ``pretrain.observability.flops`` (6 x forward multiply-adds).
"""
from __future__ import annotations

import argparse
import statistics

import torch


def make(kind: str, name: str, img: int, device, ckpt: bool):
    if kind == "ours":
        from pretrain.models.vit import create_model

        m = create_model(name, img_size=img, num_classes=1000)
    else:
        import timm

        m = timm.create_model(name, img_size=img, num_classes=1000, pretrained=False)
    m.set_grad_checkpointing(ckpt)
    m = m.to(device).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    return m, opt


def step_fn(model, opt, x, y, device):
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else torch.autocast("cpu", enabled=False))

    def go():
        with amp:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return go


def timed(fn, device) -> float:
    from pretrain.observability.clock import synced_now

    t = synced_now(device)
    fn()
    return synced_now(device) - t  # a sync point: the step is done only when the GPU is


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--grad-checkpointing", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("vit_base_patch16_224" if cuda else "vit_small_patch16_224")
    batch = args.batch or (128 if cuda else 8)
    torch.manual_seed(0)
    x = torch.randn(batch, 3, args.img, args.img, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    fns = {k: step_fn(*make(k, name, args.img, device, args.grad_checkpointing), x, y, device)
           for k in ("ours", "timm")}
    for _ in range(args.warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(args.iters):
        for k, f in fns.items():
            times[k].append(timed(f, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} threads={torch.get_num_threads()} "
          f"model={name} img={args.img} batch={batch} precision={'bf16' if cuda else 'fp32'} "
          f"grad_ckpt={args.grad_checkpointing} iters={args.iters}")
    for k in fns:
        print(f"  {k:5s} median step {med[k] * 1e3:8.1f} ms   {batch / med[k]:8.1f} img/s")
    print(f"ratio ours/timm step time = {med['ours'] / med['timm']:.3f}  (target <= 1.0)")
    if cuda:
        from pretrain.models.arch import analytic_flops
        from pretrain.observability.flops import peak_tflops, train_flops_per_image

        f_model, _ = train_flops_per_image(analytic_flops(name, args.img))
        peak = peak_tflops()
        tflops = f_model * batch / med["ours"] / 1e12
        print(f"ours: {tflops:.1f} TFLOP/s per device" + (f", MFU {tflops / peak:.1%} of {peak:.0f}" if peak else ""))


if __name__ == "__main__":
    main()
