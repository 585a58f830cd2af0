"""vitscale data pipeline: shard writing (``write_shards``), the streaming loader (``loader``),
transforms, dataset readers (``sources``) and the built-in demo dataset (``demo_data``).

Imports stay lazy here so ``vit-shards`` starts without importing torch.
"""
