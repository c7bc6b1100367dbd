"""Shared builders for the tests: a real NNX GPT + optax AdamW train state."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from flax import nnx

from tenplex_jax_models import GPT, LOGICAL_RULES, GPTConfig

RULES = LOGICAL_RULES


def train_state(cfg: GPTConfig | None = None, seed: int = 0, lr: float = 1e-2):
    """(model, optimizer) built on one device, not yet laid out."""
    with nnx.use_eager_sharding(False):
        model = GPT(cfg or GPTConfig.tiny(), rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    return model, optimizer


def abstract_state(cfg: GPTConfig | None = None):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: nnx.state(train_state(cfg)))


def host_copy(state) -> list[np.ndarray]:
    """Every leaf as a numpy array (PRNG keys as their key data), for exact comparisons."""
    out = []
    for leaf in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def assert_shards_equal(state, expected: list[np.ndarray], ptc) -> None:
    """Each addressable shard equals the expected global array at its index, on the PTC's devices."""
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(expected) == len(ptc.leaves)
    for array, want, layout in zip(leaves, expected, ptc.leaves):
        assert array.shape == want.shape[: array.ndim], layout.path
        assert {d.id for d in array.sharding.device_set} == set(ptc.device_ids), layout.path
        assert array.sharding.spec == layout.spec, layout.path
        for shard in array.addressable_shards:
            data = shard.data
            if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(data)
            np.testing.assert_array_equal(
                np.asarray(data), want[shard.index], err_msg=f"{layout.path} on {shard.device}"
            )


def minimum_bytes(src, dst, failed=()) -> int:
    """The fewest bytes any plan from ``src`` to ``dst`` must copy between devices: every target
    box less what its own device already holds of it (a failed device holds nothing)."""
    total = 0
    for s, d in zip(src.leaves, dst.leaves):
        held = {dev: box for dev, box in src.boxes(s).items() if dev not in failed}
        for dev, box in dst.boxes(d).items():
            own = held.get(dev)
            overlap = 0
            if own is not None:
                overlap = math.prod(max(0, min(a1, b1) - max(a0, b0))
                                    for (a0, a1), (b0, b1) in zip(own, box))  # fmt: skip
            total += (math.prod(hi - lo for lo, hi in box) - overlap) * d.itemsize
    return total
