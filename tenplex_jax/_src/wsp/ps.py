"""The parameter server: global weights sharded over tensor stores, updated by atomic accumulates.

The global weights (float32) are cut into *pieces* by bytes (:mod:`~tenplex_jax._src.wsp.pieces`),
spread over the stores by size (``LAYOUT``), so a push or pull talks to every store at once (a
thread per store). The ledger (:mod:`~tenplex_jax._src.wsp.ledger`) lives in the first store. A
push of a virtual worker's wave is:

1. **stage**: every piece's update is put under ``wsp/stage/<vw>/<wave>/<piece>`` in the piece's
   store and flushed to the stores' disks (the wave's write-ahead record), then checked beside
   the weights and every committed wave a piece lacks (NaN, Inf, or a sum that any order of
   adding could overflow, is refused before anything is committed);
2. **commit**: one compare-and-swap of the ledger logs the wave (the atomic point; a dropped VW's
   commit is refused; a wave committed since the check sends the push back to 1's check);
3. **apply**: each store adds the staged update into its piece with ``accumulate``, atomically and
   once: each array counts the pushes of every VW it holds (its *clocks*), and an accumulate out
   of turn is refused or skipped. The store removes the stage once the new version is on disk.

**Nothing acknowledged is lost.** Every store request carries an id and is tried again for up to
``retry_seconds``; the store does it once. A refused commit is re-read from the ledger before its
stage is deleted. A store killed after a push restarts with the ledger's commit and either the
piece's new version or the stage on its disk: the next pull adds any committed wave the weights
lack from its stage. A VW that dies before 2 leaves stages that ``collect`` deletes. The ledger,
its archived log and the heartbeats are :mod:`~tenplex_jax._src.wsp.records`'s (the base class).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.multihost.store.client import StoreClient
from tenplex_jax._src.wsp.ledger import PATH, Ledger
from tenplex_jax._src.wsp.pieces import (
    PIECE_BYTES,
    Piece,
    Span,
    check_layout,
    cut,
    gather_piece,
    pull_buffer,
)
from tenplex_jax._src.wsp.records import Records

LAYOUT = "wsp/layout"  # JSON in the first store: the leaves' shapes and pieces
LAYOUT_FORMAT = 2  # 1: a piece was a range of one leaf
WEIGHTS = "wsp/w/"  # the global weights' pieces
PREVIOUS = "wsp/previous/"  # each piece's version before its last update
STAGE = "wsp/stage/"
STAGE_TRIES = 10  # a push puts a stage that a restarting store lost again, this many times


class _Stale(Exception):
    """A wave was committed between a push's check and its commit: check again."""


