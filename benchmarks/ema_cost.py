"""What the weights' EMA (``train.ema_decay``) costs per optimizer step, against the step itself.

    python benchmarks/ema_cost.py                      # CPU: ViT-S/16 at 224, micro batch 8, about 2 min
    python benchmarks/ema_cost.py --model vit_large_patch16_224 --micro 32 --precision bf16   # on a GPU

One process, a world of one (DeepSpeed on its accelerator: gloo on a CPU, NCCL on a GPU), one engine
(our ``initialize``, ZeRO-1, AdamW) stepping the same micro-batch. In interleaved rounds it times the
training step (forward, backward, the optimizer step) and the EMA's update after it
(``WeightEma.update``: one lerp over the rank's fp32 master partition), each to the device's
completion (``synced_now``), and prints the medians and ``ratio = EMA update / step``. A world of one
holds every master weight: on N ranks the update covers 1/N of them while the step does not shrink
as much, so the ratio here is the most the EMA costs. On a GPU it also prints the performance
model's prediction of the update (``EMA_BYTES_PER_PARAM`` at the device's memory bandwidth).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16-autocast"])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    from pretrain.config.schema import OptimConfig, TrainConfig
    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.ema import WeightEma
    from pretrain.distributed.engine import initialize
    from pretrain.distributed.precision import compute_dtype
    from pretrain.distributed.process import init_distributed
    from pretrain.models.vit import create_model
    from pretrain.observability.clock import synced_now

    init_distributed()  # a world of one on a free port, the accelerator's backend
    model = create_model(args.model, img_size=args.img, num_classes=1000, init_seed=0)
    params = sum(p.numel() for p in model.parameters())
    train = TrainConfig(steps=10 ** 6, global_batch_size=args.micro, micro_batch_size=args.micro,
                        precision=args.precision, activation_checkpointing=False)
    engine, _ = initialize(model, OptimConfig(lr=1e-4, warmup_steps=0), train, ZeroConfig(stage=1), world_size=1)
    ema = WeightEma(engine, 0.9999)
    dev = engine.device
    x = torch.randn(args.micro, 3, args.img, args.img, device=dev).to(compute_dtype(args.precision))
    y = torch.randint(0, 1000, (args.micro,), device=dev)
    steps, updates = [], []
    for r in range(args.rounds + 2):  # two rounds of warm-up
        t0 = synced_now(dev)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
        t1 = synced_now(dev)
        ema.update(r + 1)
        t2 = synced_now(dev)
        if r >= 2:
            steps.append(t1 - t0)
            updates.append(t2 - t1)
    step, update = statistics.median(steps), statistics.median(updates)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.model} at {args.img} px, micro batch {args.micro}, {args.precision}, ZeRO-1, 1 rank, {device}: "
          f"{params / 1e6:.1f}M parameters")
    print(f"step {step * 1e3:.1f} ms, EMA update {update * 1e3:.2f} ms (median of {args.rounds})")
    print(f"ratio = EMA update / step = {update / step:.4f}")
    if torch.cuda.is_available():
        from pretrain.perf.collectives import GB
        from pretrain.perf.compute import EMA_BYTES_PER_PARAM, HBM_EFFICIENCY
        from pretrain.perf.hardware import gpu_key, gpu_of
        from pretrain.perf.perfmodel import Layout

        key = gpu_key(torch.cuda.get_device_name())
        if key:
            g = gpu_of(Layout(args.model, key, gpus_per_node=1))
            predicted = EMA_BYTES_PER_PARAM * params / (g.hbm_gbs * GB * HBM_EFFICIENCY)
            print(f"performance model: EMA update {predicted * 1e3:.2f} ms on {key} "
                  f"(measured / predicted = {update / predicted:.2f})")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
