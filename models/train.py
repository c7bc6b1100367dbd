"""The reference GPT's train state and train steps, for the demo, the examples, tests and
benchmarks.

``build_state`` makes the GPT and its AdamW optimizer as one NNX state (live, or abstract for
planning); ``train_step`` is the step an :class:`tenplex_jax.ElasticJob` compiles per layout;
``make_train_step`` is the same step jitted by hand for one PTC, for code that drives the layout
itself (the reshard benchmarks, a reference run).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax.wsp import StageModel, UnbrokenModel

from .gpt import (
    GPT,
    GPTConfig,
    block_fn,
    embedded,
    example_losses,
    head_logits,
    profile,
    stacked,
    wave_losses,
)

# One fake CPU device, as described in meshes/cpu8.toml: what the demo tells the planner it runs on.
CPU = tj.planner.DeviceType("cpu", memory=2 * tj.planner.GIB, flops=5e9, link_bandwidth=10e9)


OPTIMIZERS = {
    "adamw": optax.adamw,
    "sgd": optax.sgd,
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
}


def build_state(
    model, lr: float, seed: int = 0, *, abstract: bool = False, optimizer: str = "adamw"
):
    """(graphdef, state, GPTConfig) of the GPT and its optimizer (AdamW; ``optimizer="sgd"``:
    plain SGD; ``"momentum"``: SGD with momentum 0.9), built without a mesh.

    ``model`` is a preset name (``"tiny"``, ``"small"``, ``"gpt100m"``) or a ``GPTConfig``. The
    state is ``{"model": ..., "optimizer": ...}``, so tree paths read ``model/..``,
    ``optimizer/..``. Built under ``use_eager_sharding(False)``, so no mesh is needed: the layout
    comes afterwards (``abstract=True`` gives ``ShapeDtypeStruct`` leaves via ``nnx.eval_shape``:
    no device touched, nothing allocated).
    """
    cfg = model if isinstance(model, GPTConfig) else GPTConfig.by_name(model)

    def build():
        gpt = GPT(cfg, rngs=nnx.Rngs(seed))
        tx = OPTIMIZERS[optimizer](lr)
        return {"model": gpt, "optimizer": nnx.Optimizer(gpt, tx, wrt=nnx.Param)}

    with nnx.use_eager_sharding(False):
        nodes = nnx.eval_shape(build) if abstract else build()
    graphdef, state = nnx.split(nodes)
    return graphdef, state, cfg


def param_count(state) -> int:
    """Parameters of the model part of a ``{"model", "optimizer"}`` state."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(state["model"]))


@functools.cache
def profile_of(name: str) -> tj.planner.ModelProfile:
    """The planner's profile of a GPT preset (cached: it lowers and costs the block)."""
    return profile(GPTConfig.by_name(name), name=f"gpt {name}")


def train_step(graphdef, stages: tj.pipelining.Stages | None = None):
    """``step(state, batch) -> (state, {"loss": loss})`` for ``ElasticJob.jit``: one AdamW step on
    the batch's bitwise gradient (``batch.value_and_grad``); the layers run as a GPipe pipeline
    when the mesh has a ``pipe`` axis larger than 1 (over uneven ``stages`` if given: the state's
    stacked weights padded for them)."""

    def step(state, batch):
        nodes = nnx.merge(graphdef, state)
        losses = pipelined(example_losses, batch.mesh, batch.layout, stages, batch.batch_axes)
        loss, grads = batch.value_and_grad(losses)(nodes["model"])
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), {"loss": loss}

    return step


def wave_step(graphdef, stages: tj.pipelining.Stages | None = None):
    """``step(state, reads, batch) -> (state, landed, {"loss": losses})`` for a
    ``tenplex_jax.wsp.VirtualWorker``'s ``wave_step=``: HetPipe's wave of ``Nm`` minibatches in
    one program, the layers pipelined over the mesh's ``pipe`` axis (over ``stages`` if given)
    with all ``Nm`` in flight.

    ``reads`` is the model's weights with ``Nm`` versions stacked (minibatch ``j`` read version
    ``j``), ``batch`` a ``tj.Batch`` whose data and weights lead with ``Nm``. Each minibatch's
    gradient is taken at its version (its loss the mean over its real rows); the updates then
    land one after another as the VW's ``train_step`` would land them: AdamW's update for
    gradient ``j`` at version ``j`` (the optimizer state as it is then), added to the current
    weights. ``landed`` holds the weights after each landing but the last (the state holds
    those); ``losses`` is ``float32[Nm]``."""

    def step(state, reads, batch):
        nodes = nnx.merge(graphdef, state)
        model, optimizer = nodes["model"], nodes["optimizer"]
        weights = batch.weights

        def total(versions):
            losses = wave_losses(model.cfg, versions, batch.data, mesh=batch.mesh, stages=stages)
            per = (losses * weights).sum(-1) / weights.sum(-1)
            return per.sum(), per

        # plain arrays throughout: nnx Variables are mutable and would alias the reads
        reads = nnx.to_pure_dict(reads)
        (_, per), grads = jax.value_and_grad(total, has_aux=True)(reads)
        landed = []
        for j in range(per.shape[0]):
            read = jax.tree.map(lambda r, j=j: r[j], reads)
            current = _params(model)
            _set_params(model, read)
            optimizer.update(model, _as_params(model, jax.tree.map(lambda g, j=j: g[j], grads)))
            after = _params(model)
            _set_params(model, jax.tree.map(lambda c, a, r: c + (a - r), current, after, read))
            landed.append(_params(model))
        return nnx.state(nodes), tuple(landed[:-1]), {"loss": per}

    return step


