"""What the planner knows about a model: per-layer FLOPs, parameter and activation bytes.

``ModelProfile.measure`` derives a profile from the model's own functions without running them:
FLOPs from XLA's cost analysis of the lowered layer, parameter bytes from the abstract params, and
the bytes a layer keeps for its backward pass from the residuals of ``jax.vjp`` under
``jax.eval_shape``
(measured at batch 1 and 2, so that what does not grow with the batch, such as the weights the
backward pass reads, drops out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tenplex_jax._src.errors import PlanError

MESH_DIVISORS = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer, per sample: forward FLOPs, bytes kept for backward, output bytes.

    Attributes:
      flops: forward FLOPs per sample.
      param_bytes: the layer's parameter bytes, independent of the batch.
      act_bytes: bytes per sample the layer keeps for its backward pass.
      out_bytes: bytes per sample of its output: what a pipeline stage sends on and tensor
        parallelism all-reduces.
    """

    flops: float
    param_bytes: int
    act_bytes: int
    out_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A model as the planner sees it: per-layer costs, usually from :meth:`measure`.

    >>> layer = LayerProfile(flops=2e9, param_bytes=50_000_000, act_bytes=10**6, out_bytes=10**5)
    >>> profile = ModelProfile("toy", (layer,) * 8, LayerProfile(1e8, 10**7, 10**5, 0))
    >>> profile.num_layers, profile.param_bytes
    (8, 410000000)

    Attributes:
      name: the model's name, for messages and tables.
      layers: the stacked, pipelined layers in order.
      outside: what runs outside the pipeline on every stage (embedding, head, loss).
      divides: ``(mesh axis, dim name, dim size)`` rules: the axis's size must divide that dim
        (``("tensor", "heads", 12)``); the axis is ``data``, ``fsdp`` or ``tensor``.
      state_factor: train-state bytes per parameter byte (params, grads and two AdamW moments:
        4).

    Raises:
      PlanError: no layers, or a ``divides`` rule names another axis.
    """

    name: str
    layers: tuple[LayerProfile, ...]
    outside: LayerProfile
    divides: tuple[tuple[str, str, int], ...] = ()
    state_factor: float = 4.0

    def __post_init__(self):
        if not self.layers:
            raise PlanError(f"model {self.name!r} has no layers to place")
        for axis, dim, size in self.divides:
            if axis not in MESH_DIVISORS:
                raise PlanError(
                    f"model {self.name!r}: divisibility rule ({axis!r}, {dim!r}, {size}) names an "
                    f"unknown mesh axis; known: {MESH_DIVISORS}"
                )

    @property
    def num_layers(self) -> int:
        """Stacked layers."""
        return len(self.layers)

    @property
    def param_bytes(self) -> int:
        """Parameter bytes of the whole model, the outside part included."""
        return sum(layer.param_bytes for layer in self.layers) + self.outside.param_bytes

    @classmethod
    def measure(
        cls,
        name: str,
        layer: tuple[Callable, Any, Callable[[int], Any]],
        outside: tuple[Callable, Any, Callable[[int], Any]],
        n_layers: int,
        *,
        divides: Sequence[tuple[str, str, int]] = (),
        state_factor: float = 4.0,
    ) -> ModelProfile:
        """Profile ``n_layers`` identical layers and the outside part, from abstract values.

        Nothing runs: FLOPs come from XLA's cost analysis of the lowered functions, activation
        bytes from the residuals of ``jax.vjp`` under ``jax.eval_shape``, at batch 1 and 2 (what
        does not grow with the batch drops out). Example::

            hidden = lambda b: jax.ShapeDtypeStruct((b, seq_len, d_model), jnp.float32)
            tokens = lambda b: jax.ShapeDtypeStruct((b, seq_len), jnp.int32)
            profile = ModelProfile.measure(
                "gpt", (block, one_layer_params, hidden), (embed_and_loss, outer_params, tokens),
                n_layers=12, divides=(("tensor", "heads", 8),))   # models/gpt.py: profile()

        Args:
          name: the model's name.
          layer: ``(fn(x, params) -> x, params of one layer, batch -> x)``: the stacked layer,
            its params (arrays or ``jax.ShapeDtypeStruct``) and a function that builds an
            abstract input of a given batch size.
          outside: ``(fn(params, inputs) -> loss, params, batch -> inputs)``: the part outside
            the pipeline, alike.
          n_layers: how many times the layer is stacked.
          divides: the ``ModelProfile.divides`` rules.
          state_factor: train-state bytes per parameter byte.

        Returns:
          The profile: ``n_layers`` copies of the layer's costs and the outside part's.

        Raises:
          PlanError: as the :class:`ModelProfile` constructor.
        """
        fn, params, example = layer
        one = _profile(lambda p, x: fn(x, p), params, example, out=True)
        fn, params, example = outside
        rest = _profile(fn, params, example, out=False)
        return cls(name, (one,) * n_layers, rest, tuple(divides), state_factor)


def _profile(fn: Callable, params, example: Callable[[int], Any], out: bool) -> LayerProfile:
    flops, acts = [], []
    for batch in (1, 2):
        x = example(batch)
        cost = jax.jit(fn).lower(params, x).cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops.append(float(cost.get("flops", 0.0)))
        residuals = jax.eval_shape(lambda p, x: jax.vjp(fn, p, x)[1], params, x)
        acts.append(_nbytes(residuals))
    out_bytes = _nbytes(jax.eval_shape(fn, params, example(1))) if out else 0
    return LayerProfile(flops[1] - flops[0], _nbytes(params), acts[1] - acts[0], out_bytes)


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
