"""A global batch on the devices, and its gradients inside the user's jitted step.

:func:`device_batch` lays global batch ``k`` of a :class:`DatasetPTC` out over the mesh's batch
axes (each device reads only its rows); :class:`Batch` carries it with its layout and mesh, as
``ElasticJob.next`` hands it to the step. :func:`batch_value_and_grad` replaces
``nnx.value_and_grad`` there: plain (:func:`_plain`, one SPMD computation, gradient accumulation
with ``layout.accumulate``) or in gradient units (:func:`_by_units`, one gradient per unit,
summed in unit order); ``docs/data.md`` states the contract and the cost.

The gradient passes through ``lax.optimization_barrier`` before it is returned: otherwise XLA
fuses the division by the sample count into the optimizer's update, and how it fuses (and so the
rounding) depends on the shard shapes, which breaks bitwise equality across FSDP sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax._src import bitwise
from tenplex_jax._src.data import BatchLayout, DatasetPTC
from tenplex_jax._src.errors import DataError
from tenplex_jax._src.mesh import show_mesh

# The batch dim is split over both data-parallel axes: fsdp shards params, yet splits the batch too.
BATCH_AXES = ("data", "fsdp")
"""The mesh axes a global batch's rows are split over by default: ``("data", "fsdp")``."""


def batch_value_and_grad(
    per_example_loss: Callable[[Any, Any], jax.Array],
    layout: BatchLayout,
    mesh: Mesh,
    *,
    batch_axes: Sequence[str] = BATCH_AXES,
    wrt: Any = nnx.Param,
) -> Callable[[Any, Any, jax.Array], tuple[jax.Array, nnx.State]]:
    """``nnx.value_and_grad`` for a global batch laid out by ``layout``, padding rows left out.

    Use it inside the jitted train step. With gradient units (``layout.grad_units``) the gradient
    is one per unit, summed in unit order, so it has the same bits on any number of ranks.
    Example::

        grad_fn = batch_value_and_grad(example_losses, BatchLayout(24, ranks=4, grad_units=8), mesh)

        def step(state, batch, weights):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = grad_fn(model, batch, weights)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

    Args:
      per_example_loss: ``per_example_loss(model, batch) -> float32[b]``, one loss per row;
        ``model`` is an NNX model, or a plain pytree of params (Linen's variables, a dict of
        arrays), all of whose leaves are differentiated: its gradient has its structure.
      layout: the batch's :class:`tenplex_jax.data.BatchLayout`; ``layout.ranks`` must be the
        mesh's size over ``batch_axes``.
      mesh: the mesh the batch is laid out on.
      batch_axes: the mesh axes the rows are split over.
      wrt: an ``nnx`` filter of the variables to differentiate (default ``nnx.Param``).

    Returns:
      ``fn(model, batch, weights) -> (loss, grads)``: ``batch`` leaves and ``weights`` have
      leading dim ``layout.rows`` (as :func:`device_batch` lays them out); ``loss`` is the
      weighted mean over the real samples, ``grads`` its gradient, ready for
      ``optimizer.update(model, grads)``.

    Raises:
      DataError: a batch axis is not a mesh axis, or ``layout.ranks`` is not the mesh's size
        over the batch axes.
    """
    batch_axes = tuple(batch_axes)
    ranks = _ranks(mesh, batch_axes)
    if ranks != layout.ranks:
        raise DataError(
            f"the batch layout is for {layout.ranks} data-parallel ranks, but the mesh "
            f"{show_mesh(mesh, devices=False)} has {ranks} over the batch axes {batch_axes}"
        )
    compute = _by_units if layout.grad_units is not None else _plain
    return functools.partial(compute, per_example_loss, layout, mesh, batch_axes, wrt)


