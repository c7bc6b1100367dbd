"""The parameter server: global weights sharded over tensor stores, updated by atomic accumulates.

Each leaf of the global weights (float32) lives whole in one store, the leaves spread over the
stores by size (``LAYOUT``), so no store carries all the bytes; the ledger
(:mod:`tenplex_jax._src.wsp.ledger`) lives in the first store. A push of a virtual worker's wave is:

1. **stage**: every leaf's update is put under ``wsp/stage/<vw>/<wave>/<leaf>`` in the leaf's
   store (checksummed like every object), checked (an update holding NaN or Inf, or whose sum
   with the weights overflows, is refused here, before anything is committed) and flushed to the
   stores' disks: the stage is the wave's write-ahead record;
2. **commit**: one compare-and-swap of the ledger logs the wave and its minibatches (the atomic
   point: a wave is pushed or it is not; a dropped VW's commit is refused);
3. **apply**: each store adds the staged update into its leaf with ``accumulate``, atomically
   (readers see the old array or the new, never a mix), once: each array counts the pushes of
   every VW it holds (its *clocks*: a VW's ``n``-th push is its wave ``starts[vw] + n``), and an
   accumulate out of turn is refused or skipped. The store removes the stage once the new
   version of the leaf is on its disk.

**Nothing acknowledged is lost.** Every store request carries an id and is tried again, for up
to ``retry_seconds``, when its reply is lost or its store restarts; the store does it once. A
commit refused is re-read from the ledger before its stage is deleted (the commit may have
landed). A store killed after a push restarts with the ledger's commit and either the leaf's new
version or the stage on its disk: whoever pulls next adds any committed wave the weights lack
from its stage (``pull`` requires every array to hold every committed wave). A VW that dies
before 2 leaves stages that nothing applies (deleted by ``collect``).
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
PREVIOUS = "wsp/previous/"  # each leaf's version before its last update
STAGE = "wsp/stage/"
STAGE_TRIES = 10  # a push puts a stage that a restarting store lost again, this many times


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
      retry_seconds: how long a request is tried again when its reply is lost or its store is
        unreachable (a store restarting on the same address and directory).

    Attributes:
      layout: leaf path -> the index of the store holding it (after :meth:`create` or
        :meth:`open`).
      push_seconds: the phases of the last :meth:`push`, seconds: ``stage`` (the puts),
        ``flush`` (seeing them on disk), ``check`` (finite), ``commit``, ``apply``.

    Raises:
      WSPError: no addresses (``"invalid"``).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 60.0,
        retry_seconds: float = 60.0,
    ):
        if not addresses:
            raise WSPError("a parameter server needs at least one tensor store", "invalid")
        self.addresses = list(addresses)
        self.clients = [
            StoreClient(a, token=token, timeout=timeout, retry_seconds=retry_seconds)
            for a in self.addresses
        ]
        self.layout: dict[str, int] = {}
        self.push_seconds: dict[str, float] = {}

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
        record, version, now = self.coordinator.get_json(PATH, versioned=True)
        for _ in range(tries):
            ledger, result = change(Ledger.from_json(record), now)
            # a reply lost after the swap: the store answers the request's retry as swapped
            cas = self.coordinator.cas_json(PATH, ledger.to_json(), expect=version)
            if cas.swapped:
                return ledger, result
            record, version, now = cas.value, cas.version, cas.time
        raise WSPError(f"the ledger changed under {tries} tries in a row", "busy")

    # -- push and pull ---------------------------------------------------------------------------

    def push(self, vw: str, wave: int, updates: Mapping[str, np.ndarray]) -> Ledger:
        """Push a wave: stage its updates, check and flush them, commit it in the ledger, add it
        into the weights.

        Args:
          vw: the pushing VW.
          wave: the wave it leased.
          updates: leaf path -> the change of that leaf over the wave (float32), for every leaf.

        Returns:
          The ledger after the commit.

        Raises:
          WSPError: a leaf lacks an update, or an update holds NaN or Inf or would overflow a
            weight (``"invalid"``: nothing is committed, the weights are untouched); the ledger
            refuses the commit (``"dropped"``: the wave's minibatches went to others; the
            staged updates are deleted); or a leaf holds this push from another update
            (``"refused"``: another client pushes under this VW's name).
          StoreError: a store failed a request for longer than ``retry_seconds``.
        """
        missing = set(self.layout) - set(updates)
        if missing:
            raise WSPError(
                f"a push updates every leaf of the weights; {vw!r} wave {wave} lacks "
                f"{sorted(missing)[:5]}",
                "invalid",
            )
        stage, tic = f"{STAGE}{vw}/{wave}/", time.perf_counter()
        phases = self.push_seconds = dict.fromkeys(
            ("stage", "flush", "check", "commit", "apply"), 0.0
        )

        def phase(name: str) -> None:
            nonlocal tic
            phases[name], tic = phases[name] + time.perf_counter() - tic, time.perf_counter()

        sources = self._stage(stage, updates, phase)
        try:
            for path, store in self.layout.items():
                self.clients[store].accumulate(
                    WEIGHTS + path, stage + path, name=vw, clock=0, check=True
                )
        except StoreError as error:
            if error.reason != "nonfinite":
                raise
            self._drop_stage(stage)
            raise WSPError(f"push of wave {wave} by {vw!r}: {error}", "invalid") from None
        phase("check")
        try:
            ledger, _ = self.update(lambda led, now: (led.commit(vw, wave), None))
        except WSPError:
            ledger = self.ledger()  # a refusal may follow a commit whose reply was lost
            if not ledger.pushed(vw, wave):
                self._drop_stage(stage)
                raise
        phase("commit")
        self.apply(vw, wave, wave - ledger.starts[vw], sources)
        phase("apply")
        return ledger

    def _stage(self, stage: str, updates: Mapping[str, np.ndarray], phase) -> dict[str, str]:
        """Put every leaf's update under ``stage`` and see it on its store's disk (the wave's
        write-ahead record, before the commit); the checksums. A store that restarted since a
        put lost what it held in memory only: a stage listed after the flush is on disk, and
        one missing is put again."""
        sources, missing, stores = {}, list(self.layout), sorted(set(self.layout.values()))
        for _ in range(STAGE_TRIES):
            for path in missing:
                update = np.asarray(updates[path], np.float32)
                sources[path] = self.clients[self.layout[path]].put(stage + path, update).checksum
            phase("stage")
            for store in stores:
                self.clients[store].flush()
            there = {
                info.path[len(stage) :]: info.checksum
                for store in stores
                for info in self.clients[store].list(stage)
            }
            phase("flush")
            missing = [p for p in self.layout if there.get(p) != sources[p]]
            if not missing:
                return sources
        raise WSPError(
            f"the stage {stage!r} of {missing[:5]} did not stay on its store in {STAGE_TRIES} "
            f"tries (a store restarting over and over?)",
            "busy",
        )

    def _drop_stage(self, stage: str) -> None:
        for client in self.clients:
            with contextlib.suppress(StoreError):
                client.delete(stage)

    def apply(
        self, vw: str, wave: int, push: int, sources: Mapping[str, str] | None = None
    ) -> None:
        """Add a committed, staged wave into every leaf (a no-op where it is already in); each
        store removes the stage once the leaf's new version is on its disk. :meth:`push` and
        :meth:`pull` call it.

        Args:
          vw: the VW that pushed it.
          wave: the wave.
          push: its push number: ``wave - ledger.starts[vw]``.
          sources: leaf path -> the checksum of the staged update (the pusher's own call):
            then a leaf that holds this push from another update is an error.

        Raises:
          WSPError: a leaf holds push ``push`` of ``vw`` from another update than ``sources``
            says (``"refused"``).
          StoreError: a store refused an accumulate out of turn (``"refused"``), a stage is
            missing (``"not_found"``), or a store failed a request.
        """
        stage = f"{STAGE}{vw}/{wave}/"
        for path, store in self.layout.items():
            source = None if sources is None else sources[path]
            for late in (False, True):
                try:
                    _, applied = self.clients[store].accumulate(
                        WEIGHTS + path,
                        stage + path,
                        name=vw,
                        clock=push,
                        update=source,
                        consume=True,
                        keep=PREVIOUS + path,
                    )
                    break
                except StoreError as error:
                    # the leaf lacks an earlier committed wave (its store restarted before the
                    # sum reached its disk; the stage did): add those first
                    if late or error.reason != "refused" or "out of turn" not in str(error):
                        raise
                    self._complete(self.ledger())
            if source is not None and not applied:
                raise WSPError(
                    f"push {push} of {vw!r} (wave {wave}): leaf {path!r} holds that push from "
                    f"another update than its stage {stage + path!r}; another client pushes "
                    f"under the name {vw!r}",
                    "refused",
                )

    def _complete(self, ledger: Ledger) -> set[tuple[str, int]]:
        """Add every wave ``ledger`` commits that a leaf lacks, from its stage, oldest push
        first; the ``(vw, push)`` that were behind."""
        behind = set()
        for client in self.clients:
            for info in client.list(WEIGHTS):
                clocks = dict(info.clocks)
                for vw, pushes in ledger.committed.items():
                    behind |= {(vw, n) for n in range(clocks.get(vw, 0), pushes)}
        for vw, push in sorted(behind, key=lambda t: (t[1], t[0])):
            with contextlib.suppress(StoreError):  # applied meanwhile: the clocks say so
                self.apply(vw, ledger.starts[vw] + push, push)
        return behind

    def rollback(self) -> Ledger:
        """Undo the last committed wave: every leaf goes back to its version before that wave's
        update (each store keeps it), and the ledger hands the wave's minibatches back to be
        trained again. For an operator, while no VW pushes (a wave found bad after the fact).

        Returns:
          The ledger after the rollback.

        Raises:
          WSPError: nothing is committed, or a leaf's last update is another wave than the
            ledger's last (``"refused"``: then nothing is changed).
          StoreError: a store failed a request.
        """
        ledger = self.ledger()
        if not ledger.log:
            raise WSPError("no wave is committed: nothing to roll back", "refused")
        vw, wave, _ = ledger.log[-1]
        push = wave - ledger.starts[vw]
        for check in (True, False):  # every leaf can be put back, then put back
            for path, store in self.layout.items():
                try:
                    self.clients[store].revert(
                        WEIGHTS + path, PREVIOUS + path, name=vw, clock=push, check=check
                    )
                except StoreError as error:
                    if not check or error.reason not in ("refused", "not_found"):
                        raise
                    raise WSPError(
                        f"wave {wave} of {vw!r} cannot be rolled back: {error}", "refused"
                    ) from None
        return self.update(lambda led, now: (led.roll_back(vw, wave), None))[0]

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
        """Delete the stages no push needs: of waves the ledger will never commit (their pushers
        were dropped or left before committing), and of waves every leaf holds (left when a
        store stopped between writing a leaf and removing its stage).

        Returns:
          How many objects were deleted.

        Raises:
          StoreError: a store failed a request.
        """
        ledger = self.ledger()
        applied: dict[str, int] = {}  # vw -> the pushes every leaf holds
        for client in self.clients:
            for info in client.list(WEIGHTS):
                for vw in ledger.committed:
                    applied[vw] = min(applied.get(vw, 1 << 62), dict(info.clocks).get(vw, 0))
        deleted = 0
        for client in self.clients:
            for info in client.list(STAGE):
                vw, wave = info.path[len(STAGE) :].split("/", 2)[:2]
                start = ledger.starts.get(vw, 0)
                never = vw not in ledger.clocks and int(wave) >= start + ledger.committed.get(vw, 0)
                if never or int(wave) < start + applied.get(vw, 0):
                    deleted += client.delete(f"{STAGE}{vw}/{wave}/")
        return deleted
