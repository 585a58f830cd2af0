"""``python -m pretrain.transfer`` = ``vit-transfer``."""
import gc

if __name__ == "__main__":
    gc.disable()  # while importing; main() turns it back on (pretrain/perf/collector.py)
    from pretrain.transfer.cli import command

    command()