class ParameterServer(Records):
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
      layout: every :class:`Piece` of the weights (after :meth:`create` or :meth:`open`).
      shapes: leaf path -> its shape.
      push_seconds: the phases of the last :meth:`push`, seconds: ``stage`` (the puts),
        ``flush`` (seeing them on disk), ``check`` (finite), ``commit``, ``apply``.

    Raises:
      WSPError: no addresses (``"invalid"``). (A request a store fails for longer than
        ``retry_seconds`` raises ``StoreError``, from any method.)
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
            StoreClient(a, token=token, timeout=timeout, retry_seconds=retry_seconds, shared=True)
            for a in self.addresses
        ]
        self.layout: tuple[Piece, ...] = ()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.push_seconds: dict[str, float] = {}
        self._seen = threading.local()  # per thread: the version of the last ledger it saw
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(self.clients), thread_name_prefix="wsp-ps"
        )

    def close(self) -> None:
        """Close the connections to every store."""
        self._pool.shutdown(wait=True)
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

    def _each_store(self, work: Callable[[StoreClient, list[Piece]], object]) -> dict:
        """``work(client, pieces)`` for each store's pieces, the stores at once (a thread each);
        store index -> its result. The first error raised is raised, after every store's work
        has ended."""
        by_store: dict[int, list[Piece]] = {}
        for piece in self.layout:
            by_store.setdefault(piece.store, []).append(piece)
        if len(by_store) == 1:
            ((store, pieces),) = by_store.items()
            return {store: work(self.clients[store], pieces)}
        futures = {
            store: self._pool.submit(work, self.clients[store], pieces)
            for store, pieces in by_store.items()
        }
        concurrent.futures.wait(futures.values())
        return {store: future.result() for store, future in futures.items()}

    # -- the global weights ----------------------------------------------------------------------

    def create(
        self,
        weights: Mapping[str, np.ndarray],
        total: int | None,
        *,
        piece_bytes: int = PIECE_BYTES,
        stores: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Start a job: cut the initial weights into pieces over the stores (:func:`cut`) and
        write an empty ledger.

        Args:
          weights: leaf path -> array (:func:`weights_of` gives them), stored as float32.
          total: minibatches in the run (``None``: unbounded).
          piece_bytes: the largest piece of a leaf, bytes.
          stores: leaf path -> the stores (indices) its pieces may go to, e.g. those of the nodes
            that run its stage (default: any).

        Raises:
          WSPError: a job already exists on these stores (``"refused"``), or a weight that is
            NaN or Inf, a bad ``piece_bytes`` or ``stores`` (``"invalid"``; nothing written).
        """
        with np.errstate(over="ignore"):  # a weight past float32's range is Inf: refused below
            arrays = {path: np.asarray(w, np.float32) for path, w in weights.items()}
        for path, a in arrays.items():
            if not np.isfinite(a).all():  # every push's sum would be refused: a dead job
                raise WSPError(
                    f"the initial weights of leaf {path!r} (shape {a.shape}) hold NaN or Inf "
                    f"(after the cast to float32)",
                    "invalid",
                )
        shapes = {path: tuple(a.shape) for path, a in arrays.items()}
        layout = cut(shapes, len(self.clients), piece_bytes, stores)
        if not self.coordinator.cas_json(PATH, Ledger(total=total).to_json(), expect=None).swapped:
            raise WSPError(
                f"a job already exists on {self.addresses[0]} (its ledger {PATH!r})", "refused"
            )
        self.layout, self.shapes = layout, shapes
        flat = {path: a.reshape(-1) for path, a in arrays.items()}
        self._each_store(
            lambda client, pieces: [
                client.put(WEIGHTS + p.key, gather_piece(p, flat)) for p in pieces
            ]
        )
        self.coordinator.put_json(
            LAYOUT,
            {
                "format": LAYOUT_FORMAT,
                "shapes": {path: list(shape) for path, shape in shapes.items()},
                "pieces": [[p.store, [[s.leaf, s.start, s.stop] for s in p.spans]] for p in layout],
            },
        )

    def open(self) -> tuple[Piece, ...]:
        """Read where each piece lives (:attr:`layout`, returned), for a client of a job another
        client created.

        Raises:
          StoreError: the job's layout is not in the first store (``"not_found"``: no job was
            created, or ``create`` has not finished), or a store failed the request.
          WSPError: the layout is malformed, or its pieces do not cover each leaf exactly once,
            or it is of another format (an earlier tenplex_jax's job) (``"corrupt"``).
        """
        record = self.coordinator.get_json(LAYOUT)
        version = record.get("format", 1) if isinstance(record, dict) else None
        if version != LAYOUT_FORMAT:
            raise WSPError(
                f"the layout record {LAYOUT!r} is of format {version}, this "
                f"tenplex_jax reads {LAYOUT_FORMAT}: the job was created by another version",
                "corrupt",
            )
        try:
            shapes = {str(k): tuple(int(d) for d in v) for k, v in record["shapes"].items()}
            span = lambda a, b, c: Span(leaf=str(a), start=int(b), stop=int(c))
            layout = tuple(
                Piece(index=i, store=int(store), spans=tuple(span(*s) for s in spans))
                for i, (store, spans) in enumerate(record["pieces"])
            )
            check_layout(layout, shapes, len(self.clients))
        except (KeyError, TypeError, ValueError) as error:
            raise WSPError(f"the layout record is malformed: {error!r:.200}", "corrupt") from None
        self.layout, self.shapes = layout, shapes
        return self.layout

    # -- push and pull ---------------------------------------------------------------------------

    def push(self, vw: str, wave: int, updates: Mapping[str, np.ndarray]) -> Ledger:
        """Push a wave: stage its updates, check and flush them, commit it in the ledger, add it
        into the weights (every store at once); the ledger after the commit. A VW pushes on a
        thread of its own, beside its compute (:class:`VirtualWorker`).

        Args:
          vw: the pushing VW.
          wave: the wave it leased.
          updates: leaf path -> the change of that leaf over the wave (float32), for every leaf.

        Raises:
          WSPError: a leaf lacks an update or has another shape, or an update holds NaN or Inf
            or would overflow a weight (``"invalid"``: nothing is committed, the weights are
            untouched); the ledger refuses the commit (``"dropped"``: the wave's minibatches
            went to others; the staged updates are deleted); or a piece holds this push from
            another update (``"refused"``: another client pushes under this VW's name).
          StoreError: a store failed a request for longer than ``retry_seconds``.
        """
        flat = self._flat(vw, wave, updates)
        stage, tic = f"{STAGE}{vw}/{wave}/", time.perf_counter()
        phases = self.push_seconds = dict.fromkeys(
            ("stage", "flush", "check", "commit", "apply"), 0.0
        )

        def phase(name: str) -> None:
            nonlocal tic
            phases[name], tic = phases[name] + time.perf_counter() - tic, time.perf_counter()

        sources = self._stage(stage, flat, phase)
        ledger = self._check_and_commit(vw, wave, stage, phase)
        self.apply(vw, wave, wave - ledger.starts[vw], sources)
        phase("apply")
        return ledger

    def _check_and_commit(self, vw: str, wave: int, stage: str, phase) -> Ledger:
        """Check a staged wave against the weights beside every committed wave a piece does not
        hold yet (no order of adding them all can overflow), then commit it in the ledger if no
        wave was committed since the check; else check again. So a committed wave is never
        refused when it is added: the ledger is never ahead of the weights for good."""
        for _ in range(STAGE_TRIES):
            seen = self.ledger()
            beside = self._pending(seen)

            def check(client: StoreClient, pieces: list[Piece], beside=beside) -> None:
                for p in pieces:
                    key = p.key
                    at = (WEIGHTS + key, stage + key)
                    client.accumulate(*at, name=vw, clock=0, check=True, beside=beside.get(key, ()))

            try:
                self._each_store(check)
            except StoreError as error:
                if error.reason != "nonfinite":
                    raise
                self._drop_stage(stage)
                raise WSPError(f"push of wave {wave} by {vw!r}: {error}", "invalid") from None
            phase("check")

            def commit(led: Ledger, seen=seen) -> tuple[Ledger, None]:
                if led.pushed(vw, wave):  # in already: a try whose reply was lost
                    return led, None
                if led.committed != seen.committed:  # a wave committed since the check
                    raise _Stale
                return led.commit(vw, wave), None

            try:
                ledger, _ = self.update(commit)
            except _Stale:
                phase("commit")
                continue
            except WSPError:
                ledger = self.ledger()  # a refusal may follow a commit whose reply was lost
                if not ledger.pushed(vw, wave):
                    self._drop_stage(stage)
                    raise
            phase("commit")
            return ledger
        self._drop_stage(stage)
        raise WSPError(
            f"push of wave {wave} by {vw!r}: other waves were committed between each of "
            f"{STAGE_TRIES} checks and its commit",
            "busy",
        )

    def _pending(self, ledger: Ledger) -> dict[str, list[tuple[str, int, str]]]:
        """Piece key -> ``(vw, push, stage)`` of each wave ``ledger`` commits that the piece
        did not hold when listed (it may hold some by the time a store checks: those are
        skipped there)."""
        pending: dict[str, list[tuple[str, int, str]]] = {}
        for client in self.clients:
            for info in client.list(WEIGHTS):
                key = info.path[len(WEIGHTS) :]
                pending[key] = [
                    (v, push, f"{STAGE}{v}/{ledger.starts[v] + push}/{key}")
                    for v, push in sorted(_behind(info.clocks, ledger))
                ]
        return pending

    def _flat(self, vw: str, wave: int, updates: Mapping[str, np.ndarray]) -> dict:
        """A push's updates as float32 vectors, checked against the leaves' shapes."""
        missing = set(self.shapes) - set(updates)
        if missing:
            raise WSPError(
                f"a push updates every leaf of the weights; {vw!r} wave {wave} lacks "
                f"{sorted(missing)[:5]}",
                "invalid",
            )
        flat = {}
        for path, shape in self.shapes.items():
            update = np.asarray(updates[path], np.float32)
            if update.shape != shape:
                raise WSPError(
                    f"push of wave {wave} by {vw!r}: the update of leaf {path!r} has shape "
                    f"{update.shape}; the weights' leaf is {shape}",
                    "invalid",
                )
            flat[path] = np.ascontiguousarray(update).reshape(-1)
        return flat

    def _stage(self, stage: str, flat: Mapping[str, np.ndarray], phase) -> dict[str, str]:
        """Put every piece's update under ``stage`` and see it on its store's disk (the wave's
        write-ahead record, before the commit); the checksums by piece. A store that restarted
        since a put lost what it held in memory only: a stage listed after the flush is on disk,
        and one missing is put again."""
        sources: dict[str, str] = {}
        missing = {p.key for p in self.layout}
        for _ in range(STAGE_TRIES):

            def put(client: StoreClient, pieces: list[Piece], missing=missing) -> None:
                for p in pieces:
                    if p.key in missing:
                        sources[p.key] = client.put(stage + p.key, gather_piece(p, flat)).checksum

            def listed(client: StoreClient, pieces: list[Piece]) -> dict[str, str]:
                client.flush()
                return {info.path[len(stage) :]: info.checksum for info in client.list(stage)}

            self._each_store(put)
            phase("stage")
            there = {k: v for found in self._each_store(listed).values() for k, v in found.items()}
            phase("flush")
            missing = {p.key for p in self.layout if there.get(p.key) != sources[p.key]}
            if not missing:
                return sources
        raise WSPError(
            f"the stage {stage!r} of {sorted(missing)[:5]} did not stay on its store in "
            f"{STAGE_TRIES} tries (a store restarting over and over?)",
            "busy",
        )

    def _drop_stage(self, stage: str) -> None:
        for client in self.clients:
            with contextlib.suppress(StoreError):
                client.delete(stage)

    def apply(
        self, vw: str, wave: int, push: int, sources: Mapping[str, str] | None = None
    ) -> None:
        """Add a committed, staged wave into every piece (a no-op where it is already in; every
        store at once); each store removes the stage once the piece's new version is on its
        disk. :meth:`push` and :meth:`pull` call it.

        Args:
          vw: the VW that pushed it.
          wave: the wave.
          push: its push number: ``wave - ledger.starts[vw]``.
          sources: piece key -> the checksum of the staged update (the pusher's own call):
            then a piece that holds this push from another update is an error.

        Raises:
          WSPError: a piece holds push ``push`` of ``vw`` from another update than ``sources``
            says (``"refused"``).
          StoreError: a store refused an accumulate out of turn (``"refused"``), a stage is
            missing (``"not_found"``), or a store failed a request.
        """
        stage, todo = f"{STAGE}{vw}/{wave}/", {p.key for p in self.layout}

        def add(client: StoreClient, pieces: list[Piece]) -> tuple[list[str], list[str]]:
            pieces = [p for p in pieces if p.key in todo]
            return _accumulate(client, pieces, stage, vw, push, sources)

        results = list(self._each_store(add).values())
        behind = [k for b, _ in results for k in b]
        if behind:
            # a piece lacks an earlier committed wave (its store restarted before the sum
            # reached its disk; the stage did): add those first, then this one
            self._complete(self.ledger())
            todo = set(behind)
            again = list(self._each_store(add).values())
            late = sorted(k for b, _ in again for k in b)
            if late:
                raise StoreError(
                    f"push {push} of {vw!r} (wave {wave}) is out of turn at {late[:5]} after "
                    f"the committed waves before it were added",
                    "refused",
                )
            results += again
        other = sorted(k for _, o in results for k in o)
        if other:
            raise WSPError(
                f"push {push} of {vw!r} (wave {wave}): piece {other[0]!r} holds that push from "
                f"another update than its stage {stage + other[0]!r}; another client pushes "
                f"under the name {vw!r}",
                "refused",
            )

    def _complete(self, ledger: Ledger) -> set[tuple[str, int]]:
        """Add every wave ``ledger`` commits that a piece lacks, from its stage, oldest push
        first; the ``(vw, push)`` that were behind."""
        behind = set()
        for client in self.clients:
            for info in client.list(WEIGHTS):
                behind |= _behind(info.clocks, ledger)
        for vw, push in sorted(behind, key=lambda t: (t[1], t[0])):
            with contextlib.suppress(StoreError):  # applied meanwhile: the clocks say so
                self.apply(vw, ledger.starts[vw] + push, push)
        return behind

    def rollback(self) -> Ledger:
        """Undo the last committed wave: every piece goes back to its version before that
        wave's update (each store keeps it), and the ledger hands the wave's minibatches back to
        be trained again; the ledger after. For an operator, while no VW pushes (a wave found
        bad after the fact).

        Raises:
          WSPError: nothing is committed, or a piece's last update is another wave than the
            ledger's last (``"refused"``: then nothing is changed).
        """
        ledger = self.ledger()
        if not ledger.log:
            raise WSPError("no wave is committed: nothing to roll back", "refused")
        vw, wave, _ = ledger.log[-1]
        push = wave - ledger.starts[vw]
        for check in (True, False):  # every piece can be put back, then put back
            for p in self.layout:
                try:
                    self.clients[p.store].revert(
                        WEIGHTS + p.key, PREVIOUS + p.key, name=vw, clock=push, check=check
                    )
                except StoreError as error:
                    if not check or error.reason not in ("refused", "not_found"):
                        raise
                    raise WSPError(
                        f"wave {wave} of {vw!r} cannot be rolled back: {error}", "refused"
                    ) from None
        return self.update(lambda led: (led.roll_back(vw, wave), None))[0]

    def pull(
        self,
        ledger: Ledger | None = None,
        timeout: float = 60.0,
        *,
        pending: tuple[str, int, Mapping[str, np.ndarray]] | None = None,
    ) -> dict[str, np.ndarray]:
        """The global weights holding every wave the ledger has committed, applying any that a
        dead pusher left staged; every store read at once, each piece received straight into
        its place in its leaf (copied out of shared memory from a store on this host:
        ``StoreClient(shared=True)``).

        Args:
          ledger: the ledger whose commits the weights must hold (default: the current one).
          timeout: seconds to wait for the weights to catch up with the commits.
          pending: ``(vw, wave, updates)``: a push still in flight on another thread (the
            caller's own, made with :meth:`push`): its updates are added to every piece that
            does not hold it yet, so the arrays hold it whether or not it has reached the
            stores, and the pull need not wait for it.

        Returns:
          Leaf path -> float32 array, each piece read whole and atomically; the arrays may hold
          newer waves than asked for, never older.

        Raises:
          WSPError: the weights stayed behind the commits for ``timeout`` (``"busy"``).
        """
        deadline = time.monotonic() + timeout
        out, places = pull_buffer(self.layout, self.shapes)
        while True:
            ledger = ledger or self.ledger()
            read = functools.partial(_read, places=places, ledger=ledger, pending=pending)
            reads = self._each_store(read).values()
            behind = set().union(*(b for b, _ in reads))
            if not behind:
                lacking = [p for _, missed in reads for p in missed]
                if lacking:  # the push in flight, gathered per piece as the push put it
                    updates = {
                        path: np.asarray(u, np.float32).reshape(-1)
                        for path, u in pending[2].items()
                    }
                    for p in lacking:
                        places[p.index] += gather_piece(p, updates)
                return out
            for vw, push in sorted(behind, key=lambda t: (t[1], t[0])):
                try:
                    self.apply(vw, ledger.starts[vw] + push, push)
                except StoreError as error:  # applied meanwhile: the clocks say so
                    if error.reason == "nonfinite":  # checked beside the others: never
                        raise WSPError(
                            f"wave {ledger.starts[vw] + push} of {vw!r} is committed but cannot "
                            f"be added to the weights: {error}",
                            "invalid",
                        ) from None
            if time.monotonic() > deadline:
                raise WSPError(
                    f"the weights stayed behind the ledger's commits {sorted(behind)[:5]}"
                    f" for {timeout:.0f} s",
                    "busy",
                )
            ledger = None

    def collect(self) -> int:
        """Delete the stages no push needs; how many objects. Those of waves the ledger will never
        commit (their pushers were dropped or left before committing), and of waves every piece
        holds (left when a store stopped between writing a piece and removing its stage).

        Raises:
        """
        ledger = self.ledger()
        applied: dict[str, int] = {}  # vw -> the pushes every piece holds
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


def _accumulate(
    client: StoreClient, pieces: list[Piece], stage: str, vw: str, push: int, sources
) -> tuple[list[str], list[str]]:
    """Push ``push`` of ``vw`` staged under ``stage`` added into ``pieces`` of one store (see
    :meth:`ParameterServer.apply`): the keys of the pieces it is out of turn for, and of those
    holding it from another update than ``sources`` says."""
    behind, other = [], []
    for p in pieces:
        try:
            _, applied = client.accumulate(
                WEIGHTS + p.key,
                stage + p.key,
                name=vw,
                clock=push,
                update=None if sources is None else sources[p.key],
                consume=True,
                keep=PREVIOUS + p.key,
            )
        except StoreError as error:
            if error.reason != "refused" or "out of turn" not in str(error):
                raise
            behind.append(p.key)
            continue
        if sources is not None and not applied:
            other.append(p.key)
    return behind, other


def _read(client: StoreClient, pieces: list[Piece], places, ledger: Ledger, pending) -> tuple:
    """``pieces`` of one store read, each straight into its place in its leaves (``places``):
    the ``(vw, push)`` that ``ledger`` commits and a piece lacks, and the pieces that lack the
    ``pending`` push (see :meth:`ParameterServer.pull`)."""
    behind, lacking = set(), []
    for p in pieces:
        _, info = client.get(WEIGHTS + p.key, with_info=True, out=places[p.index])
        behind |= _behind(info.clocks, ledger)
        if pending is not None and not _holds(info.clocks, ledger, *pending[:2]):
            lacking.append(p)
    return behind, lacking


def _behind(clocks: Iterable[tuple[str, int]], ledger: Ledger) -> set[tuple[str, int]]:
    """The ``(vw, push)`` that ``ledger`` commits and an array with these ``clocks`` (its
    :class:`ObjectInfo`'s: VW -> the pushes it holds) lacks."""
    held = dict(clocks)
    return {
        (vw, n) for vw, pushes in ledger.committed.items() for n in range(held.get(vw, 0), pushes)
    }


def _holds(clocks: Iterable[tuple[str, int]], ledger: Ledger, vw: str, wave: int) -> bool:
    """Whether an array with these ``clocks`` holds ``vw``'s push of its wave ``wave``."""
    return dict(clocks).get(vw, 0) > wave - ledger.starts[vw]
