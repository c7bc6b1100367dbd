"""``ReplicatedStore``: host i's objects on stores i .. i+k (mod n); reads fall back to replicas."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from tenplex_jax._src.box import Box, Shape
from tenplex_jax._src.errors import StoreError
from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.client import _MISSING, StoreClient
from tenplex_jax._src.multihost.store.wire import ObjectInfo


class ReplicatedStore:
    """Stores on n hosts; host i's objects are also written to hosts i+1 .. i+k (mod n).

    ``put`` writes the copies in parallel (one thread per store), so replication costs about one
    write. ``get`` reads from the writer's host first, then its replicas, then the other stores;
    a store that does not answer within ``connect_timeout`` is skipped. A context manager.
    Example::

        with ReplicatedStore([p.address for p in procs], replicas=1) as stores:
            stores.put(0, "v1/w", w)                 # on stores 0 and 1
            stores.get("v1/w", prefer=0)             # from store 1 if store 0 is down

    Args:
      addresses: the stores' addresses, one per host, in host order.
      replicas: copies beyond the writer's, ``0 <= replicas < len(addresses)``.
      token: the stores' secret, if any.
      timeout: seconds any socket operation may take.
      connect_timeout: seconds a store gets to answer a new connection before it is skipped.

    Raises:
      StoreError: no addresses, or ``replicas`` out of range.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        replicas: int = 1,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 2.0,
    ):
        addresses = list(addresses)
        if not addresses:
            raise StoreError("a ReplicatedStore needs at least one store address")
        if not 0 <= replicas < len(addresses):
            raise StoreError(
                f"replicas must be in [0, number of stores - 1]; got replicas={replicas} for "
                f"{len(addresses)} stores {addresses}"
            )
        self.addresses = addresses
        self.replicas = replicas
        self.clients = [
            StoreClient(a, token=token, timeout=timeout, connect_timeout=connect_timeout)
            for a in addresses
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(addresses), thread_name_prefix="store-put"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def holders(self, host: int) -> list[int]:
        """The stores that hold one host's objects.

        Args:
          host: the writer's host index.

        Returns:
          Store indices: ``host``, then its ``replicas`` successors (mod n).

        Raises:
          StoreError: ``host`` is out of range.
        """
        n = len(self.clients)
        if not 0 <= host < n:
            raise StoreError(f"host must be in [0, {n}); got {host}")
        return [(host + i) % n for i in range(self.replicas + 1)]

    def put(
        self,
        host: int,
        path: str,
        array,
        *,
        box: Box | None = None,
        global_shape: Shape | None = None,
        durable: bool = False,
        min_copies: int | None = None,
    ) -> list[int]:
        """Write an array to its host's stores, ``host, host+1 .. host+k`` (mod n), in parallel.

        Args:
          host: the writer's host index.
          path: the object's path.
          array: the array (as ``StoreClient.put``).
          box: the block of the global array it covers (default: the whole array).
          global_shape: the global array's shape (default: the box's extent).
          durable: acknowledge each copy only once it is on disk.
          min_copies: the fewest copies that must be written (default: all ``k + 1``).

        Returns:
          The indices of the stores written.

        Raises:
          StoreError: fewer than ``min_copies`` copies were written (``"unavailable"``); the
            message names each failed store.
        """
        targets = self.holders(host)
        need = len(targets) if min_copies is None else min_copies
        array = np.asarray(array, order="C")  # once, not per copy
        # each copy is checksummed chunk by chunk as it is sent, while the chunk is in cache
        futures = {
            i: self._pool.submit(
                self.clients[i].put,
                path,
                array,
                box=box,
                global_shape=global_shape,
                durable=durable,
            )
            for i in targets
        }
        written, failed = self._gather(futures)
        if len(written) < need:
            raise StoreError(
                f"put of {path!r} box {box} from host {host} reached {len(written)} of "
                f"{len(targets)} stores (needed {need}): " + "; ".join(failed),
                "unavailable",
            )
        return written

    def get(self, path: str, box: Box | None = None, *, prefer: int) -> np.ndarray:
        """Read a box of an object from the first store that has it.

        Args:
          path: the object's path.
          box: the block to read (``None``: the whole object), as ``StoreClient.get``.
          prefer: the writer's host: its store is tried first, then its replicas, then the
            others.

        Returns:
          The box as a new array.

        Raises:
          StoreError: no store holds it (``"not_found"``); the message names the path, the box
            and every store tried with its reason.
        """
        order = self.holders(prefer)
        order += [i for i in range(len(self.clients)) if i not in order]
        tried = []
        for i in order:
            try:
                return self.clients[i].get(path, box)
            except StoreError as error:
                tried.append(f"store {i} ({self.addresses[i]}): {error.reason}")
        raise StoreError(
            f"no store holds {path!r} box {None if box is None else wire.as_box(box)} (host "
            f"{prefer} writes to stores {self.holders(prefer)}); tried " + "; ".join(tried),
            "not_found",
        )

    def _gather(self, futures: dict) -> tuple[list[int], list[str]]:
        """(stores whose write succeeded, a message per store whose write failed)."""
        written, failed = [], []
        for i, future in futures.items():
            try:
                future.result()
                written.append(i)
            except StoreError as error:
                failed.append(f"store {i} ({self.addresses[i]}): {error}")
        return written, failed

    def alive(self) -> list[bool]:
        """Whether each store answers, checked in parallel."""
        return list(self._pool.map(lambda c: c.ping(), self.clients))

    def list(self, prefix: str = "") -> list[list[ObjectInfo] | None]:
        """Each store's objects under a prefix.

        Args:
          prefix: a plain string prefix of paths.

        Returns:
          Per store, its :class:`ObjectInfo` records, or ``None`` for a store that fails.
        """
        return list(self._pool.map(lambda c: _or_none(c.list, prefix), self.clients))

    def delete(self, prefix: str) -> list[int | None]:
        """Delete the objects under a prefix on every store that answers.

        Args:
          prefix: a plain string prefix of paths.

        Returns:
          Per store, how many objects it deleted, or ``None`` for a store that fails.
        """
        return list(self._pool.map(lambda c: _or_none(c.delete, prefix), self.clients))

    def put_json(
        self, path: str, obj: Any, *, stores: Sequence[int] | None = None, flush: bool = True
    ) -> list[int]:
        """Write a JSON object to several stores in parallel.

        Args:
          path: the object's path.
          obj: plain JSON.
          stores: the store indices to write (default: all).
          flush: as ``StoreClient.put_json``: only after each store's earlier puts are on disk.

        Returns:
          The indices of the stores written.

        Raises:
          StoreError: no store was written (``"unavailable"``); the message names each failure.
        """
        targets = range(len(self.clients)) if stores is None else stores
        futures = {
            i: self._pool.submit(self.clients[i].put_json, path, obj, flush=flush) for i in targets
        }
        written, failed = self._gather(futures)
        if not written:
            raise StoreError(
                f"put_json of {path!r} reached no store: " + "; ".join(failed), "unavailable"
            )
        return written

    def get_json(self, path: str, default: Any = _MISSING, *, prefer: int = 0) -> Any:
        """Read a JSON object from the first store that has it.

        Args:
          path: the object's path.
          default: returned when no store yields it (without it, that raises).
          prefer: the host whose stores are tried first (then the others).

        Returns:
          The object.

        Raises:
          StoreError: no store yields it and there is no ``default`` (``"not_found"``); the
            message names every store tried with its reason.
        """
        order = self.holders(prefer) + [
            i for i in range(len(self.clients)) if i not in self.holders(prefer)
        ]
        tried = []
        for i in order:
            try:
                return self.clients[i].get_json(path)
            except StoreError as error:
                tried.append(f"store {i} ({self.addresses[i]}): {error.reason}")
        if default is not _MISSING:
            return default
        raise StoreError(f"no store holds JSON {path!r}; tried " + "; ".join(tried), "not_found")

    def flush(self) -> None:
        """Wait until every object put so far is on every store's disk.

        Raises:
          StoreError: a store failed the request.
        """
        for _ in self._pool.map(lambda c: c.flush(), self.clients):
            pass

    def close(self) -> None:
        """Wait for the writes under way, then close every store's connections."""
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()


def _or_none(fn, *args):
    try:
        return fn(*args)
    except StoreError:
        return None
