"""The straggler clock's ``gather`` hooks sit on the modules DeepSpeed's ZeRO-3 hooks and on no
module inside a ZeRO-3 leaf (a leaf fetches its whole subtree's weights in one hook; a compiled
block must keep no hook of ours in its traced code)."""
import torch
from deepspeed.utils import set_z3_leaf_modules

from pretrain.distributed.ds_compat import around_zero3_fetch
from pretrain.models.vit import create_model
from pretrain.perf.collectives import BLOCK_MODULES, OTHER_MODULES


def _count_calls(model) -> tuple[int, list]:
    calls = []
    n = around_zero3_fetch(model, lambda: calls.append("before"), lambda: calls.append("after"))
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    return n, calls


def test_gather_hooks_on_every_module_or_stop_at_leaf_blocks():
    plain = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, init_seed=0)
    n, calls = _count_calls(plain)
    assert n == sum(1 for _ in plain.modules()) == OTHER_MODULES + 12 * BLOCK_MODULES
    leafy = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, init_seed=0)
    set_z3_leaf_modules(leafy, [type(leafy.blocks[0])])
    n_leaf, leaf_calls = _count_calls(leafy)
    assert n_leaf == OTHER_MODULES + 12
    # each hooked module that runs a forward calls before, then after: paired, nothing from inside a block
    assert leaf_calls == ["before", "after"] * (len(leaf_calls) // 2) and 0 < len(leaf_calls) < len(calls)
    assert len(leaf_calls) // 2 <= n_leaf