def device_batch(
    dataset: DatasetPTC,
    step: int,
    layout: BatchLayout,
    mesh: Mesh,
    batch_axes: Sequence[str] = BATCH_AXES,
) -> tuple[Any, jax.Array, np.ndarray]:
    """One global batch as arrays sharded over ``batch_axes``.

    Each device's rows are read for that device only (``make_array_from_callback``), so in a
    multi-process job every process reads just its ranks' samples.

    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> ds = tj.DatasetPTC(np.arange(10, dtype=np.float32), global_batch=3)
    >>> batch, weights, samples = device_batch(ds, 0, BatchLayout(3, ranks=2), mesh, ("data",))
    >>> batch.shape, weights.sharding.spec, weights.tolist()     # rank 1 holds a padding row
    ((4,), P('data',), [1.0, 1.0, 1.0, 0.0])

    Args:
      dataset: the :class:`tenplex_jax.DatasetPTC`.
      step: the global batch.
      layout: its :class:`tenplex_jax.data.BatchLayout` for the mesh.
      mesh: the mesh to lay it out on.
      batch_axes: the mesh axes the rows are split over.

    Returns:
      ``(batch, weights, samples)``: the batch as a pytree of ``jax.Array`` with leading dim
      ``layout.rows``, float32 weights (0 on padding) sharded alike, and the int64[rows] NumPy
      index of the sample in every row (-1 on padding), for accounting.

    Raises:
      DataError: the layout is for another global batch size.
    """
    sharding = NamedSharding(mesh, P(tuple(batch_axes)))
    samples, weights = dataset.samples(step, layout)
    blocks: dict[tuple[int, int], list[np.ndarray]] = {}
    treedefs = []

    def block(index) -> list[np.ndarray]:  # devices holding the same rows share one read
        start, stop, _ = index[0].indices(layout.rows)
        if (start, stop) not in blocks:
            leaves, treedef = jax.tree.flatten(dataset.read(samples[start:stop]))
            blocks[start, stop] = leaves
            treedefs.append(treedef)
        return blocks[start, stop]

    first = block(next(iter(sharding.addressable_devices_indices_map((layout.rows,)).values())))
    batch = [
        jax.make_array_from_callback(
            (layout.rows, *leaf.shape[1:]), sharding, lambda index, i=i: block(index)[i]
        )
        for i, leaf in enumerate(first)
    ]
    weights = jax.make_array_from_callback(weights.shape, sharding, lambda index: weights[index])
    return jax.tree.unflatten(treedefs[0], batch), weights, samples


def _ranks(mesh: Mesh, batch_axes: tuple[str, ...]) -> int:
    missing = [a for a in batch_axes if a not in mesh.shape]
    if missing:
        raise DataError(
            f"batch axes {missing} are not axes of the mesh {show_mesh(mesh, devices=False)}"
        )
    return math.prod(mesh.shape[a] for a in batch_axes)


def _split(model, wrt) -> tuple[Callable, Any, Any]:
    """``(merge, params, rest)``: an NNX model's ``wrt`` variables and the rest, and how to merge
    them back; a plain pytree (Linen's params, a dict of arrays) is all params, and its gradient
    has its structure."""
    nodes = (nnx.Variable, nnx.Module)
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, nodes))
    if not isinstance(model, nnx.Module) and not any(isinstance(x, nodes) for x in leaves):
        return lambda params, rest: params, model, None
    graphdef, params, rest = nnx.split(model, wrt, ...)
    return functools.partial(nnx.merge, graphdef), params, rest


def _plain(per_example_loss, layout: BatchLayout, mesh, batch_axes, wrt, model, batch, weights):
    bitwise.note(False)
    merge, params, rest = _split(model, wrt)
    k = layout.accumulate

    def weighted_sum(params, micro, w):
        return jnp.sum(per_example_loss(merge(params, rest), micro) * w)

    if k == 1:
        total, grads = jax.value_and_grad(weighted_sum)(params, batch, weights)
    else:
        # [ranks * slots, ...] → [k, ranks * slots / k, ...] keeping each rank's rows on its device:
        # microbatch j takes the j-th k-th of every rank's rows.
        def micro(x):
            x = x.reshape(layout.ranks, k, -1, *x.shape[1:])
            x = jnp.moveaxis(x, 1, 0)
            x = x.reshape(k, -1, *x.shape[3:])
            spec = P(None, batch_axes)
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        def body(carry, xs):
            total, grads = carry
            t, g = jax.value_and_grad(weighted_sum)(params, *xs)
            return (total + t, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        xs = (jax.tree.map(micro, batch), micro(weights))
        (total, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), xs)
    return _normalize(total, grads, weights)