def _params(model) -> dict:
    """The model's weights as plain arrays (a pure dict)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _as_params(model, pure: dict):
    """A pure dict of arrays as the model's ``nnx.Param`` state (a gradient for the optimizer)."""
    state = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))  # new Variables: a copy
    nnx.replace_by_pure_dict(state, pure)
    return state


def _set_params(model, pure: dict) -> None:
    """Set the model's weights to a pure dict of arrays."""
    nnx.update(model, _as_params(model, pure))


def pipelined(losses, mesh, layout: tj.data.BatchLayout, stages=None, batch_axes=()):
    """``losses`` (a per-example loss of the GPT) with its layers pipelined over the mesh's
    ``pipe`` axis (over ``stages``, uneven ones, if given): in as many microbatches as divide the
    rows of one pass (a gradient unit, or a rank's microbatch) up to twice the stages;
    ``losses`` itself without a pipe axis, or when the batch is split over it (``batch_axes``:
    a bitwise job's, whose units run all layers each)."""
    pipe = 1 if "pipe" in batch_axes else mesh.shape.get("pipe", 1)
    if pipe == 1:
        return losses
    rows = layout.unit if layout.grad_units is not None else layout.rows // layout.accumulate
    micro = max(m for m in range(1, min(rows, 2 * pipe) + 1) if rows % m == 0)
    return functools.partial(losses, mesh=mesh, microbatches=micro, stages=stages)


def make_train_step(graphdef, ptc: tj.PTC, layout: tj.data.BatchLayout, batch_axes=None):
    """The jitted ``(state, batch, weights) -> (state, loss)`` for one layout; donates the state.

    Pinned to the PTC's shardings, so each step keeps the layout the next plan starts from. The
    gradient comes from ``tj.data.batch_value_and_grad`` over ``batch_axes`` (default
    ``("data", "fsdp")``): with gradient units it has the same bits on any data-parallel size.
    The layers run as a pipeline when the mesh has a ``pipe`` axis larger than 1.
    """
    from tenplex_jax._src.batch import BATCH_AXES

    batch_axes = BATCH_AXES if batch_axes is None else tuple(batch_axes)
    mesh = ptc.mesh()
    losses = pipelined(example_losses, mesh, layout, batch_axes=batch_axes)
    grad_fn = tj.data.batch_value_and_grad(losses, layout, mesh, batch_axes=batch_axes)

    def step(state, batch, weights):
        nodes = nnx.merge(graphdef, state)
        loss, grads = grad_fn(nodes["model"], batch, weights)
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), loss

    rows = NamedSharding(mesh, P(batch_axes))
    return jax.jit(
        step,
        in_shardings=(ptc.shardings(mesh), rows, rows),
        out_shardings=(ptc.shardings(mesh), NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def unbroken_model(graphdef, state) -> UnbrokenModel:
    """The GPT of ``graphdef`` (with ``state``'s structure; abstract is enough) as HetPipe's
    unbroken pipeline runs it (a VW's ``WorkerOptions(pipeline="unbroken", unbroken=...)``): the
    embedding on the first stage, the stacked blocks over the stages, the final norm, head and
    mean cross entropy on the last; the optimizer the state's ``nnx.Optimizer`` runs, its state
    mapped onto the stages' ``(layers, outer)`` weights and back. The dense model only."""
    nodes = nnx.merge(graphdef, state)
    cfg, tx = nodes["model"].cfg, nodes["optimizer"].tx
    if cfg.n_experts:
        raise ValueError("the unbroken pipeline runs the dense GPT; this config has experts")
    names = stacked(cfg)
    params = set(nnx.to_pure_dict(nnx.state(nodes["model"], nnx.Param)))
    is_variable = lambda x: isinstance(x, nnx.Variable)
    # the optimizer's state holds a tree like the weights (momentum's trace, Adam's moments):
    # as a dict of the model's names, or as the stages' (layers, outer)
    is_weights = lambda x: isinstance(x, Mapping) and set(x) == params
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and all(isinstance(d, dict) for d in x)
    to_pair = lambda d: ({k: d[k] for k in names}, {k: d[k] for k in d if k not in names})

    def loss(outer, h, targets):
        logits = head_logits(outer, h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def split(state):
        nodes = nnx.merge(graphdef, state)
        weights = to_pair(_params(nodes["model"]))
        # get_value, set_value: the arrays themselves (``v[...]`` dispatches an op per leaf)
        opt = jax.tree.map(
            lambda v: v.get_value(), nodes["optimizer"].opt_state, is_leaf=is_variable
        )
        pairs = lambda x: to_pair(x) if is_weights(x) else x  # a count stays as it is
        return weights, jax.tree.map(pairs, opt, is_leaf=is_weights)

    def merge(state, weights, opt_state, updates):
        # new Variables: the merged nodes share the state's, which must not change under it
        nodes = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        for name, value in (*weights[0].items(), *weights[1].items()):
            getattr(nodes["model"], name).set_value(value)
        variables = jax.tree.leaves(nodes["optimizer"].opt_state, is_leaf=is_variable)
        values = jax.tree.leaves(
            jax.tree.map(
                lambda x: {**x[0], **x[1]} if is_pair(x) else x, opt_state, is_leaf=is_pair
            )
        )
        if len(variables) != len(values):  # a structure this mapping does not know
            raise ValueError(f"{len(values)} optimizer leaves for {len(variables)} variables")
        for variable, value in zip(variables, values):
            variable.set_value(value)
        step = nodes["optimizer"].step
        step.set_value(step.get_value() + np.asarray(updates, step.get_value().dtype))
        return nnx.state(nodes)

    model = StageModel(embedded, block_fn(cfg), loss)
    batch = lambda data: (data["inputs"], data["targets"])
    return UnbrokenModel(model, tx, split, merge, batch)
