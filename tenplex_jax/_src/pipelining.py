"""Pipeline parallelism over the ``pipe`` mesh axis: a GPipe schedule inside ``jit``.

Stacked layers (every per-layer weight one array with a leading ``layers`` dim, run by
``lax.scan``) are pipelined by sharding that dim over ``pipe``: :func:`pipeline` runs them as a
GPipe schedule in SPMD form, manual over ``pipe`` only, and JAX derives the backward pass. Changing
the pipeline degree is an ordinary reconfiguration of the ``layers`` dim; uneven stages
(:class:`Stages`) are stored padded, and a change of boundaries is a re-padding (:func:`restage`).
``docs/pipelining.md`` states the contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tenplex_jax._src.errors import LayoutError
from tenplex_jax._src.mesh import show_mesh
from tenplex_jax._src.ptc import PTC, Rules

LayerFn = Callable[[jax.Array, Any], jax.Array]  # (activations, one layer's params) -> activations


@dataclasses.dataclass(frozen=True)
class Stages:
    """How stacked layers are split into pipeline stages: ``layers[s]`` real layers on stage ``s``.

    Even stages (``Stages.even(8, 4)`` → ``(2, 2, 2, 2)``) need no padding. Uneven ones are stored
    padded: each stage gets ``slots = max(layers)`` rows, real layers first.

    >>> stages = Stages((1, 3))      # 4 layers: stage 0 holds layer 0, stage 1 layers 1..3
    >>> stages.index                 # padded row -> the layer it holds (-1: padding)
    (0, -1, -1, 1, 2, 3)

    Attributes:
      layers: real layers per stage, in stage order; each at least 1.

    Raises:
      LayoutError: ``layers`` is empty, not integers, or has a stage without a layer.
    """

    layers: tuple[int, ...]

    def __post_init__(self):
        if not self.layers or any(not isinstance(n, (int, np.integer)) for n in self.layers):
            raise LayoutError(f"stages are a tuple of layer counts, got {self.layers!r}")
        if min(self.layers) < 1:
            raise LayoutError(
                f"every pipeline stage needs at least one layer, got layers per stage "
                f"{self.layers} ({len(self.layers)} stages for {sum(self.layers)} layers)"
            )

    @classmethod
    def even(cls, n_layers: int, stages: int) -> Stages:
        """Equal stages: the unpadded layout.

        >>> Stages.even(8, 4).layers
        (2, 2, 2, 2)

        Args:
          n_layers: the stacked layers.
          stages: the pipeline stages (the ``pipe`` axis size).

        Returns:
          ``Stages((n_layers // stages,) * stages)``.

        Raises:
          LayoutError: ``stages`` does not divide ``n_layers``.
        """
        if stages > n_layers or n_layers % stages:
            raise LayoutError(
                f"{n_layers} layers do not split evenly into {stages} pipeline stages "
                f"(needs stages <= layers and layers % stages == 0)"
            )
        return cls((n_layers // stages,) * stages)

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        """Real layers over all stages."""
        return sum(self.layers)

    @property
    def slots(self) -> int:
        """Rows per stage in the stacked layout."""
        return max(self.layers)

    @property
    def is_even(self) -> bool:
        """Whether every stage holds as many layers (no padding rows)."""
        return len(set(self.layers)) == 1

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First layer of every stage, and the layer count at the end: ``(0, 1, 4)`` for (1, 3)."""
        return tuple(int(b) for b in np.concatenate([[0], np.cumsum(self.layers)]))

    @property
    def index(self) -> tuple[int, ...]:
        """Padded row → layer it holds, ``-1`` for padding; ``num_stages * slots`` rows."""
        rows = []
        for start, count in zip(self.boundaries, self.layers):
            rows += list(range(start, start + count)) + [-1] * (self.slots - count)
        return tuple(rows)

    @property
    def mask(self) -> np.ndarray:
        """bool[num_stages * slots]: which rows hold a real layer."""
        return np.asarray(self.index) >= 0

    def pad(self, x: jax.Array) -> jax.Array:
        """One stacked array in the padded layout.

        Args:
          x: an unpadded stacked array, ``(num_layers, ...)``.

        Returns:
          ``(num_stages * slots, ...)``, each stage's layers first, zeros in the padding rows.

        Raises:
          LayoutError: ``x`` has not ``num_layers`` rows.
        """
        self._check_rows(x, self.num_layers, "unpadded")
        index = np.asarray(self.index)
        rows = jnp.take(x, np.maximum(index, 0), axis=0)
        keep = self.mask.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, rows, jnp.zeros_like(rows))

    def unpad(self, x: jax.Array) -> jax.Array:
        """One stacked array back from the padded layout.

        Args:
          x: a padded stacked array, ``(num_stages * slots, ...)``.

        Returns:
          ``(num_layers, ...)``: the real layers in layer order.

        Raises:
          LayoutError: ``x`` has not ``num_stages * slots`` rows.
        """
        self._check_rows(x, self.num_stages * self.slots, "padded")
        return jnp.take(x, np.flatnonzero(self.mask), axis=0)

    def _check_rows(self, x, rows: int, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != rows:
            raise LayoutError(
                f"a {what} stacked array for stages {self.layers} has {rows} rows in its leading "
                f"layers dim, got shape {tuple(x.shape)}"
            )


def pipeline(
    layer_fn: LayerFn,
    layer_params,
    x: jax.Array,
    *,
    mesh: Mesh,
    microbatches: int,
    stages: Stages | None = None,
    axis: str = "pipe",
    remat: bool = True,
    versions: bool = False,
) -> jax.Array:
    """Apply stacked layers to ``x`` as a GPipe pipeline over the ``axis`` mesh axis (the module
    docstring): stage ``s`` holds its rows of the stacked params; microbatches flow from stage
    to stage with ``lax.ppermute``.

    >>> from jax.sharding import AxisType
    >>> devices = jax.devices()[:2]
    >>> mesh = jax.make_mesh((2,), ("pipe",), devices=devices, axis_types=(AxisType.Auto,))
    >>> w = jnp.stack([jnp.eye(3) * (i + 1) for i in range(4)])       # 4 layers, 2 per stage
    >>> pipeline(lambda h, p: h @ p, w, jnp.ones((4, 3)), mesh=mesh, microbatches=2)[0].tolist()
    [24.0, 24.0, 24.0]

    Args:
      layer_fn: ``layer_fn(h, params of one layer) -> h``: one layer.
      layer_params: a pytree of arrays with a leading layers dim (padded when ``stages`` is
        uneven: :meth:`Stages.pad`), sharded over ``axis``.
      x: the activations, ``[batch, ...]``, or a pytree of such arrays that ``layer_fn`` maps to
        one of the same structure (e.g. the activations and a per-example loss every layer adds
        to); the batch dim must divide into ``microbatches``.
      mesh: the mesh, its axes ``Auto`` or ``Explicit`` (without ``axis``: one scan).
      microbatches: how many microbatches the batch is cut into (GPipe's ``m``).
      stages: the layers per stage (default: even stages over ``mesh.shape[axis]``).
      axis: the mesh axis the stages are laid out over.
      remat: recompute each layer in the backward pass (``jax.checkpoint``, as in GPipe), so a
        stage keeps only every layer's input for each microbatch in flight.
      versions: HetPipe's (and PipeDream's) weight stashing: every param leaf has a leading dim
        of ``microbatches`` weight versions before its layers dim (the layers dim sharded over
        ``axis``, the versions not), ``x`` a leading dim of ``microbatches`` (one microbatch
        each: HetPipe's minibatches in flight, not cut from one batch), and microbatch ``j`` runs
        on version ``j`` on every stage, its gradient each microbatch's own. The pipeline fills
        and drains once for all of them: ``microbatches + stages - 1`` ticks.

    Returns:
      What ``lax.scan(lambda h, p: (layer_fn(h, p), None), x, layer_params)[0]`` returns on the
      unpadded layers, to within floating-point reassociation; with ``mesh.shape[axis] == 1`` it
      is that scan. With ``versions``: ``[microbatches, ...]``, microbatch ``j``'s scan over
      version ``j``.

    Raises:
      LayoutError: ``stages`` does not match the axis size, a param leaf has not
        ``num_stages * slots`` rows, there are no params, or the batch does not divide into
        ``microbatches``.
    """
    n_stages = mesh.shape[axis] if axis in mesh.axis_names else 1
    stages = _stages(layer_params, x, stages, n_stages, microbatches, axis, mesh, versions)
    layer_fn = jax.checkpoint(layer_fn) if remat else layer_fn
    if n_stages == 1:
        return _scanned(layer_fn, layer_params, x, stages, versions)
    return _pipelined(layer_fn, layer_params, x, mesh, microbatches, stages, axis, versions)


def _stages(layer_params, x, stages, n_stages, microbatches, axis, mesh, versions) -> Stages:
    """The stages (default: even over the axis), once the params, the activations and the
    microbatches are checked against them (a version each, with ``versions``)."""
    if not jax.tree.leaves(layer_params):
        raise LayoutError("pipeline needs at least one stacked layer parameter, got none")
    if versions:
        _check_versions(layer_params, x, microbatches)
        one = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # a version, as checked below
        layer_params, x, microbatches = jax.tree.map(one, layer_params), jax.tree.map(one, x), 1
    if stages is None:
        stages = Stages.even(jax.tree.leaves(layer_params)[0].shape[0], n_stages)
    _check(layer_params, x, stages, n_stages, microbatches, axis, mesh)
    return stages


def _scanned(layer_fn: LayerFn, layer_params, x, stages: Stages, versions: bool):
    """One stage: the layers as one scan (one after another per version, with ``versions``)."""
    mask, uneven = jnp.asarray(stages.mask), not stages.is_even
    if versions:
        return jax.vmap(lambda p, h: _layers(layer_fn, p, mask, h, uneven))(layer_params, x)
    return _layers(layer_fn, layer_params, mask, x, uneven)


def _pipelined(layer_fn, layer_params, x, mesh, microbatches, stages, axis, versions):
    """The GPipe schedule (:func:`_gpipe`) in a ``shard_map`` manual over ``axis``."""
    n_stages, uneven = stages.num_stages, not stages.is_even
    # Microbatch j takes rows j, j + m, j + 2m, ...: a reshape that keeps the batch sharding.
    split = lambda a: jnp.swapaxes(
        a.reshape((a.shape[0] // microbatches, microbatches) + a.shape[1:]), 0, 1
    )
    xs = x if versions else jax.tree.map(split, x)
    masks = stages.mask.reshape(n_stages, stages.slots)

    def spmd(params, xs):
        # each stage's rows of the mask, a constant picked by the stage's index: not an input,
        # whose sharding would have to match the spec on an Explicit pipe axis
        mask = jnp.asarray(masks)[jax.lax.axis_index(axis)]
        return _gpipe(layer_fn, params, mask, xs, n_stages, axis, uneven, versions)

    context = _context_mesh(mesh)
    run = jax.shard_map(
        spmd,
        mesh=context,
        in_specs=(P(None, axis) if versions else P(axis), P()),
        out_specs=P(),
        axis_names=_manual_axes(context, axis),
    )
    ys = run(layer_params, xs)
    if versions:
        return ys
    return jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1).reshape((-1,) + y.shape[2:]), ys)


def _context_mesh(mesh: Mesh):
    """The mesh to map over. Inside another ``shard_map`` (the gradient units' is manual
    over ``data`` and ``fsdp``) it is the context's abstract mesh, whose axis types say
    which axes are manual already; ``shard_map`` refuses a mesh that differs from its context's."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.shape_tuple == mesh.shape_tuple:
        return context
    return mesh


def _manual_axes(mesh, axis: str) -> frozenset[str]:
    """The axes the pipeline maps over manually: ``axis``, and every axis still automatic when an
    enclosing ``shard_map`` is manual over an axis that comes after ``axis`` in mesh order, or
    when all of them have size 1 (a body with an automatic axis has JAX annotate every op with an
    open sharding: a third of a GPT step's program, compiled for nothing).

    XLA aborts the process compiling a ``shard_map`` nested in one manual over a later mesh axis
    while some axis stays automatic ("Manual axes must be sorted by mesh axis index", jax 0.11 and
    0.12, CPU and GPU): the gradient units' ``shard_map`` over ``data``/``fsdp`` around a pipeline
    over ``pipe`` on the (pipe, data, fsdp, tensor) mesh. Making the free axes manual too leaves no
    automatic axis; a stage then holds its layers whole over them and computes them redundantly
    (no cost where they have size 1)."""
    names = tuple(mesh.axis_names)
    manual = set(mesh.manual_axes)
    free = frozenset(n for n in names if n not in manual)
    if all(mesh.shape[n] == 1 for n in free - {axis}):
        return free
    if not any(names.index(m) > names.index(axis) for m in manual):
        return frozenset({axis})
    return free


def _layers(layer_fn: LayerFn, params, mask: jax.Array, h: jax.Array, uneven: bool) -> jax.Array:
    """The stacked layers one after another; with ``uneven``, rows where ``mask`` is false are
    padding and skipped (``lax.cond`` runs one branch: no compute, zero gradient)."""

    def body(h, row):
        p, real = row
        if uneven:
            return jax.lax.cond(real, layer_fn, lambda h, _: h, h, p), None
        return layer_fn(h, p), None

    return jax.lax.scan(body, h, (params, mask))[0]


def _gpipe(
    layer_fn: LayerFn, params, mask, xs, n_stages: int, axis: str, uneven: bool, versions=False
):
    """One stage's view of the schedule: ``xs`` is ``[microbatches, mb, ...]`` on every stage;
    with ``versions`` each param leaf is ``[microbatches, slots, ...]`` and the stage runs the
    microbatch it holds on that microbatch's version."""
    stage = jax.lax.axis_index(axis)
    n_micro = jax.tree.leaves(xs)[0].shape[0]
    last = n_stages - 1
    shift = [(s, (s + 1) % n_stages) for s in range(n_stages)]
    where = lambda c, a, b: jax.tree.map(lambda u, v: jnp.where(c, u, v), a, b)

    def tick(carry, t):
        held, outputs = carry
        # stage 0 takes in microbatch t; the others take what the previous stage passed on
        index = jnp.minimum(t, n_micro - 1)
        fresh = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), xs)
        held = where(stage == 0, fresh, held)
        weights = params
        if versions:  # the microbatch this stage holds at tick t entered at tick t - stage
            version = jnp.clip(t - stage, 0, n_micro - 1)
            weights = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, version, keepdims=False), params
            )
        held = _layers(layer_fn, weights, mask, held, uneven)
        done = t - last  # the microbatch the last stage finishes at this tick
        slot = jnp.clip(done, 0, n_micro - 1)
        write = (stage == last) & (done >= 0)

        def store(out, new):
            current = jax.lax.dynamic_index_in_dim(out, slot, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                out, jnp.where(write, new, current), slot, axis=0
            )

        outputs = jax.tree.map(store, outputs, held)
        return (jax.lax.ppermute(held, axis, shift), outputs), None

    # the carries differ between stages: mark them varying over the pipe axis
    zeros = jax.tree.map(jnp.zeros_like, (jax.tree.map(lambda a: a[0], xs), xs))
    start = jax.lax.pcast(zeros, (axis,), to="varying")
    (_, outputs), _ = jax.lax.scan(tick, start, jnp.arange(n_micro + n_stages - 1))
    # only the last stage wrote outputs: the sum over stages hands them to every stage
    return jax.tree.map(
        lambda out: jax.lax.psum(jnp.where(stage == last, out, jnp.zeros_like(out)), axis), outputs
    )


