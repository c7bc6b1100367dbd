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
    """A client of the parameter server on ``addresses`` (``token``: the stores' secret)."""

    def __init__(
        self, addresses: Sequence[str], *, token: str | None = None, timeout: float = 60.0
    ):
        if not addresses:
            raise WSPError("a parameter server needs at least one tensor store", "invalid")
        self.addresses = list(addresses)
        self.clients = [StoreClient(a, token=token, timeout=timeout) for a in self.addresses]
        self.layout: dict[str, int] = {}

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def coordinator(self) -> StoreClient:
        return self.clients[0]

    # -- the global weights ----------------------------------------------------------------------

    def create(self, weights: Mapping[str, np.ndarray], total: int | None) -> None:
        """Lay the initial ``weights`` (leaf path -> array) out over the stores and start an empty
        ledger for ``total`` minibatches. Refused if the job already exists."""
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
        """Read where each leaf lives (waits for ``create`` when the job is being made)."""
        self.layout = {k: int(v) for k, v in self.coordinator.get_json(LAYOUT).items()}
        return self.layout

    # -- the ledger ------------------------------------------------------------------------------

    def ledger(self) -> Ledger:
        record, _, _ = self.coordinator.get_json(PATH, versioned=True)
        return Ledger.from_json(record)

    def update(self, change: Callable[[Ledger, float], tuple[Ledger, object]], tries: int = 1000):
        """Apply ``change(ledger, now) -> (ledger, result)`` atomically (compare-and-swap, retried
        on conflict; ``now`` is the store's clock); ``(ledger, result)`` as stored."""
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
        """Stage ``updates`` (leaf path -> float32 array), commit the wave, apply it; the ledger
        after the commit. Raises ``WSPError`` (``"dropped"``) when the ledger refuses the commit:
        the wave's minibatches went to others, the staged updates are dropped."""
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
        """Add ``vw``'s staged wave ``wave`` (its push number ``push``) into every leaf (a no-op
        where it is already in), then drop the stage."""
        stage = f"{STAGE}{vw}/{wave}/"
        for path, store in self.layout.items():
            self.clients[store].accumulate(WEIGHTS + path, stage + path, name=vw, clock=push)
        for store in sorted(set(self.layout.values())):
            self.clients[store].delete(stage)

    def pull(self, ledger: Ledger | None = None, timeout: float = 60.0) -> dict[str, np.ndarray]:
        """The global weights holding every wave the ledger has committed (applying any that a
        dead pusher left staged): leaf path -> float32 array. Each array is read whole and
        atomically; the arrays may hold newer waves than asked for, never older."""
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
        or left before committing); how many objects were deleted."""
        ledger = self.ledger()
        deleted = 0
        for client in self.clients:
            for info in client.list(STAGE):
                vw, wave = info.path[len(STAGE) :].split("/", 2)[:2]
                pushed = ledger.starts.get(vw, 0) + ledger.committed.get(vw, 0)
                if vw not in ledger.clocks and int(wave) >= pushed:
                    deleted += client.delete(f"{STAGE}{vw}/{wave}/")
        return deleted
