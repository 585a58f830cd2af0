"""``train.compile``: regional compilation of each Transformer block's forward (inductor; on CPU it
needs a C++ compiler). Five steps compiled and eager give the same losses (1e-4 relative), with
ZeRO 0 and 3 (each block a leaf module, named in DeepSpeed's config), both with activation
checkpointing on, and dynamo never hits its recompile limit (it did under ZeRO-3 while its
per-Linear hooks were traced). ZeRO 1-2 compile the blocks exactly as ZeRO 0 does (``compile_blocks``
is the same at every stage; only stage 3's config differs); the GPU suite's smoke test compiles them
without checkpointing."""
import pytest


def losses(job):
    r = job.run(timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recompile_limit" not in r.stderr and "recompile limit" not in r.stderr, r.stderr[-3000:]
    m = job.metrics()
    return [m[s]["loss"] for s in sorted(m)]


CKPT = ("train.activation_checkpointing=true",)


@pytest.mark.parametrize("stage, extra", [(0, CKPT), (3, CKPT)])
def test_compiled_blocks_match_eager(tiny_run, stage, extra):
    five = ("train.steps=5", "train.log_every_steps=1", f"zero.stage={stage}", *extra)
    eager = losses(tiny_run(*five, name="eager"))
    compiled = losses(tiny_run(*five, "train.compile=true", name="compiled"))
    assert len(eager) == len(compiled) == 5
    assert compiled == pytest.approx(eager, rel=1e-4), (eager, compiled)
    assert eager[-1] < eager[0]  # it trains


def test_compile_blocks_in_place_keeps_names():
    from deepspeed.utils.z3_leaf_module import z3_leaf_module

    from pretrain.distributed.engine import compile_blocks
    from pretrain.models.vit import create_model

    model = create_model("vit_tiny_patch16_224", num_classes=10, img_size=32)
    names = list(model.state_dict())
    assert compile_blocks(model) == 12
    assert list(model.state_dict()) == names  # checkpoints and exports unchanged
    # ZeRO-3's leaves (each block gathered whole, one eager hook pair around the compiled forward)
    # are DeepSpeed's to flag, from the config (tests/unit/test_engine.py), at any stage the same code
    assert not any(z3_leaf_module(m) for m in model.modules())


def test_zero3_compiled_keeps_the_plain_linear():
    """zero.Init's memory-efficient F.linear (an autograd.Function reading each weight's ZeRO status)
    made dynamo recompile per Linear on torch 2.11; compiled ZeRO-3 blocks gather whole, so it is
    turned off there, and only there."""
    from pretrain.config import load_config
    from pretrain.distributed.engine import deepspeed_config
    from pretrain.perf import levers

    def zero_section(*overrides):
        c = levers.resolve(load_config("configs/tiny_cpu.yaml", ["zero.stage=3", *overrides]), 1)[0]
        return deepspeed_config(c.optim, c.train, c.zero, 1)["zero_optimization"]

    assert zero_section("train.compile=true")["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in zero_section()  # DeepSpeed's default otherwise
