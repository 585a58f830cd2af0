"""``vit-launch plan``: the performance model (``pretrain/perf/perfmodel.py``) for one layout or a search.

    vit-launch plan --model NAME --gpu GPU --nodes N --gpus-per-node G --micro-batch B
                    [--global-batch GB] [--zero S] [--checkpointing] [--network PRESET] [--json]
    vit-launch plan --config FILE --world-size W --gpu GPU [a.b=c ...]
    vit-launch plan ... --search

With ``--config``, a run on fewer tokens (``train.resolution_schedule``, ``model.patch_drop_rate``)
is also priced phase by phase against every step at the model's resolution with every token.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Optional

from data_pipeline.errors import path_arg
from pretrain.config import ConfigError, compile_mode
from pretrain.perf import advice, hardware, inputs, memory, perfmodel

SUMMARY = ("predict images/s, MFU, memory and the bottleneck of a layout from the performance model "
           "(--search ranks layouts)")
DESCRIPTION = ("Predict a layout's images/s, MFU, step time, exposed communication, memory per GPU and bottleneck "
               "from the performance model (pretrain/perf/perfmodel.py), without a GPU; --search ranks the layouts "
               "that fit.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", type=path_arg,
                    help="YAML experiment file: model, batch, ZeRO and precision come from it")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides with --config, e.g. zero.stage=3")
    ap.add_argument("--model", help="registered model name (without --config), e.g. vit_large_patch16_224")
    ap.add_argument("--gpu", required=True, choices=sorted(hardware.GPUS), help="GPU type")
    ap.add_argument("--nodes", type=int, help="number of nodes (default 1, or --world-size / --gpus-per-node)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    ap.add_argument("--world-size", type=int, help="total GPUs (nodes = world / gpus-per-node)")
    ap.add_argument("--micro-batch", type=int,
                    help="images per GPU per forward/backward (default: the config's, else 32)")
    ap.add_argument("--global-batch", type=int,
                    help="images per optimizer step (default: the config's, else micro x world)")
    ap.add_argument("--img-size", type=int, help="input resolution (default: the model's)")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default: the config's, else 1)")
    ap.add_argument("--checkpointing", nargs="?", const="true", metavar="N|auto|selective",
                    help="activation checkpointing: every block (no value), the first N blocks, auto (the "
                         "fewest that fit the GPU's memory) or selective (every block op by op: matmul "
                         "outputs kept, element-wise work recomputed)")
    ap.add_argument("--compile", nargs="?", const="blocks", choices=["blocks", "model"],
                    help="torch.compile: each block (no value, or blocks) or the whole model")
    ap.add_argument("--reduce-dtype", choices=["fp32", "bf16"],
                    help="gradient reduction dtype (default: the config's, else fp32)")
    ap.add_argument("--hpz", type=int, help="ZeRO++ hpZ: secondary partition group size (stage 3)")
    ap.add_argument("--quantized-weights", action="store_true", help="ZeRO++ qwZ: int8 weight all-gather (stage 3)")
    ap.add_argument("--quantized-gradients", action="store_true", help="ZeRO++ qgZ: int4 gradient all-to-all (stage 3)")
    ap.add_argument("--no-leaf-blocks", action="store_true",
                    help="ZeRO-3 with DeepSpeed's hooks on every module (zero.leaf_blocks=false)")
    ap.add_argument("--network", choices=sorted(hardware.NETWORKS),
                    help="interconnect preset (default: dgx-a100 for A100s, dgx-h100 for H100/H200/B200, "
                         "else pcie-100gbe)")
    ap.add_argument("--intra-node-gbps", type=float,
                    help="GPU-to-GPU link inside a node, Gbit/s one way (overrides the preset)")
    ap.add_argument("--inter-node-gbps", type=float,
                    help="a node's NICs together, Gbit/s one way (overrides the preset)")
    ap.add_argument("--decode", choices=list(inputs.DECODE_PATHS),
                    help="where JPEGs are decoded (default: the config's data.decode_device, else cpu): loader "
                         "workers (cpu; decode_device worker), the GPU (cuda, dali) or each training process on "
                         "the CPU (rank; decode_device cpu)")
    ap.add_argument("--decode-rate", type=float, help="measured img/s per loader worker on that path "
                    "(benchmarks/loader_throughput.py on the training machine; default: pretrain/perf/inputs.py)")
    ap.add_argument("--cpu-cores", type=int, help="CPU cores per node for the loaders (default: the network preset's)")
    ap.add_argument("--loader-workers", type=int, help="loader workers per rank (data.workers; default: the config's, "
                    "or one per core the ranks leave free)")
    ap.add_argument("--stored-side", type=int, help="shorter side the shards store, px (default 256; "
                    "vit-shards --resize-shorter)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (with --search: a list)")
    ap.add_argument("--search", action="store_true",
                    help="rank ZeRO stage x micro batch x checkpointing x ZeRO++ layouts that fit, best first")
    ap.add_argument("--top", type=int, default=10, help="rows --search prints (default 10)")


# Layout fields as the flags that set them, for one-line errors
FLAGS = {"decode_rate": "--decode-rate", "cpu_cores": "--cpu-cores", "stored_side": "--stored-side",
         "loader_workers": "--loader-workers",
         "micro_batch": "--micro-batch", "global_batch": "--global-batch", "gpus_per_node": "--gpus-per-node",
         "nodes": "--nodes", "hpz_partition_size": "--hpz", "intra_node_gbps": "--intra-node-gbps",
         "inter_node_gbps": "--inter-node-gbps", "zero=": "--zero "}


def check_arguments(args) -> None:
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be >= 1")
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node), ("--top", args.top)):
        if value is not None and value < 1:  # before a world is divided by them (the layout's own wording)
            raise ConfigError(f"{flag} {value} (must be >= 1)")
    if args.img_size is not None and args.img_size <= 0:
        raise ConfigError(f"--img-size {args.img_size}: must be a positive number of pixels")
    if args.config:
        return
    if not args.model:
        raise ConfigError("give --model NAME or --config FILE")
    if args.overrides:
        raise ConfigError(f"config overrides {args.overrides[0]!r} need --config")
    from pretrain.models.arch import list_models

    if args.model not in list_models():
        raise ConfigError(f"--model {args.model!r} is not registered; known: {', '.join(list_models())}")


def layout(args) -> tuple[perfmodel.Layout, list, Optional[tuple[int, int]]]:
    """The layout the options describe (``check_arguments`` first) and, with ``--config``, the run's
    resolution phases (``pretrain.config.phases``; one without a schedule, none without a config)
    and its length (``train.steps``, the global batch); an impossible layout is a ``ConfigError`` in
    the flags' names."""
    try:
        return _layout(args)
    except ConfigError:
        raise
    except ValueError as e:  # an impossible layout: the model's message, in the flags' names
        msg = str(e)
        for field, flag in FLAGS.items():
            msg = msg.replace(field, flag if field.endswith("=") else flag + " ").replace(flag + " =", flag + " ")
        raise ConfigError(msg) from None


