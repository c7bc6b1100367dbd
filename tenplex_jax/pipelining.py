"""Pipeline parallelism over a ``pipe`` mesh axis: a GPipe schedule inside ``jit``.

A model whose layers are stacked (every per-layer weight one array with a leading ``layers`` dim)
runs them as a pipeline with :func:`pipeline`; :class:`Stages` says how many layers each stage
holds (uneven stages are padded); :func:`restage` re-pads a state for new stage boundaries.
"""

from tenplex_jax._src.pipelining import Stages, pipeline, restage

__all__ = ["Stages", "pipeline", "restage"]
