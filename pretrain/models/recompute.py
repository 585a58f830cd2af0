"""Op-level selective activation checkpointing (``train.activation_checkpointing: selective``).

Each block runs under ``torch.utils.checkpoint`` with a policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of its matmuls (the
four linears) and of the fused attention kernel are kept from the forward, everything between them
(the LayerNorms, the head split and merge, GELU, dropout, stochastic depth, LayerScale, the
residual adds) is recomputed in the backward from the block's input and those outputs. The
backward thus repeats no matmul and no attention, only element-wise work (memory bound, a few
kernels), and a block keeps about 70 % of its activations (ViT-L/16 in bf16: its input,
q k v, the attention output and log-sum-exp, the projection, fc1 and fc2 outputs, ``22 s b h``
bytes against ``32 s b h``; ``pretrain.perf.memory``). It is torchtitan's op-level selective
checkpointing with every matmul kept (torchtitan recomputes every second one to save more); dropout
masks are recomputed from the same random state (``preserve_rng_state``, checkpoint's default), so
the step equals the one without checkpointing: bit for bit eager, and under ``torch.compile``
(whose partitioner takes the same policy) the compiled model's step to float rounding.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# the ops whose outputs a block keeps: the linears (addmm with a bias, mm without) and every fused
# attention kernel F.scaled_dot_product_attention may choose (the math fallback's matmuls are not
# kept: its s x s scores would cost more memory than the block saves)
SAVED_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(_aten, name))


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# one function object for every block and call: torch.compile guards on the context function
selective_context = functools.partial(create_selective_checkpoint_contexts, _policy)
