"""The processes of one virtual worker: a VW whose devices span processes (nodes).

A VW over nodes (HetPipe's equal grouping) runs its programs SPMD in a ``jax.distributed`` job of
its own. JAX requires every process of a job to run the same programs in the same order, and the
VW's program depends on the parameter server's answers. So one process, the VW's **leader** (its
process 0), alone talks to the parameter server and decides; :meth:`Group.agree` hands each
decision, or the exception it raised, to the others (the **followers**) in order: small values
through the job's key-value store, the numpy arrays within them by a broadcast over the VW's
devices. A VW in one process is a group of one: nothing is sent. Only the leader heartbeats: the
runner ends all of a VW's processes when one dies (``tj.wsp.Processes``), and a follower waits
for a decision at most ``timeout`` seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.multihost import distributed

T = TypeVar("T")
PREFIX = "tenplex_jax/wsp/decision/"
KEPT = 64  # decisions the key-value store keeps: followers lag the leader by a wave's few


@dataclasses.dataclass
class Group:
    """The processes of one VW (see the module's docstring).

    Args:
      index: this process's index in the VW (0: the leader).
      count: the VW's processes.
      client: the VW's ``jax.distributed`` client (its key-value store); None for a group of one.
      timeout: seconds a follower waits for the leader's next decision.

    Attributes:
      decisions: how many decisions were agreed.
    """

    index: int = 0
    count: int = 1
    client: Any = None
    timeout: float = 600.0
    decisions: int = 0

    @classmethod
    def of_jax(cls, timeout: float = 600.0) -> Group:
        """This process's group: the processes of its ``jax.distributed`` job (one process, and
        no client, when there is none).

        Args:
          timeout: seconds a follower waits for the leader's next decision.
        """
        if jax.process_count() == 1:
            return cls(timeout=timeout)
        return cls(
            jax.process_index(), jax.process_count(), distributed.distributed_client(), timeout
        )

    @property
    def leader(self) -> bool:
        """Whether this process decides (talks to the parameter server)."""
        return self.index == 0

    def agree(self, decide: Callable[[], T]) -> T:
        """``decide()``, called by the leader alone (a request to the parameter server); every
        process returns its value (any picklable value: its numpy arrays are broadcast over the
        VW's devices), or raises what it raised.

        Raises:
          WSPError: a follower waited ``timeout`` seconds for the leader (``"unavailable"``);
            or whatever ``decide`` raised.
        """
        if self.count == 1:
            return decide()
        key = f"{PREFIX}{self.decisions}"
        self.decisions += 1
        if self.leader:
            value, error = self._send(key, decide)
        else:
            value, error = self._receive(key)
        if error is not None:
            raise error
        return value

    def _send(self, key: str, decide: Callable[[], T]) -> tuple[T | None, Exception | None]:
        """The leader's side: decide, then hand the value or the error to the followers."""
        try:
            value, error = decide(), None
        except Exception as raised:
            value, error = None, raised
        arrays: list[np.ndarray] = []
        try:
            payload = _dumps((value, error), arrays)
        except Exception as unpicklable:  # every process raises this instead
            failed = error or unpicklable
            value, error = None, WSPError(f"the leader's decision failed: {failed!r}", "failed")
            arrays, payload = [], _dumps((None, error), [])
        meta = [(a.shape, a.dtype.str) for a in arrays]
        self.client.key_value_set_bytes(key, pickle.dumps((meta, payload)))
        if self.decisions > KEPT:
            self.client.key_value_delete(f"{PREFIX}{self.decisions - 1 - KEPT}")
        if arrays:
            distributed.broadcast_one_to_all(arrays, is_source=True)
        return value, error

    def _receive(self, key: str) -> tuple[Any, Exception | None]:
        """A follower's side: the leader's value or error, its arrays by the broadcast."""
        try:
            got = self.client.blocking_key_value_get_bytes(key, int(self.timeout * 1000))
        except Exception as lost:
            raise WSPError(
                f"process {self.index} of a virtual worker waited {self.timeout:.0f} s for "
                f"its leader's decision {self.decisions - 1} ({lost})",
                "unavailable",
            ) from lost
        meta, payload = pickle.loads(got)
        arrays = [np.zeros(shape, np.dtype(dtype)) for shape, dtype in meta]
        if arrays:
            arrays = list(distributed.broadcast_one_to_all(arrays, is_source=False))
        return _loads(payload, arrays)

    def replicated(self, arrays: Sequence[jax.Array], mesh) -> list[jax.Array]:
        """``arrays`` (on the VW's ``mesh``) whole on every device, so that the leader can copy
        them to its host: an all-gather every process runs (at the same point of its program).
        A group of one returns them as they are."""
        if self.count == 1:
            return list(arrays)
        whole = NamedSharding(mesh, PartitionSpec())
        return list(_gather(tuple(whole for _ in arrays))(*arrays))


@functools.lru_cache(maxsize=16)
def _gather(shardings: tuple):
    """The identity, laid out as ``shardings``: compiled once per layout."""
    return jax.jit(lambda *xs: xs, out_shardings=shardings)


class _Pickler(pickle.Pickler):
    """Pickles numpy arrays by reference: each goes to ``arrays`` (for the broadcast)."""

    def __init__(self, file, arrays: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays

    def persistent_id(self, obj):
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            # not np.ascontiguousarray: it makes a scalar (a step count) an array of shape (1,)
            self.arrays.append(np.require(obj, requirements="C"))
            return len(self.arrays) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid):
        return self.arrays[pid]


def _dumps(value, arrays: list) -> bytes:
    out = io.BytesIO()
    _Pickler(out, arrays).dump(value)
    return out.getvalue()


def _loads(payload: bytes, arrays: list):
    return _Unpickler(io.BytesIO(payload), [np.asarray(a) for a in arrays]).load()
