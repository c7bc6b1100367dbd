"""The tensor store: path-addressed arrays outside the workers, with range reads and replicas.

A store server runs per host (``python -m tenplex_jax.multihost.store --dir DIR --port 0 --ready-file F``,
or ``StoreProcess.start``) and outlives the workers. An object is an array addressed by
``(path, box)``: ``path`` names a leaf (``"v3/model/layers/0/attn/wq"``: a version prefix plus the
leaf's tree path), ``box`` the global index box it covers, ``((start, stop), ...)`` per dim as in
``tenplex_jax.ptc.Box``. A read asks for any sub-box of one stored object; the server slices and
sends only those bytes. Every object carries its global shape, dtype and a crc32 checksum, which
is checked on every hop: client to server, disk to server, server to client.

Example::

    proc = StoreProcess.start("/tmp/store0")                 # or the launcher starts it
    store = StoreClient(proc.address)
    store.put("v1/w", w_shard, box=((0, 4), (0, 8)), global_shape=(8, 8))
    store.get("v1/w", ((2, 4), (0, 8)))                      # == w_shard[2:4]
    store.put_json("v1/COMMIT", {"step": 100})               # durable, after the objects above
    stores = ReplicatedStore([p.address for p in procs], replicas=1)
    stores.put(0, "v1/w", w_shard, box=..., global_shape=...)  # on stores 0 and 1, in parallel
    stores.get("v1/w", box, prefer=0)                        # store 0, else its replica

**Acknowledgement.** ``put`` returns once the object is in the server's memory tier and queued
for disk (it survives the death of any worker, not of the store process); ``durable=True`` returns
only after the object's file is complete and fsynced; ``flush()`` waits for every earlier put to
reach disk, and ``put_json`` flushes first (``flush=False`` skips that wait), so a commit marker
on disk implies its objects are.

**Replacing.** A put replaces the objects of its path that it conflicts with: another global shape
or dtype (another array under that path), or a box that overlaps its own; disjoint boxes of one
array live side by side. So a ``get`` can only ever return the newest bytes of a box.

**Versions.** Give every commit its own path prefix (``"v3/"``) and ``delete`` old prefixes:
a put replaces an object atomically on each store, but a ``ReplicatedStore.put`` that raised may
have reached some of its stores, and a replica that missed an overwrite of the same
``(path, box)`` would still hold the old bytes.

**Errors.** Every failure raises ``StoreError`` with a ``reason``: ``"not_found"``, ``"corrupt"``
(a checksum failed; the object is set aside, not served), ``"unavailable"`` (no answer within the
timeouts), ``"too_large"``, ``"auth"``, ``"checksum"``, ``"disk"``, ``"protocol"``, ``"refused"``,
or ``"invalid"`` for bad arguments caught before anything was sent.

**Interface notes.** Beyond the planned interface: ``put`` returns the ``ObjectInfo`` and takes
``durable``; ``get``'s box may be None (the whole array); ``put_json`` takes ``flush``,
``get_json`` a ``default``;
``delete`` also removes JSON objects under the prefix and returns how many it removed; ``flush``,
``list_json``, ``stats`` and ``ping`` exist; ``StoreClient`` and ``ReplicatedStore`` take
``connect_timeout`` (the time to connect and be greeted; a stopped store is skipped after it);
an address may be ``"unix:PATH"`` for a server started with ``--unix-socket PATH``;
``ReplicatedStore.put`` returns the store indices written and raises unless ``min_copies``
(default: all k+1) were; ``ReplicatedStore`` also has ``holders``, ``list``, ``delete``,
``put_json``, ``get_json``, ``flush`` and ``close``; ``StoreProcess`` starts a server subprocess.
The module is a package so that ``python -m tenplex_jax.multihost.store`` runs the server cleanly:
``client.py`` (``StoreClient``), ``replicated.py`` (``ReplicatedStore``), ``process.py``
(``StoreProcess``), ``server.py`` (the server and its command line), ``tiers.py`` (its memory and
disk tiers) and ``wire.py`` (the protocol and ``ObjectInfo``).
"""

from tenplex_jax.multihost.store.client import StoreClient, parse_address
from tenplex_jax.multihost.store.process import StoreProcess
from tenplex_jax.multihost.store.replicated import ReplicatedStore
from tenplex_jax.multihost.store.wire import ObjectInfo

__all__ = ["ObjectInfo", "ReplicatedStore", "StoreClient", "StoreProcess", "parse_address"]