def _layout(args) -> tuple[perfmodel.Layout, list, Optional[tuple[int, int]]]:
    from pretrain.config import check_world_size, image_size, load_config
    from pretrain.config.phases import resolution_phases

    phases, length = [], None
    nodes, gpus_per_node = _nodes(args)
    if args.config:
        cfg = load_config(args.config, args.overrides)
        if args.micro_batch is None and args.global_batch is None:  # the config's batch on this world
            world = nodes * gpus_per_node
            try:
                check_world_size(cfg.train, world)  # says what to change, in the config's keys
            except ConfigError as e:
                if args.world_size or args.nodes:
                    raise
                raise ConfigError(f"{e} (world size {world}: one node of --gpus-per-node {gpus_per_node}; "
                                  "give --world-size or --nodes)") from None
        lay = perfmodel.layout_from_config(cfg, nodes=nodes, gpus_per_node=gpus_per_node, gpu=args.gpu,
                                           network=args.network)
        length = cfg.train.steps, cfg.train.global_batch_size
        if cfg.train.resolution_schedule or cfg.model.patch_drop_rate:
            phases = resolution_phases(cfg.train, image_size(cfg.model))
    else:
        net = args.network or hardware.default_network(args.gpu)
        lay = perfmodel.Layout(model=args.model, gpu=args.gpu, nodes=nodes, gpus_per_node=gpus_per_node, network=net)
    if args.img_size is not None:
        from pretrain.models.arch import img_size_problem

        problem = img_size_problem(lay.model, args.img_size)
        if problem:
            raise ConfigError(f"--img-size {args.img_size}: {problem}")
    kw = {k: v for k, v in dict(micro_batch=args.micro_batch, global_batch=args.global_batch, img_size=args.img_size,
                                zero=args.zero, reduce_dtype=args.reduce_dtype, hpz_partition_size=args.hpz,
                                network=args.network, intra_node_gbps=args.intra_node_gbps,
                                inter_node_gbps=args.inter_node_gbps, decode=args.decode, decode_rate=args.decode_rate,
                                cpu_cores=args.cpu_cores, stored_side=args.stored_side,
                                loader_workers=args.loader_workers).items() if v is not None}
    for flag, key in (("quantized_weights", "quantized_weights"), ("quantized_gradients", "quantized_gradients")):
        if getattr(args, flag):
            kw[key] = True
    if args.compile:
        kw["compile"] = args.compile
    if args.checkpointing is not None:
        kw["checkpointing"] = _checkpointing(args.checkpointing, replace(lay, **kw))
    if args.no_leaf_blocks:
        kw["leaf_blocks"] = False
    lay = replace(lay, **kw)
    try:
        lay.accumulation
    except ValueError as e:
        raise ConfigError(f"--global-batch / --micro-batch: {e}") from None
    if not args.config:  # training's default buckets (zero.*_bucket_size: auto), decided as training decides them
        lay = _auto_buckets(lay)
    if args.micro_batch is not None or args.img_size is not None:  # the flags describe one fixed layout
        phases = []
    return lay, phases, length


