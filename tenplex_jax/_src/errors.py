"""Errors raised by tenplex_jax.

Every message states the rule first, then the values that broke it: the tree path, the shape, the
PartitionSpec and the mesh with its axis types (``mesh.show_axes``), so that a bad config is fixed
from the message alone; an error about two trees names the leaves that differ
(``tree.difference``). Code that handles an error decides by its class and attributes (``path``,
``reason``, ``lost``), never by its text.
"""

from __future__ import annotations


class TenplexError(Exception):
    """The base of every error tenplex_jax raises: ``except tj.errors.TenplexError`` catches them
    all. Each kind also keeps its standard base (``ValueError`` for bad layouts, data, plans and
    checkpoints; ``RuntimeError`` for stores, virtual workers and the launcher).

    Args:
      message: the rule that was broken, then the values that broke it (the leaf's path, shape,
        spec and mesh where there is one).
    """


class LayoutError(TenplexError, ValueError):
    """A state cannot be laid out as asked (unknown logical axis, indivisible dim, bad device list,
    ...).

    Args:
      message: the rule, then the leaf, its shape, spec and mesh.
      path: the tree path of the leaf it is about, when there is one.

    Attributes:
      path: as given (``None`` when the error is about no one leaf).
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class LeafNotFoundError(LayoutError, KeyError):
    """No leaf has the path asked for (``ptc.leaf(path)``). Also a ``KeyError``, as any lookup
    of a missing key.

    Args:
      message: the path asked for and the paths there are.
      path: the path asked for.
    """

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's own would quote the message


class DataError(TenplexError, ValueError):
    """A dataset, batch layout or saved data position breaks a rule; nothing was consumed.

    Args:
      message: the rule, then the values that broke it.
    """


class CheckpointError(TenplexError, ValueError):
    """A checkpoint is missing, unfinished, or does not fit the state it is restored into.

    Args:
      message: the rule, then the step, leaf and file it is about.
    """


class PlanError(TenplexError, ValueError):
    """Two PTCs cannot be planned between, or a plan does not fit the state it is applied to.

    Args:
      message: the rule, then the leaf in both layouts (path, shape, specs, meshes).
    """


class LostShardsError(PlanError):
    """Some boxes of the state were held only by failed devices: no plan can rebuild them.

    The state can only come back from a checkpoint; ``make_plan(..., failed=...)`` raises it.

    Args:
      src: the source PTC the plan was made from (for the message).
      failed: the failed device ids.
      lost: ``(leaf path, boxes)`` for every leaf with a box that no surviving device holds.

    Attributes:
      failed: the failed device ids, sorted.
      lost: as given.
    """

    def __init__(self, src, failed, lost: tuple[tuple[str, tuple], ...]):
        self.failed = tuple(sorted(failed))
        self.lost = lost
        shown = "; ".join(f"{path} boxes {list(boxes)}" for path, boxes in lost[:6])
        more = f"; and {len(lost) - 6} more leaves" if len(lost) > 6 else ""
        super().__init__(
            f"every shard must survive on some device to be rebuilt from a replica, but "
            f"{len(lost)} leaves have boxes held only by failed devices {list(self.failed)} "
            f"(source {src.config.describe()} on {list(src.device_ids)}): {shown}{more}; restore "
            f"these from a checkpoint"
        )


class StoreError(TenplexError, RuntimeError):
    """A tensor store request failed: bad input, a refused request, a missing or corrupt object,
    or no store reachable.

    Args:
      message: what failed, naming the store, the path and the box.
      reason: which failure, for code to decide on: ``"not_found"``, ``"corrupt"``,
        ``"too_large"``, ``"auth"``, ``"unavailable"``, ``"protocol"``, ``"busy"``,
        ``"refused"``, ``"nonfinite"`` (an accumulate's update holds NaN or Inf, or its sum
        overflows), ...; ``"invalid"`` (the default) for bad arguments caught before anything
        was sent.

    Attributes:
      reason: as given.
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


class StoreProtocolError(TenplexError):
    """A store peer broke the wire framing; the connection cannot continue (the server replies
    with reason ``"protocol"`` and closes it; a client raises ``StoreError``)."""


class WSPError(TenplexError, RuntimeError):
    """An asynchronous job's rule was broken: a dropped virtual worker committing, a wave out of
    order, a malformed ledger.

    Args:
      message: the rule, then the virtual worker and wave it is about.
      reason: which rule, for code to decide on: ``"dropped"`` (the VW was reaped; it must
        stop), ``"refused"`` (the default), ``"corrupt"``, ``"invalid"``, ``"busy"``, ...

    Attributes:
      reason: as given.
    """

    def __init__(self, message: str, reason: str = "refused"):
        super().__init__(message)
        self.reason = reason


class LaunchError(TenplexError, RuntimeError):
    """The launcher cannot go on: no slots left, no copy of the state, too many restarts.

    Args:
      message: the rule, then the values that broke it (slots, restarts, options).
    """


def where(path: str, shape: tuple[int, ...], spec, mesh: str) -> str:
    """The standard tail of an error message: which leaf, its shape, its spec, the mesh (as
    ``ParallelConfig.describe`` or ``mesh.show_mesh`` writes it: with its axis types)."""
    return f"leaf {path!r} (shape={tuple(shape)}, spec={spec}, mesh={mesh})"


def one_of(kinds, value, what: str, error: type[TenplexError]):
    """``kinds(value)``: the member of the ``enum.StrEnum`` ``kinds`` that ``value`` names, or
    ``error`` stating the rule: ``"<what> must be one of (...), got <value>"``."""
    try:
        return kinds(value)
    except ValueError:
        names = tuple(kind.value for kind in kinds)
        raise error(f"{what} must be one of {names}, got {value!r}") from None