def _by_units(per_example_loss, layout: BatchLayout, mesh, batch_axes, wrt, model, batch, weights):
    merge, params, rest = _split(model, wrt)
    order = [int(i) for i in layout.unit_rows()]  # unit v's row in the gathered [ranks*slots] stack
    alone = all(mesh.shape[a] == 1 or a in batch_axes for a in mesh.axis_names)
    bitwise.note(True, alone)

    def per_unit(params, rest, unit_batch, unit_weights):
        def weighted_sum(params):
            losses = per_example_loss(merge(params, rest), unit_batch)
            return jnp.sum(losses * unit_weights)

        return jax.value_and_grad(weighted_sum)(params)

    def local(params, rest, batch, weights):
        def units(x):  # this rank's [slots * unit, ...] rows → [slots, unit, ...]
            return x.reshape(layout.slots, layout.unit, *x.shape[1:])

        out = jax.lax.map(
            lambda xs: per_unit(params, rest, *xs), (jax.tree.map(units, batch), units(weights))
        )
        return jax.tree.map(functools.partial(_sum_units, order, layout.ranks, batch_axes), out)

    total, grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P(batch_axes), P(batch_axes)),
        out_specs=P(),
        # manual over every axis where the others have size 1: JAX writes an open sharding on
        # every op of a body that leaves an axis automatic (a GPT step's program 1.5x larger)
        axis_names=set(mesh.axis_names) if alone else set(batch_axes),
        check_vma=False,
    )(params, rest, batch, weights)
    total, grads = _normalize(total, grads, weights)
    # replicated, as summed: an all-parameter reduction of the optimizer (a global norm) then
    # reads whole leaves on every device, in one order on any layout
    return total, jax.lax.with_sharding_constraint(grads, NamedSharding(mesh, P()))


def _sum_units(order: list[int], ranks: int, batch_axes, stack: jax.Array) -> jax.Array:
    """The sum, in unit ``order``, of every rank's ``[slots, ...]`` stack of per-unit values,
    on every rank. Each rank receives every unit's values for one slice of the elements
    (an all-to-all), adds them in order and all-gathers the sums: each device holds its own
    units and 1/ranks of all of them, not every unit's whole gradient."""
    slots, shape = stack.shape[0], stack.shape[1:]
    size = math.prod(shape)
    chunk = -(-size // ranks)
    flat = stack.reshape(slots, size)
    if chunk * ranks != size:
        flat = jnp.pad(flat, ((0, 0), (0, chunk * ranks - size)))
    # [slots, ranks * chunk] -> [ranks * slots, chunk]: rank r's units first, as an all-gather
    mine = jax.lax.all_to_all(flat, batch_axes, 1, 0, tiled=True)
    summed = functools.reduce(jnp.add, [mine[i] for i in order])
    whole = jax.lax.all_gather(summed, batch_axes, tiled=True)
    return whole[:size].reshape(shape)


def _normalize(total, grads, weights):
    count = jnp.sum(weights)  # a small integer in float32: exact in any summation order
    grads = jax.tree.map(lambda g: g / count, grads)
    return total / count, jax.lax.optimization_barrier(grads)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A global batch laid out for the current mesh: what ``job.next`` hands the user's step.

    A pytree: ``data`` and ``weights`` are its leaves; the layout and mesh are static, so a step
    traced for one layout is never reused for another. In the step::

        def train_step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = batch.value_and_grad(per_example_loss)(model)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), {"loss": loss}

    Attributes:
      data: the batch, a pytree of arrays with leading dim ``layout.rows``, sharded over
        ``batch_axes``.
      weights: float32[rows], 1 on real rows and 0 on padding, sharded alike.
      layout: the :class:`tenplex_jax.data.BatchLayout` of the rows.
      mesh: the mesh they are laid out on.
      batch_axes: the mesh axes the rows are split over.
    """

    data: Any
    weights: jax.Array
    layout: BatchLayout
    mesh: Mesh
    batch_axes: tuple[str, ...] = BATCH_AXES

    def value_and_grad(self, per_example_loss, *, wrt=nnx.Param):
        """The loss and gradient over this batch (:func:`tenplex_jax.data.batch_value_and_grad`).

        Args:
          per_example_loss: ``per_example_loss(model, data) -> float32[rows]``, one loss per row.
          wrt: an ``nnx`` filter of the variables to differentiate (default ``nnx.Param``).

        Returns:
          ``fn(model) -> (loss, grads)``: the mean loss over the real samples and its gradient.

        Raises:
          DataError: the layout does not fit the mesh's batch axes.
        """
        fn = batch_value_and_grad(
            per_example_loss, self.layout, self.mesh, batch_axes=self.batch_axes, wrt=wrt
        )
        return lambda model: fn(model, self.data, self.weights)


jax.tree_util.register_dataclass(
    Batch, data_fields=["data", "weights"], meta_fields=["layout", "mesh", "batch_axes"]
)
