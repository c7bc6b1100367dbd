"""Errors raised by tenplex_jax.

Every message states the rule first, then the values that broke it: the tree path, the shape, the
PartitionSpec and the mesh, so that a bad config is fixed from the message alone.
"""

from __future__ import annotations


class TenplexError(Exception):
    """The base of every error tenplex_jax raises: ``except tj.errors.TenplexError`` catches them
    all. Each kind also keeps its standard base (``ValueError`` for bad layouts, data, plans and
    checkpoints; ``RuntimeError`` for stores, virtual workers and the launcher)."""


class LayoutError(TenplexError, ValueError):
    """A state cannot be laid out as asked (unknown logical axis, indivisible dim, bad device list,
    ...). ``path`` is the tree path of the leaf it is about, when the message names one."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class DataError(TenplexError, ValueError):
    """A dataset, batch layout or saved data position breaks a rule; nothing was consumed."""


class CheckpointError(TenplexError, ValueError):
    """A checkpoint is missing, unfinished, or does not fit the state it is restored into."""


class PlanError(TenplexError, ValueError):
    """Two PTCs cannot be planned between, or a plan does not fit the state it is applied to."""


class LostShardsError(PlanError):
    """Some boxes of the state were held only by failed devices: no plan can rebuild them.

    ``lost`` lists ``(leaf path, boxes)`` for every leaf with a box that no surviving device holds;
    the state can only come back from a checkpoint.
    """

    def __init__(self, src, failed, lost: tuple[tuple[str, tuple], ...]):
        self.failed = tuple(sorted(failed))
        self.lost = lost
        shown = "; ".join(f"{path} boxes {list(boxes)}" for path, boxes in lost[:6])
        more = f"; and {len(lost) - 6} more leaves" if len(lost) > 6 else ""
        super().__init__(
            f"every shard must survive on some device to be rebuilt from a replica, but "
            f"{len(lost)} leaves have boxes held only by failed devices {list(self.failed)} "
            f"(source {src.config} on {list(src.device_ids)}): {shown}{more}; restore these from "
            f"a checkpoint"
        )


class StoreError(TenplexError, RuntimeError):
    """A tensor store request failed: bad input, a refused request, a missing or corrupt object,
    or no store reachable. ``reason`` says which: ``"not_found"``, ``"corrupt"``, ``"too_large"``,
    ``"auth"``, ``"unavailable"``, ``"protocol"``, ``"refused"``, ...; ``"invalid"`` for bad
    arguments caught before anything was sent."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


class StoreProtocolError(TenplexError):
    """A store peer broke the wire framing; the connection cannot continue (the server replies
    with reason ``"protocol"`` and closes it; a client raises ``StoreError``)."""


class WSPError(TenplexError, RuntimeError):
    """An asynchronous job's rule was broken: a dropped virtual worker committing, a wave out of
    order, a malformed ledger. ``reason``: ``"dropped"``, ``"refused"``, ``"corrupt"``, ..."""

    def __init__(self, message: str, reason: str = "refused"):
        super().__init__(message)
        self.reason = reason


class LaunchError(TenplexError, RuntimeError):
    """The launcher cannot go on: no slots left, no copy of the state, too many restarts."""


def where(path: str, shape: tuple[int, ...], spec, mesh) -> str:
    """The standard tail of an error message: which leaf, its shape, its spec, the mesh."""
    return f"leaf {path!r} (shape={tuple(shape)}, spec={spec}, mesh={mesh})"
