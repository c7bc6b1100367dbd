"""Bitwise training across layout changes: what XLA must be told, and what a step must do.

A job with ``JobOptions(bitwise=True)`` splits each global batch over *every* mesh axis and takes
the gradient in units (:func:`tenplex_jax.data.batch_value_and_grad`): each unit's forward and
backward run whole, on whole weights, with the same shapes on every layout, and the units'
gradients are added in unit order. The layout (data, fsdp, tensor, pipe, expert) then only says
where the state is stored, as in ZeRO-3, so no reduction's order depends on it; what is left is
the optimizer's element-wise update, whose rounding XLA must not tie to the shard shapes:

- XLA:CPU contracts a multiply and an add into one FMA in its scalar loops but not in its
  vector loops, and which loop a fusion gets depends on its shape (measured with jaxlib 0.12:
  ``0.9 * a + 0.1 * b`` rounds differently on ``f32[2,32,4,8]`` than on ``f32[2,32,2,8]``).
  ``--xla_cpu_max_isa=AVX`` (no FMA instructions) makes every loop round alike.
- XLA:GPU's reductions and scatters may use atomics: ``--xla_gpu_deterministic_ops=true``.

:func:`use_flags` adds them to ``XLA_FLAGS`` before JAX starts its backends; :func:`unmet` says
why a platform is not bitwise. :func:`watch` tells whether a step, while it is traced, takes its
gradient in units over every mesh axis (``_by_units`` calls :func:`note`).
"""

from __future__ import annotations

import contextlib
import os
import threading

from tenplex_jax._src import compat

FLAGS = {"cpu": ("--xla_cpu_max_isa", "AVX"), "gpu": ("--xla_gpu_deterministic_ops", "true")}
"""Per platform, the XLA flag and value that bitwise training needs."""

_NO_FMA = {"SSE4_2", "AVX"}  # the ISAs XLA:CPU may be capped at that have no FMA instructions


def use_flags() -> None:
    """Add the flags bitwise training needs (:data:`FLAGS`) to the ``XLA_FLAGS`` environment
    variable, where they are not set already; call it before JAX starts its backends (before the
    first ``jax.devices()`` or computation).

    Raises:
      RuntimeError: JAX's backends are running without the flags: the process must set them
        before they start.
    """
    missing = [flag for platform, flag in FLAGS.items() if unmet(platform) is not None]
    if not missing:
        return
    if compat.backends_started():
        raise RuntimeError(
            f"JAX's backends have started without {' '.join(_show(f) for f in missing)} in "
            f"XLA_FLAGS: call tj.elastic.use_bitwise_flags() before the first jax.devices() or "
            f"computation, or start the process with them set"
        )
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join([*flags, *(_show(f) for f in missing)])


def unmet(platform: str) -> str | None:
    """Why training on ``platform`` (``"cpu"``, ``"gpu"``, ...) is not bitwise across layouts,
    or None: ``XLA_FLAGS`` holds what :data:`FLAGS` asks for it."""
    if platform not in FLAGS:
        return None
    name = FLAGS[platform][0]
    given = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        key, _, setting = flag.partition("=")
        if key == name:
            given = setting
    if platform == "cpu" and given is not None and given.upper() in _NO_FMA:
        return None
    if platform != "cpu" and given is not None and given.lower() in ("true", "1"):
        return None
    why = {
        "cpu": "XLA:CPU rounds element-wise ops by shard shape (FMA in scalar loops only)",
        "gpu": "XLA:GPU's reductions may use atomics",
    }[platform]
    return f"{why}: XLA_FLAGS needs {_show(FLAGS[platform])} (tj.elastic.use_bitwise_flags())"


def _show(flag: tuple[str, str]) -> str:
    return f"{flag[0]}={flag[1]}"


class Seen:
    """What :func:`watch` saw while a step was traced: gradients taken in units over every mesh
    axis (``every``), in units over some axes (``some``), and otherwise (``plain``)."""

    def __init__(self):
        self.every = self.some = self.plain = 0

    @property
    def by_units(self) -> bool:
        """Every gradient in units: bitwise across changes of the sizes of the batch axes."""
        return self.every + self.some > 0 and self.plain == 0

    @property
    def bitwise(self) -> bool:
        """Every gradient in units over every axis: bitwise across any change."""
        return self.by_units and self.some == 0


_watching = threading.local()


@contextlib.contextmanager
def watch():
    """``with watch() as seen:`` trace a step; ``seen.bitwise`` then says whether it took its
    gradient in units over every mesh axis, and nothing else. Per thread (steps are traced on
    compile threads)."""
    outer = getattr(_watching, "seen", None)
    _watching.seen = seen = Seen()
    try:
        yield seen
    finally:
        _watching.seen = outer


def note(units: bool, every_axis: bool = False) -> None:
    """Called as a gradient is traced: in units (over every mesh axis, or some), or not."""
    seen = getattr(_watching, "seen", None)
    if seen is not None:
        if not units:
            seen.plain += 1
        elif every_axis:
            seen.every += 1
        else:
            seen.some += 1
