"""Pipeline parallelism: a GPipe schedule over ``pipe`` computes what the unpipelined model computes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from models import GPTConfig, batch_at, loss_fn, stdlib_corpus
from tests.helpers import RULES, train_state

C = tj.ParallelConfig
CFG = dataclasses.replace(GPTConfig.tiny(), n_layers=4)
BATCH = 8


def _batch():
    return batch_at(stdlib_corpus(2**20), 3, BATCH, CFG.seq_len, seed=1)


@pytest.fixture(scope="module")
def reference():
    """Loss and grads of the unpipelined model on one device."""
    model, _ = train_state(CFG)
    loss, grads = nnx.value_and_grad(loss_fn)(model, _batch())
    return float(loss), {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}


def _pipelined(config: C, microbatches: int, stages: tj.Stages | None = None):
    model, _ = train_state(CFG)
    graphdef, state = nnx.split(model)
    if stages is not None:  # the uneven layout: stacked weights padded per stage
        state = jax.tree.map(
            lambda v: stages.pad(v) if v.shape and v.shape[0] == CFG.n_layers else v, state
        )
    ptc = tj.PTC.of(state, RULES, config, jax.devices()[: config.num_devices])
    state = tj.place(state, ptc)
    mesh = ptc.mesh()
    batch = jax.device_put(_batch(), NamedSharding(mesh, P(("data", "fsdp"))))

    @jax.jit
    def value_and_grad(state, batch):
        model = nnx.merge(graphdef, state)
        loss = functools.partial(loss_fn, mesh=mesh, microbatches=microbatches, stages=stages)
        return nnx.value_and_grad(loss)(model, batch)

    loss, grads = value_and_grad(state, batch)
    text = value_and_grad.lower(state, batch).as_text()
    flat = {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    if stages is not None:
        flat = {
            k: np.asarray(stages.unpad(v)) if v.shape and v.shape[0] == len(stages.index) else v
            for k, v in flat.items()
        }
    return float(loss), flat, text, ptc


@pytest.mark.parametrize(
    "config, microbatches",
    [
        (C(pipe=2, data=2, tensor=2), 2),
        (C(pipe=4, data=2), 4),
        (C(pipe=2, fsdp=2, tensor=2), 4),
        (C(pipe=4, tensor=2), 1),
    ],
    ids=str,
)
def test_pipelined_loss_and_grads_equal_the_unpipelined_model(reference, config, microbatches):
    want_loss, want_grads = reference
    loss, grads, text, ptc = _pipelined(config, microbatches)
    # the stages really are on different devices and talk by collective permutes
    assert "collective_permute" in text
    assert ptc.leaf("wq").spec[0] == "pipe"
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        np.testing.assert_allclose(grads[name], want, rtol=2e-4, atol=2e-6, err_msg=name)
