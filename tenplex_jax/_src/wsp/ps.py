"""The parameter server: global weights sharded over tensor stores, updated by atomic accumulates.

Each leaf of the global weights (float32) lives whole in one store, the leaves spread over the
stores by size (``LAYOUT``), so no store carries all the bytes; the ledger
(:mod:`tenplex_jax._src.wsp.ledger`) lives in the first store. A push of a virtual worker's wave is:

1. **stage**: every leaf's update is put under ``wsp/stage/<vw>/<wave>/<leaf>`` in the leaf's
   store (checksummed like every object);
2. **commit**: one compare-and-swap of the ledger logs the wave and its minibatches (the atomic
   point: a wave is pushed or it is not; a dropped VW's commit is refused);
3. **apply**: each store adds the staged update into its leaf with ``accumulate``, atomically
   (readers see the old array or the new, never a mix), once: each array counts the pushes of
   every VW it holds (its *clocks*: a VW's ``n``-th push is its wave ``starts[vw] + n``), and an
   accumulate out of turn is refused or skipped.

A VW that dies between 2 and 3 leaves committed waves unapplied; whoever pulls next applies them
from their stages (``pull`` requires every array to hold every committed wave, and finishes the
ones that do not). A VW that dies before 2 leaves stages that nothing applies (deleted with the
ledger's next cleanup, ``collect``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.multihost.store.client import StoreClient
from tenplex_jax._src.wsp.ledger import PATH, Ledger

LAYOUT = "wsp/layout"  # JSON in the first store: leaf path -> store index, shapes
WEIGHTS = "wsp/w/"  # the global weights' objects
STAGE = "wsp/stage/"


class ParameterServer:
    """A client of the parameter server kept in tensor stores: the global weights and the ledger.

    Every VW holds its own client; the server is the stores themselves (a context manager closes
    the connections). Example::

        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=minibatches)     # once per job
            ledger = ps.push("vw1", 0, updates)                 # stage, commit, apply a wave
            weights = ps.pull(ledger)

    Args:
      addresses: the stores' addresses; the first also holds the ledger and the layout.
      token: the stores' secret, if any.
      timeout: seconds any socket operation may take.

    Attributes:
      layout: leaf path -> the index of the store holding it (after :meth:`create` or
        :meth:`open`).

    Raises:
      WSPError: no addresses (``"invalid"``).
    """

    def __init__(
        self, addresses: Sequence[str], *, token: str | None = None, timeout: float = 60.0
    ):
        if not addresses:
            raise WSPError("a parameter server needs at least one tensor store", "invalid")
        self.addresses = list(addresses)
        self.clients = [StoreClient(a, token=token, timeout=timeout) for a in self.addresses]
        self.layout: dict[str, int] = {}

    def close(self) -> None:
        """Close the connections to every store."""
        for client in self.clients:
            client.close()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def coordinator(self) -> StoreClient:
        """The client of the first store, which holds the ledger and the layout."""
        return self.clients[0]

    # -- the global weights ----------------------------------------------------------------------

    def create(self, weights: Mapping[str, np.ndarray], total: int | None) -> None:
        """Start a job: lay the initial weights out over the stores (largest leaves first, each
        to the least loaded store) and an empty ledger.

        Args:
          weights: leaf path -> array (:func:`weights_of` gives them), stored as float32.
          total: minibatches in the run (``None``: unbounded).

        Raises:
          WSPError: a job already exists on these stores (``"refused"``).
          StoreError: a store failed a request.
        """
        load = [0] * len(self.clients)
        layout = {}
        for path, w in sorted(weights.items(), key=lambda kv: -kv[1].nbytes):
            store = min(range(len(load)), key=lambda i: (load[i], i))
            load[store] += w.nbytes
            layout[path] = store
        if not self.coordinator.cas_json(PATH, Ledger(total=total).to_json(), expect=None).swapped:
            raise WSPError(
                f"a job already exists on {self.addresses[0]} (its ledger {PATH!r})", "refused"
            )
        for path, w in weights.items():
            self.clients[layout[path]].put(WEIGHTS + path, np.asarray(w, np.float32))
        self.coordinator.put_json(LAYOUT, layout)
        self.layout = layout

    def open(self) -> dict[str, int]:
        """Read where each leaf lives, for a client of a job another client created.

        Returns:
          :attr:`layout`: leaf path -> store index.

        Raises:
          StoreError: the job's layout is not in the first store (``"not_found"``: no job was
            created, or ``create`` has not finished), or a store failed the request.
        """
        self.layout = {k: int(v) for k, v in self.coordinator.get_json(LAYOUT).items()}
        return self.layout

    # -- the ledger ------------------------------------------------------------------------------

    def ledger(self) -> Ledger:
        """The job's :class:`Ledger` as stored now.

        Raises:
          StoreError: there is no job (``"not_found"``), or the store failed the request.
          WSPError: the stored ledger is malformed (``"corrupt"``).
        """
        record, _, _ = self.coordinator.get_json(PATH, versioned=True)
        return Ledger.from_json(record)

    def update(self, change: Callable[[Ledger, float], tuple[Ledger, object]], tries: int = 1000):
        """Change the ledger atomically: compare-and-swap, retried on conflict.

        Args:
          change: ``change(ledger, now) -> (ledger, result)``, pure (it may run several times);
            ``now`` is the store's clock in seconds. What it raises (a ``WSPError`` of the
            ledger's rules) propagates.
          tries: conflicts in a row before giving up.

        Returns:
          ``(ledger, result)`` of the call whose ledger was stored.

        Raises:
          WSPError: the ledger changed under ``tries`` tries (``"busy"``), or what ``change``
            raises.
          StoreError: the store failed a request.
        """
        record, checksum, now = self.coordinator.get_json(PATH, versioned=True)
        for _ in range(tries):
            ledger, result = change(Ledger.from_json(record), now)
            mine = ledger.to_json()
            cas = self.coordinator.cas_json(PATH, mine, expect=checksum)
            # a reply lost after the swap is retried by the client: then the record is ours
            if cas.swapped or cas.value == mine:
                return ledger, result
            record, checksum, now = cas.value, cas.checksum, cas.time
        raise WSPError(f"the ledger changed under {tries} tries in a row", "busy")

    # -- push and pull ---------------------------------------------------------------------------

    def push(self, vw: str, wave: int, updates: Mapping[str, np.ndarray]) -> Ledger:
        """Push a wave: stage its updates, commit it in the ledger, add it into the weights.

        Args:
          vw: the pushing VW.
          wave: the wave it leased.
          updates: leaf path -> the change of that leaf over the wave (float32), for every leaf.

        Returns:
          The ledger after the commit.

        Raises:
          WSPError: a leaf lacks an update (``"invalid"``), or the ledger refuses the commit
            (``"dropped"``: the wave's minibatches went to others; the staged updates are
            deleted).
          StoreError: a store failed a request.
        """
        missing = set(self.layout) - set(updates)
        if missing:
            raise WSPError(
                f"a push updates every leaf of the weights; {vw!r} wave {wave} lacks "
                f"{sorted(missing)[:5]}",
                "invalid",
            )
        stage = f"{STAGE}{vw}/{wave}/"
        for path, update in updates.items():
            self.clients[self.layout[path]].put(stage + path, np.asarray(update, np.float32))
        try:
            ledger, _ = self.update(lambda led, now: (led.commit(vw, wave), None))
        except WSPError:
            for client in self.clients:
                with contextlib.suppress(StoreError):
                    client.delete(stage)
            raise
        self.apply(vw, wave, wave - ledger.starts[vw])
        return ledger

    def apply(self, vw: str, wave: int, push: int) -> None:
        """Add a committed, staged wave into every leaf (a no-op where it is already in), then
        delete the stage. :meth:`push` and :meth:`pull` call it.

        Args:
          vw: the VW that pushed it.
          wave: the wave.
          push: its push number: ``wave - ledger.starts[vw]``.

        Raises:
          StoreError: a store refused an accumulate out of turn (``"refused"``), a stage is
            missing (``"not_found"``), or a store failed a request.
        """
        stage = f"{STAGE}{vw}/{wave}/"
        for path, store in self.layout.items():
            self.clients[store].accumulate(WEIGHTS + path, stage + path, name=vw, clock=push)
        for store in sorted(set(self.layout.values())):
            self.clients[store].delete(stage)

    def pull(self, ledger: Ledger | None = None, timeout: float = 60.0) -> dict[str, np.ndarray]:
        """The global weights holding every wave the ledger has committed, applying any that a
        dead pusher left staged.

        Args:
          ledger: the ledger whose commits the weights must hold (default: the current one).
          timeout: seconds to wait for the weights to catch up with the commits.

        Returns:
          Leaf path -> float32 array, each read whole and atomically; the arrays may hold newer
          waves than asked for, never older.

        Raises:
          WSPError: the weights stayed behind the commits for ``timeout`` (``"busy"``).
          StoreError: a store failed a request.
        """
        deadline = time.monotonic() + timeout
        while True:
            ledger = ledger or self.ledger()
            out, behind = {}, set()
            for path, store in self.layout.items():
                array, info = self.clients[store].get(WEIGHTS + path, with_info=True)
                clocks = dict(info.clocks)
                for vw, pushes in ledger.committed.items():
                    behind |= {(vw, n) for n in range(clocks.get(vw, 0), pushes)}
                out[path] = array
            if not behind:
                return out
            for vw, push in sorted(behind, key=lambda t: (t[1], t[0])):
                with contextlib.suppress(StoreError):  # applied meanwhile: the clocks say so
                    self.apply(vw, ledger.starts[vw] + push, push)
            if time.monotonic() > deadline:
                raise WSPError(
                    f"the weights stayed behind the ledger's commits {sorted(behind)[:5]}"
                    f" for {timeout:.0f} s",
                    "busy",
                )
            ledger = None

    def collect(self) -> int:
        """Delete the stages of waves the ledger will never commit (their pushers were dropped
        or left before committing).

        Returns:
          How many objects were deleted.

        Raises:
          StoreError: a store failed a request.
        """
        ledger = self.ledger()
        deleted = 0
        for client in self.clients:
            for info in client.list(STAGE):
                vw, wave = info.path[len(STAGE) :].split("/", 2)[:2]
                pushed = ledger.starts.get(vw, 0) + ledger.committed.get(vw, 0)
                if vw not in ledger.clocks and int(wave) >= pushed:
                    deleted += client.delete(f"{STAGE}{vw}/{wave}/")
        return deleted
