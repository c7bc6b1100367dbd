"""A 70B-class decoder's train state, abstract: for planning and simulating at scale, never
allocated.

The state is shaped like Llama 2 70B: d_model 8192, 80 stacked layers, 64 query heads and 8
key/value heads of 128, a gated MLP of 28672, a vocabulary of 32000 (69.0B parameters), with bf16
params, fp32 AdamW moments (mu, nu) and the step count: about 690 GB, held as ``ShapeDtypeStruct``
leaves in NNX variables that carry logical axis names.

``profile`` is the planner's view of the same model, computed from the shapes (a transformer's
FLOPs are twice its multiply-adds), since lowering 80 layers of this size only to read XLA's cost
analysis would say the same thing more slowly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import tenplex_jax as tj


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    layers: int = 80
    d_model: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    d_ff: int = 28672
    vocab: int = 32000
    seq_len: int = 4096


LLAMA_70B = LLMConfig()

# The default axes (pipe, data, fsdp, tensor): layers over pipe, embed over fsdp, the rest over
# tensor.
LLM_RULES = (
    ("layers", "pipe"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def params(cfg: LLMConfig = LLAMA_70B) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical names) of the decoder's params, layers stacked."""
    L, D, H, K, E, F, V = (
        cfg.layers,
        cfg.d_model,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab,
    )
    return {
        "embed": ((V, D), ("vocab", "embed")),
        "attn_norm": ((L, D), ("layers", "embed")),
        "wq": ((L, D, H, E), ("layers", "embed", "heads", None)),
        "wk": ((L, D, K, E), ("layers", "embed", "kv_heads", None)),
        "wv": ((L, D, K, E), ("layers", "embed", "kv_heads", None)),
        "wo": ((L, H, E, D), ("layers", "heads", None, "embed")),
        "mlp_norm": ((L, D), ("layers", "embed")),
        "w_gate": ((L, D, F), ("layers", "embed", "mlp")),
        "w_up": ((L, D, F), ("layers", "embed", "mlp")),
        "w_down": ((L, F, D), ("layers", "mlp", "embed")),
        "final_norm": ((D,), ("embed",)),
        "unembed": ((D, V), ("embed", "vocab")),
    }


def abstract_state(cfg: LLMConfig = LLAMA_70B) -> nnx.State:
    """bf16 params, fp32 AdamW moments, the step count: ShapeDtypeStructs, nothing allocated."""

    def tree(dtype):
        return {
            name: nnx.Param(jax.ShapeDtypeStruct(shape, dtype), out_sharding=names)
            for name, (shape, names) in params(cfg).items()
        }

    with nnx.use_eager_sharding(False):
        return nnx.State(
            {
                "params": tree(jnp.bfloat16),
                "opt_state": {
                    "mu": tree(jnp.float32),
                    "nu": tree(jnp.float32),
                    "count": nnx.Variable(jax.ShapeDtypeStruct((), jnp.int32)),
                },
            }
        )


def profile(cfg: LLMConfig = LLAMA_70B, name: str = "llm-70b") -> tj.planner.ModelProfile:
    """The planner's profile per sample (one sequence of ``seq_len`` tokens), from the shapes.

    A layer's forward FLOPs are ``2 * params * tokens`` for its matmuls plus ``4 * seq * d`` per
    token for attention scores and values; it keeps about 16 bf16 activations of width
    ``d_model`` per token for the backward pass (the attention and MLP inputs and outputs, the
    gated MLP's three ``d_ff``-wide tensors counted in ``d_ff / d_model`` units) and sends one.
    """
    tokens, bf16 = cfg.seq_len, 2
    shapes = params(cfg)
    per_layer = sum(
        _size(shape[1:]) for key, (shape, names) in shapes.items() if names[0] == "layers"
    )
    attention = 4 * cfg.seq_len * cfg.heads * cfg.head_dim
    layer = tj.planner.LayerProfile(
        flops=2.0 * per_layer * tokens + attention * tokens,
        param_bytes=per_layer * bf16,
        act_bytes=tokens * (10 * cfg.d_model + 3 * cfg.d_ff) * bf16,
        out_bytes=tokens * cfg.d_model * bf16,
    )
    outside_params = _size(shapes["embed"][0]) + _size(shapes["unembed"][0]) + cfg.d_model
    outside = tj.planner.LayerProfile(
        flops=2.0 * cfg.d_model * cfg.vocab * tokens,
        param_bytes=outside_params * bf16,
        act_bytes=tokens * (cfg.d_model + 2 * cfg.vocab) * bf16,
        out_bytes=0,
    )
    return tj.planner.ModelProfile(
        name,
        (layer,) * cfg.layers,
        outside,
        divides=(
            ("tensor", "kv_heads", cfg.kv_heads),
            ("tensor", "d_ff", cfg.d_ff),
            ("tensor", "vocab", cfg.vocab),
            ("fsdp", "d_model", cfg.d_model),
        ),
        # bf16 params + fp32 mu and nu = 10 bytes of state per 2 bytes of param, plus bf16 grads
        state_factor=6.0,
    )


def _size(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
