"""The tensor store: path-addressed arrays outside the workers, with range reads and replicas.

A server runs per host (``python -m tenplex_jax.multihost.store --dir DIR --port 0``, or
:meth:`StoreProcess.start`) and outlives the workers; :class:`StoreClient` talks to one,
:class:`ReplicatedStore` to several, keeping ``replicas`` more copies of every object::

    proc = StoreProcess.start("/tmp/store0")
    with StoreClient(proc.address) as store:
        store.put("v1/w", w_shard, box=((0, 4), (0, 8)), global_shape=(8, 8))
        store.get("v1/w", ((2, 4), (0, 8)))          # == w_shard[2:4]: only those bytes travel
    proc.stop()

Every object carries its global shape, dtype and a checksum checked on every hop; every failure
raises ``tj.errors.StoreError`` with a ``reason``. Importing this needs no JAX.
"""

from tenplex_jax._src.multihost.store.client import CAS, Staged, StoreClient, Swap, parse_address
from tenplex_jax._src.multihost.store.process import StoreProcess
from tenplex_jax._src.multihost.store.replicated import ReplicatedStore
from tenplex_jax._src.multihost.store.wire import ObjectInfo

__all__ = [
    "CAS",
    "ObjectInfo",
    "ReplicatedStore",
    "Staged",
    "StoreClient",
    "StoreProcess",
    "Swap",
    "parse_address",
]
