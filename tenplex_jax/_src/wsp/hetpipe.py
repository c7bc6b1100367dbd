"""HetPipe's pipeline run from a tick table (:func:`~tenplex_jax._src.wsp.pipeline.schedule`):
programs whose ``lax.scan`` steps through a range of the table's ticks in a ``shard_map`` manual
over the ``pipe`` axis, each stage running the forward or the backward the table gives it at that
tick, each update landing (an optax update at the weights the minibatch read, added to the
weights as they are then) at the tick the table lands it.

What is in flight is an :class:`InFlight`, carried out of one call and into the next on the
devices, so the pipeline need not drain between calls: a VW calls the ticks up to the point where
its clock distance may block it (wave ``k - 1``'s last landing, where it pushes and may pull),
then the ticks after. A pull lands on what is in flight as a **rebase** (:func:`rebased`): updates
are added to the weights as they are when they land, so the pulled weights' difference from
the weights at the pull point is added to the weights and to every version stashed after it.

A stage keeps, per minibatch in flight (``Nm`` slots, minibatch ``p`` in slot ``p % Nm``, free
again once it lands, before ``p + Nm`` enters: the table's rule): the weight version it reads
(stashed when ``p - Nm`` landed: weight stashing), its input activations (the backward recomputes
the stage from them, as GPipe's remat does), its gradient until it lands, and the activations and
cotangents that arrived from the neighbouring stages before the table runs them. Activations go up
and cotangents down with ``lax.ppermute`` every tick; a stage with no slot at a tick computes
nothing (``lax.cond``). The same code runs the wave program's table and the unbroken one: their
numerics are the same sequential updates, bit for bit, and their time differs by their ticks.

The model is a :class:`StageModel`: the first stage's function (an embedding), one stacked layer,
the last stage's loss (a head). A VW with ``pipeline="unbroken"`` runs it a :class:`Window` at a
time (:mod:`~tenplex_jax._src.wsp.unbroken`); ``docs/wsp.md`` (the unbroken pipeline) lists what
is left.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp.pipeline import Schedule


@dataclasses.dataclass(frozen=True)
class StageModel:
    """A model as the stages run it. The weights are ``(layers, outer)``: the stacked layers
    (rows split over the stages) and the rest (whole on every stage).

    Attributes:
      first: ``first(outer, x) -> h`` on the first stage (an embedding).
      layer: ``layer(h, one layer's weights) -> h`` for each stacked layer.
      loss: ``loss(outer, h, target) -> scalar`` on the last stage (a head and its loss).
    """

    first: Callable
    layer: Callable
    loss: Callable


@dataclasses.dataclass(frozen=True)
class UnbrokenModel:
    """What a VW needs to run its train state through the unbroken pipeline
    (``WorkerOptions(pipeline="unbroken", unbroken=...)``; the reference GPT's:
    ``tenplex_jax_models.unbroken_model``).

    Attributes:
      model: the stages' functions (:class:`StageModel`).
      optimizer: the optax transformation the state's optimizer runs (elementwise).
      split: ``split(state) -> ((layers, outer), opt_state)``: the train state's weights as the
        stages hold them and its optimizer state over them (``optimizer.init``'s structure).
      merge: ``merge(state, weights, opt_state, updates) -> state``: the train state holding
        them, its optimizer's step count ``updates`` further on.
      batch: ``batch(data) -> (x, target)``: a minibatch's data (the dataset PTC's) as
        ``model.first`` and ``model.loss`` take it.
    """

    model: StageModel
    optimizer: optax.GradientTransformation
    split: Callable
    merge: Callable
    batch: Callable


class InFlight(NamedTuple):
    """A VW's pipeline between calls, on its devices.

    Attributes:
      weights: ``(layers, outer)`` now.
      opt_state: the optimizer state now.
      versions: per slot, the weights its minibatch reads (each leaf ``[Nm, ...]``).
      grads: per slot, the gradient of its minibatch until it lands (the layers' rows on their
        stage; the outer weights' per stage, a leading dim of the stages, summed where it lands).
      buffers: per stage (a leading dim of the stages): per slot its input activations, the
        activations and the cotangents arrived from the neighbours; and every minibatch's loss
        (the last stage's).
    """

    weights: Any
    opt_state: Any
    versions: Any
    grads: Any
    buffers: tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def start(
    table: Schedule,
    model: StageModel,
    weights,
    opt_state,
    xs: jax.Array,
    *,
    mesh: Mesh,
    axis="pipe",
) -> InFlight:
    """Nothing in flight yet: every slot reads ``weights`` (``(layers, outer)``: what minibatches
    ``0 .. Nm - 1`` read), ``opt_state`` as it is; ``xs`` the minibatches' inputs (``[n, ...]``).

    Raises:
      WSPError: the table's stages are not the axis's, its minibatches not ``xs``'s, or the
        layers' rows do not split evenly over the stages (``"invalid"``).
    """
    stages, n, nm = mesh.shape[axis], len(table.forward), table.nm
    if table.stages != stages or xs.shape[0] != n:
        raise WSPError(
            f"a tick table of {table.stages} stages and {n} minibatches runs on a {axis!r} axis "
            f"of as many stages with as many inputs: got {stages} stages, {xs.shape[0]} inputs",
            "invalid",
        )
    layers, outer = weights
    leaves = jax.tree_util.tree_leaves_with_path(layers)
    rows = {jax.tree_util.keystr(k): leaf.shape[0] for k, leaf in leaves}
    if any(r % stages for r in rows.values()) or len(set(rows.values())) != 1:
        raise WSPError(
            f"the stacked layers split evenly over the {stages} stages, every leaf with as many "
            f"rows: got rows {rows}",
            "invalid",
        )
    h = jax.eval_shape(model.first, outer, jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype))
    on = lambda spec: NamedSharding(mesh, spec)
    slots = lambda w, spec: jax.device_put(jnp.broadcast_to(w, (nm,) + w.shape), on(spec))
    zeros = lambda shape, dtype: jax.device_put(jnp.zeros((stages, *shape), dtype), on(P(axis)))
    return InFlight(
        weights,
        opt_state,
        (
            jax.tree.map(lambda w: slots(w, P(None, axis)), layers),
            jax.tree.map(lambda w: slots(w, P()), outer),
        ),
        (
            jax.tree.map(lambda w: slots(jnp.zeros_like(w), P(None, axis)), layers),
            jax.tree.map(lambda w: zeros((nm, *w.shape), w.dtype), outer),
        ),
        (
            zeros((nm, *h.shape), h.dtype),  # the stage's input activations, per slot
            zeros((nm, *h.shape), h.dtype),  # activations arrived from the stage before
            zeros((nm, *h.shape), h.dtype),  # cotangents arrived from the stage after
            zeros((n,), jnp.float32),  # losses (the last stage's)
        ),
    )


def run(
    table: Schedule,
    model: StageModel,
    optimizer: optax.GradientTransformation,
    inflight: InFlight,
    xs: jax.Array,
    targets: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "pipe",
    ticks: tuple[int, int] | None = None,
) -> tuple[InFlight, jax.Array]:
    """Ticks ``ticks`` (``[first, end)``; None: all) of ``table``, from ``inflight`` on.

    Args:
      table: the tick table of ``n`` minibatches over ``mesh.shape[axis]`` stages.
      model: the stages' functions.
      optimizer: lands each update: ``optimizer.update(gradient, opt_state, read)`` at the
        weights ``read`` the minibatch read, added to the current weights; elementwise (SGD,
        momentum, Adam, AdamW: each stage updates its own rows).
      inflight: the pipeline after the ticks before ``ticks`` (:func:`start` before the first).
      xs: ``[n, ...]``, each minibatch's input (``model.first``'s).
      targets: ``[n, ...]``, each minibatch's target.
      mesh: a mesh with ``axis``.

    Returns:
      The pipeline after the ticks, and ``float32[n]``: the loss of every minibatch whose
      backward left the last stage so far (0 for the others).

    Raises:
      WSPError: ``ticks`` outside the table (``"invalid"``).
    """
    first, end = (0, table.ticks) if ticks is None else ticks
    if not 0 <= first <= end <= table.ticks:
        raise WSPError(
            f"a call runs ticks [first, end) with 0 <= first <= end <= {table.ticks} (the "
            f"table's), got [{first}, {end})",
            "invalid",
        )
    ticks = window(table, first, end, base=0, n=len(table.forward))
    return _launch(ticks, model, optimizer, inflight, xs, targets, mesh, axis)


@dataclasses.dataclass(frozen=True)
class Window:
    """A range of a table's ticks as one program runs it, its minibatches counted from ``base``
    (a multiple of ``Nm``: a minibatch keeps its slot), so that the same slots at other ticks
    and minibatches (a steady wave's, shifted by whole waves) are the same window: compiled once.

    Attributes:
      nm: ``Nm``: the slots (minibatch ``m`` in slot ``m % Nm``).
      stages: the pipeline's stages.
      n: the minibatches whose inputs the program takes (``xs[:n]`` are ``base .. base + n - 1``).
      forward, backward: per tick, per stage: the minibatch (from ``base``) its slot runs, -1 none.
      landing: per tick: the minibatches (from ``base``) landing at its end, -1 padding.
    """

    nm: int
    stages: int
    n: int
    forward: tuple[tuple[int, ...], ...]
    backward: tuple[tuple[int, ...], ...]
    landing: tuple[tuple[int, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.forward)

    def idle_ticks(self) -> tuple[int, ...]:
        """Per stage: the window's ticks in which the stage runs no slot."""
        return tuple(
            sum(f[s] < 0 and b[s] < 0 for f, b in zip(self.forward, self.backward))
            for s in range(self.stages)
        )


def window(table: Schedule, first: int, end: int, *, base: int, n: int) -> Window:
    """Ticks ``[first, end)`` of ``table`` as a :class:`Window` of minibatches ``base .. base +
    n - 1``.

    Raises:
      WSPError: ``base`` is not a multiple of ``Nm``, or a slot in the range runs a minibatch
        outside ``base .. base + n - 1`` (``"invalid"``).
    """
    forward, backward, landing = table.arrays()
    parts = [forward[first:end], backward[first:end], landing[first:end]]
    used = np.concatenate([a.ravel() for a in parts])
    used = used[used >= 0]
    if base % table.nm or (used.size and (used.min() < base or used.max() >= base + n)):
        raise WSPError(
            f"a window of ticks [{first}, {end}) takes minibatches from a base that is a multiple "
            f"of Nm = {table.nm} and holds every minibatch its slots run: got base {base}, "
            f"{n} minibatches, slots running {sorted(set(used.tolist()))}",
            "invalid",
        )
    rebase = lambda a: tuple(tuple(int(m - base) if m >= 0 else -1 for m in row) for row in a)
    return Window(table.nm, table.stages, n, *map(rebase, parts))


def run_window(
    ticks: Window,
    model: StageModel,
    optimizer: optax.GradientTransformation,
    inflight: InFlight,
    xs: jax.Array,
    targets: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "pipe",
) -> tuple[InFlight, jax.Array]:
    """A :class:`Window` of ticks from ``inflight`` on, as :func:`run` (``xs`` and ``targets``:
    its ``n`` minibatches'); the losses are the window's: ``float32[n]``, those whose backward
    left the last stage in it (0 for the others). Compiled once per window, model, optimizer,
    mesh and layout: a VW's steady waves run one program."""
    stages = mesh.shape[axis]
    losses = jax.device_put(jnp.zeros((stages, ticks.n), jnp.float32), NamedSharding(mesh, P(axis)))
    inflight = inflight._replace(buffers=(*inflight.buffers[:3], losses))
    return _launch(ticks, model, optimizer, inflight, xs, targets, mesh, axis)


def _launch(ticks: Window, model, optimizer, inflight: InFlight, xs, targets, mesh, axis):
    """Run ``ticks`` from ``inflight`` (:func:`run`, :func:`run_window`): the window's program,
    compiled once for its layout of what is in flight."""
    specs = _specs(optimizer, inflight, axis)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    program = _program(ticks, model, optimizer, mesh, axis, tuple(leaves), treedef)
    return program(inflight, xs, targets)


def _specs(optimizer, inflight: InFlight, axis: str) -> InFlight:
    """How what is in flight is laid out over the stages: the layers' rows split, the rest
    whole; per stage what is the stage's own."""
    layers, outer = inflight.weights
    rows, whole = jax.tree.map(lambda _: P(axis), layers), jax.tree.map(lambda _: P(), outer)
    per_slot = lambda tree, spec: jax.tree.map(lambda _: spec, tree)
    return InFlight(
        (rows, whole),
        # the optimizer's state mirrors the weights: laid out as they are
        optax.tree_map_params(
            optimizer,
            lambda _, spec: spec,
            inflight.opt_state,
            (rows, whole),
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P),
        ),
        (per_slot(layers, P(None, axis)), whole),
        (per_slot(layers, P(None, axis)), per_slot(outer, P(axis))),
        (P(axis),) * 4,
    )


@jax.jit
def rebased(inflight: InFlight, delta, slots: jax.Array) -> InFlight:
    """``inflight`` after a pull whose weights differ by ``delta`` from the weights at the pull
    point: ``delta`` added to the weights and to the versions in ``slots`` (``bool[Nm]``: those
    stashed at or after the pull point, read by minibatches that enter after it)."""
    add = lambda v, d: v + jnp.where(slots.reshape((-1,) + (1,) * d.ndim), d, 0)
    return inflight._replace(
        weights=jax.tree.map(jnp.add, inflight.weights, delta),
        versions=jax.tree.map(add, inflight.versions, delta),
    )


def slots_after(table: Schedule, pull: int, end: int) -> Sequence[bool]:
    """The slots whose versions were stashed from tick ``pull - 1``'s landings (the pull point:
    right after them) up to tick ``end``: what a pull made at ``pull`` rebases."""
    landed = {q for q in range(len(table.forward)) if pull - 1 <= table.landed(q) < end}
    return [any(q % table.nm == s for q in landed) for s in range(table.nm)]


@functools.lru_cache(maxsize=64)
def _program(ticks: Window, model, optimizer, mesh, axis, spec_leaves, spec_tree):
    """The program of a window of ticks, compiled once per window, model, optimizer, mesh and
    layout: a VW calls it every wave."""
    specs = jax.tree.unflatten(spec_tree, spec_leaves)
    forward, backward = (jnp.asarray(a, jnp.int32) for a in (ticks.forward, ticks.backward))
    landing = jnp.asarray(ticks.landing, jnp.int32)
    body = _body(ticks.nm, mesh.shape[axis], model, optimizer, axis)

    def spmd(inflight, xs, targets):
        return body(inflight, xs, targets, forward, backward, landing, (0, ticks.ticks))

    mapped = jax.shard_map(
        spmd,
        mesh=mesh,
        in_specs=(specs, P(), P()),
        out_specs=(specs, P()),
        axis_names=frozenset({axis}),
    )
    return jax.jit(mapped)


def _body(nm: int, stages: int, model: StageModel, optimizer, axis: str):
    last = stages - 1
    step = jax.checkpoint(model.layer)
    layers_fn = lambda w, h: jax.lax.scan(lambda h, p: (step(h, p), None), h, w)[0]
    get = lambda a, m: jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, m % nm, keepdims=False), a
    )
    put = lambda a, m, v: jax.tree.map(
        lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, m % nm, 0), a, v
    )
    pick = lambda a, m: jax.lax.dynamic_index_in_dim(a, jnp.maximum(m, 0), keepdims=False)
    where = lambda c, a, b: jax.tree.map(lambda u, v: jnp.where(c, u, v), a, b)
    up = [(s, s + 1) for s in range(last)]  # no wrap: stage 0 receives nothing (index 0)
    down = [(s + 1, s) for s in range(last)]

    def body(inflight, xs, targets, forward, backward, landing, ticks):
        stage = jax.lax.axis_index(axis)
        vary = lambda x: jax.lax.pcast(x, (axis,), to="varying")
        nothing = jnp.zeros_like(inflight.buffers[0][0, 0])  # an idle slot's message (varying)
        buffers = tuple(b[0] for b in inflight.buffers)  # this stage's
        outer_grads = jax.tree.map(lambda g: g[0], inflight.grads[1])

        def stage_fn(version, x, h):
            """The stage on the version it read: the first embeds ``x``, the others take ``h``
            (the stage before's)."""
            layers, outer = version
            h = jax.lax.cond(stage == 0, lambda: model.first(outer, x), lambda: h)
            return layers_fn(layers, h), h

        def tick(carry, t):
            w, opt, versions, (grads, outer), (acts, inbox, cobox, losses) = carry
            f, b = forward[t, stage], backward[t, stage]

            # minibatch m's version; m is the stage's slot, so the outer weights read are
            # varying over the axis: each stage's gradient of them stays its own until they land
            # (a gradient of weights the stages share would be summed over them inside the slot,
            # which only some stages run)
            read = lambda m: get(versions, m)

            # the forward slot: minibatch f on the version it read
            def forward_slot(acts):
                out, h = stage_fn(read(f), pick(xs, f), get(inbox, f))
                return put(acts, f, h), out

            idle_forward = lambda acts: (acts, nothing)
            acts, y = jax.lax.cond(f >= 0, forward_slot, idle_forward, acts)

            # the backward slot: minibatch b recomputed from its input, its cotangent from the
            # stage after (the loss's, on the last stage)
            def backward_slot(grads, outer, losses):
                x, target = pick(xs, b), pick(targets, b)

                def through(version, h):
                    out, _ = stage_fn(version, x, h)
                    loss = jax.lax.cond(
                        stage == last,
                        lambda: model.loss(version[1], out, target).astype(jnp.float32),
                        lambda: vary(jnp.zeros((), jnp.float32)),
                    )
                    return out, loss

                (out, loss), vjp = jax.vjp(through, read(b), get(acts, b))
                cotangent = where(stage == last, jnp.zeros_like(out), get(cobox, b))
                (grad, outer_grad), back = vjp((cotangent, jnp.ones_like(loss)))
                written = where(stage == last, losses.at[b].set(loss), losses)
                return put(grads, b, grad), put(outer, b, outer_grad), back, written

            idle_backward = lambda grads, outer, losses: (grads, outer, nothing, losses)
            grads, outer, back, losses = jax.lax.cond(
                b >= 0, backward_slot, idle_backward, grads, outer, losses
            )
            # to the neighbours, marked with the minibatch + 1 (0: nothing sent)
            (y_in, f_in) = jax.lax.ppermute((y, f + 1), axis, up)
            (c_in, b_in) = jax.lax.ppermute((back, b + 1), axis, down)
            inbox = where(f_in > 0, put(inbox, f_in - 1, y_in), inbox)
            cobox = where(b_in > 0, put(cobox, b_in - 1, c_in), cobox)
            # the landings at the end of the tick, in order: the update at the weights read,
            # added to the current ones; the weights then are minibatch m + Nm's version. The
            # outer weights' gradient is the first stage's and the last's, summed
            for i in range(landing.shape[1]):
                m = landing[t, i]  # the same on every stage: they all land it, or none

                def land(w, opt, versions, m=m):
                    gradient = (get(grads, m), jax.lax.psum(get(outer, m), axis))
                    updates, opt = optimizer.update(gradient, opt, get(versions, m))
                    w = optax.apply_updates(w, updates)
                    return w, opt, put(versions, m, w)

                w, opt, versions = jax.lax.cond(
                    m >= 0, land, lambda *carry: carry, w, opt, versions
                )
            return (w, opt, versions, (grads, outer), (acts, inbox, cobox, losses)), None

        carry = (
            inflight.weights,
            inflight.opt_state,
            inflight.versions,
            (inflight.grads[0], outer_grads),
            buffers,
        )
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(*ticks))
        w, opt, versions, (grads, outer), buffers = carry
        out = InFlight(
            w,
            opt,
            versions,
            (grads, jax.tree.map(lambda g: g[None], outer)),
            tuple(b[None] for b in buffers),
        )
        return out, jax.lax.psum(buffers[-1], axis)

    return body
