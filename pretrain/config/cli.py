"""``vit-config``: validate an experiment config and print it resolved, the DeepSpeed config a run
of it will use (``--deepspeed``), or the reference of every key (``--reference``).

An entry point on the top floor: ``--deepspeed`` reads ``pretrain.distributed.engine``."""
from __future__ import annotations

import contextlib
import io

import yaml

from data_pipeline.errors import Parser, cli_errors, path_arg
from data_pipeline.files import check_output_file, write_atomic
from pretrain.config.load import load_config, save_config, to_dict


def main(argv=None) -> None:
    """``vit-config --config FILE [a.b=c ...] [--output resolved.yaml]``: validate and print;
    ``--deepspeed --world-size N``: print the DeepSpeed JSON config instead; ``vit-config
    --reference``: print the Markdown reference of every key."""
    ap = Parser(prog="vit-config", description="Validate a config and print it resolved")
    ap.add_argument("--config", type=path_arg, help="YAML experiment file (required unless --reference)")
    ap.add_argument("--output", type=path_arg,
                    help="write the resolved config (or the reference) here instead of printing it")
    ap.add_argument("--reference", action="store_true",
                    help="print the reference of every config key (key, default, meaning) as Markdown")
    ap.add_argument("--deepspeed", action="store_true",
                    help="print the DeepSpeed JSON config a run of this config on --world-size ranks will use")
    ap.add_argument("--world-size", type=int, help="ranks of the run, for --deepspeed (it sets the accumulation)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    if args.output:
        with cli_errors("vit-config"):
            check_output_file(args.output, {"--config": args.config})
    if args.reference:
        from pretrain.config.reference import reference

        if args.config or args.overrides:
            ap.error("--reference takes no --config or overrides: it describes the defaults")
        if args.output:
            with cli_errors("vit-config"):
                write_atomic(args.output, reference())
        else:
            print(reference(), end="")
        return
    if not args.config:
        ap.error("the following arguments are required: --config (or give --reference)")
    if args.world_size is not None and args.world_size < 1:
        ap.error(f"--world-size {args.world_size}: must be >= 1")
    if args.deepspeed and args.world_size is None:
        ap.error("--deepspeed needs --world-size N: the ranks set the gradient accumulation")
    if args.world_size is not None and not args.deepspeed:  # the resolved config holds no world size
        ap.error("--world-size is for --deepspeed (the DeepSpeed JSON of a run on that many ranks)")
    with cli_errors("vit-config"):
        cfg = load_config(args.config, args.overrides)
    if args.deepspeed:
        import json

        from pretrain.distributed.engine import check_with_deepspeed, deepspeed_config
        from pretrain.perf import levers

        with cli_errors("vit-config"):
            # the buckets `auto` picks for this model on a ring of that many ranks (8 per node)
            cfg, _ = levers.resolve(cfg, args.world_size, gpus_per_node=8)
            ds = deepspeed_config(cfg.optim, cfg.train, cfg.zero, args.world_size, cfg.deepspeed)
            # DeepSpeed logs to stdout (its accelerator guess on a machine without a GPU, say): the JSON
            # alone goes there, and a refusal is the one line of check_with_deepspeed
            with contextlib.redirect_stdout(io.StringIO()):
                check_with_deepspeed(ds)
            text = json.dumps(ds, indent=2) + "\n"
            if args.output:
                write_atomic(args.output, text)
            else:
                print(text, end="")
        return
    if args.output:
        with cli_errors("vit-config"):
            save_config(cfg, args.output)
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


if __name__ == "__main__":
    main()