def _check_versions(params, x, microbatches: int) -> None:
    """With ``versions``: every param leaf and activation leads with ``microbatches``."""
    for name, tree in (("param", params), ("activation", x)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if leaf.ndim < 2 or leaf.shape[0] != microbatches:
                raise LayoutError(
                    f"with versions, every {name} leaf leads with the {microbatches} "
                    f"microbatches' versions: {jax.tree_util.keystr(path)!r} has shape "
                    f"{tuple(leaf.shape)}"
                )


def _check(params, x, stages: Stages, n_stages: int, microbatches: int, axis: str, mesh) -> None:
    mesh_text = show_mesh(mesh, devices=False)
    if stages.num_stages != n_stages:
        raise LayoutError(
            f"the stage split {stages.layers} has {stages.num_stages} stages but mesh axis "
            f"{axis!r} has size {n_stages} (mesh={mesh_text})"
        )
    rows = stages.num_stages * stages.slots
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if leaf.ndim == 0 or leaf.shape[0] != rows:
            raise LayoutError(
                f"every stacked layer parameter needs {rows} rows (stages {stages.layers}, "
                f"{stages.slots} slots each) in its leading layers dim: leaf "
                f"{jax.tree_util.keystr(path)!r} has shape {tuple(leaf.shape)} (mesh={mesh_text})"
            )
    if not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
        raise LayoutError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    shapes = [tuple(a.shape) for a in jax.tree.leaves(x)]
    if not shapes or any(not s or s[0] % microbatches or s[0] != shapes[0][0] for s in shapes):
        raise LayoutError(
            f"the batch dim must divide into {microbatches} microbatches, the same in every "
            f"activation, got activations of shape {shapes[0] if len(shapes) == 1 else shapes} "
            f"(mesh={mesh_text})"
        )


def restage(
    state, ptc: PTC, rules: Rules, old: Stages | None, new: Stages | None, *, name="layers"
):
    """Re-pad the stacked leaves of ``state`` from ``old`` to ``new`` stage boundaries.

    Returns ``(state, PTC)``: the state with every leaf whose first logical axis is ``name``
    (params and their optimizer moments alike) re-padded, still on ``ptc``'s devices and mesh, and
    its PTC. ``None`` stands for the unpadded layout (even stages). This is the one step an uneven
    pipeline adds to a reconfiguration: the padded layout depends on the boundaries, so rows are
    regrouped first (a gather on the current devices); the core plan then moves them to the new
    devices like any other change of layout::

        state, mid = restage(state, ptc, rules, Stages((3, 5)), Stages((2, 2, 2, 2)))
        state, report = reshard(state, make_plan(mid, new_ptc))

    A dim the current ``pipe`` size does not divide after re-padding is replicated on the current
    mesh (``allow_replicate``) until the plan moves it.

    Args:
      state: an ``nnx.State`` laid out as ``ptc``; its stacked variables carry logical names
        whose first is ``name``.
      ptc: the state's current layout.
      rules: the logical-axis rules, to lay the re-padded state out on the current mesh.
      old: the stage boundaries the state is padded for (``None``: unpadded).
      new: the boundaries to pad for (``None``: unpadded).
      name: the logical name of the stacked layers dim.

    Returns:
      ``(state, mid)``: the re-padded state and its PTC ``mid`` (same config and devices as
      ``ptc``), the source of the plan to the new layout.

    Raises:
      LayoutError: a stacked leaf has not the rows ``old`` needs.
    """

    def regroup(x):
        rows = x if old is None else old.unpad(x)
        return rows if new is None else new.pad(rows)

    stacked = lambda v: (v.get_metadata().get("out_sharding") or (None,))[0] == name
    is_var = lambda x: isinstance(x, nnx.Variable)
    pick = lambda v: v.replace(regroup(v.get_value())) if is_var(v) and stacked(v) else v
    abstract = jax.eval_shape(lambda s: jax.tree.map(pick, s, is_leaf=is_var), state)
    mid = PTC.of(abstract, rules, ptc.config, ptc.device_ids, hosts=ptc.hosts, allow_replicate=True)
    mesh = ptc.mesh()
    out = jax.jit(
        lambda s: jax.tree.map(pick, s, is_leaf=is_var), out_shardings=mid.shardings(mesh)
    )(state)
    return out, mid
