"""``vit-config``: validate an experiment config and print it resolved, or print the reference of
every key (``--reference``)."""
from __future__ import annotations

import yaml

from data_pipeline.errors import cli_errors
from data_pipeline.files import check_output_file, write_atomic
from pretrain.config.load import load_config, save_config, to_dict


def main(argv=None) -> None:
    """``vit-config --config FILE [a.b=c ...] [--output resolved.yaml]``: validate and print;
    ``vit-config --reference``: print the Markdown reference of every key."""
    import argparse

    ap = argparse.ArgumentParser(prog="vit-config", description="Validate a config and print it resolved")
    ap.add_argument("--config", help="YAML experiment file (required unless --reference)")
    ap.add_argument("--output", help="write the resolved config (or the reference) here instead of printing it")
    ap.add_argument("--reference", action="store_true",
                    help="print the reference of every config key (key, default, meaning) as Markdown")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    if args.output:
        with cli_errors("vit-config"):
            check_output_file(args.output)
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
    with cli_errors("vit-config"):
        cfg = load_config(args.config, args.overrides)
    if args.output:
        with cli_errors("vit-config"):
            save_config(cfg, args.output)
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


if __name__ == "__main__":
    main()