def _auto_buckets(lay: perfmodel.Layout) -> perfmodel.Layout:
    """``lay`` with the gradient and ZeRO-3 prefetch buckets that ``zero.reduce_bucket_size: auto``
    and ``zero.stage3_prefetch_bucket_size: auto`` (the config's defaults) choose for it
    (``pretrain.perf.levers.resolve_zero``)."""
    from types import SimpleNamespace

    from pretrain.distributed.config import ZeroConfig
    from pretrain.perf import levers

    shape = lay.shape()
    zero = ZeroConfig(stage=lay.zero, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto")
    train = SimpleNamespace(precision=lay.precision, reduce_dtype=lay.reduce_dtype)
    with_auto, _ = levers.resolve_zero(zero, train, shape.params, shape.block_params, lay.world,
                                       gpus_per_node=lay.gpus_per_node, gpu=lay.gpu, network=lay.network)
    return replace(lay, reduce_bucket_size=with_auto.reduce_bucket_size,
                   prefetch_bucket_size=with_auto.stage3_prefetch_bucket_size)


def _nodes(args) -> tuple[int, int]:
    """(nodes, GPUs per node) of ``--nodes``/``--gpus-per-node`` or ``--world-size``; a world smaller than
    one node's GPUs is one node of that many. Given both, they must agree."""
    gpn, world = args.gpus_per_node, args.world_size
    if world is None:
        return (1 if args.nodes is None else args.nodes), gpn
    if world < gpn:
        nodes, gpn = 1, world
    else:
        nodes, rest = divmod(world, gpn)
        if rest:
            raise ConfigError(f"--world-size {world} is not a multiple of --gpus-per-node {gpn}")
    if args.nodes is not None and args.nodes != nodes:
        raise ConfigError(f"--world-size {world} is {nodes} node(s) of {gpn} GPUs, not --nodes {args.nodes}: "
                          "give one of the two (with --gpus-per-node)")
    return nodes, gpn


def _checkpointing(value: str, lay: perfmodel.Layout):
    """``--checkpointing``'s value as the layout's block count (``auto``: the fewest that fit), or
    ``"selective"``."""
    from pretrain.config import ConfigError
    from pretrain.perf import memory

    depth = memory.analytic_shape(lay.model, img_size=lay.img_size, num_classes=lay.num_classes).depth
    if value == "true":
        return True
    if value == "selective":
        return value
    if value == "auto":
        return next((n for n in range(depth + 1) if perfmodel.predict(replace(lay, checkpointing=n)).fits), depth)
    if not value.isdigit() or int(value) > depth:
        raise ConfigError(f"--checkpointing {value}: expected a block count 0..{depth}, "
                          "'auto', 'selective' or no value (every block)")
    return int(value)


def checkpointing_cost(lay: perfmodel.Layout, p: perfmodel.Prediction) -> Optional[float]:
    """What the layout's activation checkpointing adds to its step time: its predicted step against
    the same layout's without checkpointing, whether or not that one fits (None: no checkpointing)."""
    if not lay.checkpointing:
        return None
    return p.step_seconds / perfmodel.predict(replace(lay, checkpointing=0)).step_seconds - 1


def lever_words(lay: dict, cost: Optional[float] = None) -> str:
    """The layout's speed levers in words: checkpointed blocks (and ``cost``, what they add to the
    step time), compile, reduction buckets."""
    from pretrain.perf import kernels, memory

    depth = memory.analytic_shape(lay["model"], img_size=lay["img_size"], num_classes=lay["num_classes"]).depth
    n = kernels.recomputed_blocks(depth, lay["checkpointing"])
    mode = compile_mode(lay["compile"], lay["zero"])  # what training compiles (ZeRO-3: the blocks)
    added = "" if cost is None else f"{cost:+.0%} step time"
    ckpt = (f"checkpointing every block op by op (selective{', ' + added if added else ''})"
            if lay["checkpointing"] == "selective"
            else f"checkpointing {n} of {depth} blocks" + (f" ({added})" if added else ""))
    return (f"{ckpt}, " + (f"compile {mode}" if mode else "eager")
            + (f", reduction buckets of {lay['reduce_bucket_size'] / 1e6:g}M elements" if lay["zero"] else ""))


def describe(p: perfmodel.Prediction, checkpointing: Optional[float] = None) -> str:
    """The prediction in lines; ``checkpointing``: what the layout's checkpointing adds to its step."""
    lay = p.layout
    mem = ", ".join(f"{k} {v:.1f}" for k, v in p.memory_gb_per_gpu.items() if k != "total")
    # every GB on this screen is 2^30 bytes, as the memory estimate, `vit-launch check` and
    # train/peak_memory_gb count it; the JSON keeps the bytes sent (comm_bytes_per_gpu)
    comm = ", ".join(f"{k} {v / memory.GB:.2f} GB" for k, v in p.comm_bytes_per_gpu.items()) or "none"
    k = p.layout["global_batch"] or lay["micro_batch"] * lay["nodes"] * lay["gpus_per_node"]
    return "\n".join([
        f"{lay['model']} on {lay['nodes']} x {lay['gpus_per_node']} {lay['gpu']} ({lay['network']}), "
        f"ZeRO-{lay['zero']}, micro batch {lay['micro_batch']}, global batch {k}, {lay['precision']}, "
        f"reduce {lay['reduce_dtype']}"
        + ("" if lay["zero"] != 3
           else ", leaf blocks" if lay["leaf_blocks"] or lay["compile"] else ", per-module hooks"),
        f"  levers          {lever_words(lay, checkpointing)}",
        f"  images/s        {p.images_per_second:,.0f}  ({p.images_per_second_per_gpu:,.1f} per GPU)",
        f"  MFU             {p.mfu:.1%}  (hardware {p.hfu:.1%})",
        f"  step            {p.step_seconds * 1e3:,.1f} ms: compute {p.compute_seconds * 1e3:,.1f} "
        f"(element-wise {p.elementwise_seconds * 1e3:,.1f}, waiting for kernel launches "
        f"{p.launch_seconds * 1e3:,.1f}" + (f", ZeRO-3 hooks on the host {p.zero3_hook_seconds * 1e3:,.1f}"
                                             f" and work beyond them {p.zero3_work_seconds * 1e3:,.1f}"
                                             if lay["zero"] == 3 else "")
        + f"), optimizer {p.optimizer_seconds * 1e3:,.1f}, "
        f"exposed comm {p.exposed_comm_seconds * 1e3:,.1f} of {p.comm_seconds * 1e3:,.1f}",
        f"  kernels         {p.kernels_per_step:,} per GPU per step",
        f"  sent per GPU    {comm} per step (GB of 2^30 bytes, as the memory below)",
        f"  input           {p.input_images_per_second:,.0f} img/s from the loaders ({p.input_limit} per node, "
        f"{lay['decode']} decode)" + (": INPUT-BOUND" if p.input_bound else ""),
        f"  memory per GPU  {p.memory_gb_per_gpu['total']:.1f} GB ({mem}) -> "
        + ("fits" if p.fits else "does NOT fit"),
        f"  bottleneck      {p.bottleneck}",
    ])


def token_table(price: perfmodel.TokenPrice) -> str:
    """A run on fewer tokens, phase by phase, and what it saves against every step at the model's
    resolution with every token."""
    fixed = price.fixed.layout
    world = fixed["nodes"] * fixed["gpus_per_node"]
    lines = [f"  fewer tokens    {price.steps:,} steps, the global batch the same in every phase:",
             f"    {'steps':>19}  {'px':>4}  {'micro':>5}  {'tokens':>6}  {'img/s':>10}  {'MFU':>6}  {'step ms':>8}  "
             f"{'hours':>8}  {'GPU-h':>9}  {'GB/GPU':>6}"]
    for r in price.phases:
        p = r.prediction
        lay = p.layout
        full = perfmodel.Layout(**lay).shape(r.img_size)
        shape = memory.trained_shape(full, None, lay["patch_drop_rate"])
        steps = f"{r.first:,}-{r.last:,}"  # tokens: the patch tokens the blocks see, the prefix not counted
        lines.append(f"    {steps:>19}  {r.img_size:>4}  {r.micro_batch:>5}  {shape.seq_len - shape.prefix_tokens:>6}  "
                     f"{p.images_per_second:>10,.0f}  {p.mfu:>6.1%}  {p.step_seconds * 1e3:>8,.1f}  "
                     f"{r.seconds / 3600:>8,.1f}  {r.seconds * world / 3600:>9,.0f}  "
                     f"{p.memory_gb_per_gpu['total']:>6.1f}")
    biggest = max(price.phases, key=lambda r: r.prediction.memory_gb_per_gpu["total"])
    lines += [f"    whole run (the steps alone): {price.seconds / 3600:,.1f} h "
              f"({price.seconds * world / 3600:,.0f} GPU-hours), "
              f"{price.flops:.3g} FLOPs; every step at {fixed['img_size']} px with every token: "
              f"{price.fixed_seconds / 3600:,.1f} h ({price.fixed_seconds * world / 3600:,.0f} GPU-hours), "
              f"{price.fixed_flops:.3g} FLOPs -> "
              f"{price.seconds / price.fixed_seconds:.2f}x the time, "
              f"{price.flops / price.fixed_flops:.2f}x the compute",
              f"    memory: the largest phase ({biggest.img_size} px, micro {biggest.micro_batch}) "
              f"{biggest.prediction.memory_gb_per_gpu['total']:.1f} GB per GPU -> "
              + ("fits" if price.fits else "does NOT fit")]
    return "\n".join(lines)


def _ckpt_word(value) -> str:
    return "sel" if value == "selective" else "on" if value else "off"


def table(rows: list[perfmodel.Prediction]) -> str:
    head = (f"{'rank':>4}  {'zero':>4}  {'micro':>5}  {'ckpt':>4}  {'hpz':>3}  {'qwZ':>3}  {'img/s':>10}  "
            f"{'MFU':>6}  {'GB/GPU':>6}  bottleneck")
    lines = [head]
    for i, p in enumerate(rows, 1):
        lay = p.layout
        lines.append(f"{i:>4}  {lay['zero']:>4}  {lay['micro_batch']:>5}  "
                     f"{_ckpt_word(lay['checkpointing']):>4}  "
                     f"{lay['hpz_partition_size']:>3}  {'on' if lay['quantized_weights'] else 'off':>3}  "
                     f"{p.images_per_second:>10,.0f}  {p.mfu:>6.1%}  {p.memory_gb_per_gpu['total']:>6.1f}  "
                     f"{p.bottleneck}")
    return "\n".join(lines)


def command(args) -> int:
    lay, phases, length = layout(args)
    if args.search:
        rows = advice.search(lay)
        if not rows:
            raise ConfigError(f"no layout of {lay.model} fits {hardware.gpu_of(lay).memory_gb:.0f} GB per GPU")
        rows = rows[:args.top]
        print(json.dumps([p.as_dict() for p in rows], indent=1) if args.json else table(rows))
        return 0
    p = perfmodel.predict(lay)
    cost = checkpointing_cost(lay, p)
    tokens = perfmodel.price_tokens(lay, phases) if phases else None
    run = run_cost(*length, p) if length and not tokens else None  # (a schedule's table prices its run)
    if args.json:
        print(json.dumps({**p.as_dict(), "levers": dict(advice.lever_gains(lay)), "checkpointing_cost": cost,
                          **({"tokens": tokens.as_dict()} if tokens else {}), **({"run": run} if run else {})},
                         indent=1))
        return 0
    print(describe(p, cost))
    if run:
        print(f"  run             {run['steps']:,} steps x {run['global_batch']:,} images (the config's): "
              f"{run['hours']:,.1f} h on {run['gpus']:,} GPUs, {run['gpu_hours']:,.0f} GPU-hours; the steps "
              f"alone, start-up, evaluations and checkpoint saves on top")
    gains = advice.lever_gains(lay)
    if gains:
        print("  other levers    " + "; ".join(f"{text} {ratio - 1:+.0%}" for text, ratio in gains))
    if tokens:
        print(token_table(tokens))
    return 0


def run_cost(steps: int, global_batch: int, p: perfmodel.Prediction) -> dict:
    """The config's whole run (``train.steps`` x its global batch: the images it trains on, whatever
    --micro-batch or --global-batch say) at the predicted img/s: hours and GPU-hours."""
    seconds = steps * global_batch / p.images_per_second
    gpus = p.layout["nodes"] * p.layout["gpus_per_node"]
    return {"steps": steps, "global_batch": global_batch, "gpus": gpus, "hours": seconds / 3600,
            "gpu_hours": seconds * gpus / 3600}
