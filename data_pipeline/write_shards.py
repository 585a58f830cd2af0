"""``python -m data_pipeline.write_shards ...`` = ``vit-shards ...``: the shard writer at its
documented path (``data_pipeline/shards/``)."""
from data_pipeline.shards.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
