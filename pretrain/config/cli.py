"""``vit-config``: validate an experiment config and print it resolved, or print the reference of
every key (``--reference``)."""
from __future__ import annotations

import yaml

from data_pipeline.errors import cli_errors
from pretrain.config.load import load_config, save_config, to_dict


def main(argv=None) -> None:
    """``vit-config --config FILE [a.b=c ...] [--output resolved.yaml]``: validate and print."""
    import argparse

    ap = argparse.ArgumentParser(prog="vit-config", description="Validate a config and print it resolved")
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--output", help="write the resolved config here instead of printing it")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    with cli_errors("vit-config"):
        cfg = load_config(args.config, args.overrides)
    if args.output:
        save_config(cfg, args.output)
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


if __name__ == "__main__":
    main()
