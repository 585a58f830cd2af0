"""Shared pytest setup. Everything runs on CPU; checks that need a GPU carry the `gpu` marker and
run only where CUDA is present (CI never has one)."""
import os

import pytest
import torch

# Keep test processes off the network and out of W&B's servers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (runs only where one is present)")
    config.addinivalue_line("markers", "slow: multi-process DeepSpeed runs (part of the default suite)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
