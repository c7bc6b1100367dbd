"""The parameter server: global weights sharded over tensor stores, updated by atomic accumulates.

The global weights (float32) are cut into *pieces* by bytes (:mod:`~tenplex_jax._src.wsp.pieces`),
spread over the stores by size (``LAYOUT``), so a push or pull talks to every store at once (a
thread per store). The ledger (:mod:`~tenplex_jax._src.wsp.ledger`) lives in the first store. A
push of a virtual worker's wave is three rounds of requests, one request per piece in each; it
is acknowledged after the second:

1. **stage**: every piece's update is put under ``wsp/stage/<vw>/<wave>/<piece>`` in the piece's
   store, written through to its file (the wave's write-ahead record), and checked there in the
   same request beside the weights and every committed wave a piece lacks (NaN, Inf, or a sum
   that any order of adding could overflow, is refused before anything is committed);
2. **commit**: one compare-and-swap of the ledger logs the wave (the atomic point; a dropped VW's
   commit is refused; a wave committed since the check sends the push back to 1's check); it
   swaps from the newest ledger this client's threads saw, so it is one request when no other
   VW wrote since (a refusal found on that cached ledger alone is asked of the stored one);
3. **apply**, behind the acknowledgement (on a thread of this client's, which its next push and
   pull wait for): each store adds the staged update into its piece with ``accumulate``,
   atomically and once: each array counts the pushes of every VW it holds (its *clocks*), and an
   accumulate out of turn is refused or skipped. The store removes the stage once the new
   version is on disk. A pull of another client that finds the wave committed and not yet added
   adds it from the stage itself.

A pull reads each piece from the store's shared memory: once its segment is known, with no
request (``StoreClient.peek``), when the clocks beside the bytes hold every wave the ledger
commits; else it asks the store.

The check's list of committed waves a piece lacks comes from the ledger the client saw last and
the pieces' clocks its last replies carried; a store whose piece holds fewer than that (it
restarted and lost a sum) sends the push back to check again.

**Durable against what.** With ``sync`` (off by default) the stage and the ledger are fsynced
before their replies: an acknowledged push survives a crash of a store's machine. Without it
they are written to their files before their replies and fsynced behind them: an acknowledged
push survives the kill of any store or VW process (the kernel keeps the files), and a crash of
a machine only once the stores' writers have fsynced them (from ``LATER_SECONDS``, 0.1 s,
after the replies).

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
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.client import StoreClient, Swap
from tenplex_jax._src.multihost.store.wire import MAX_SWAP_BYTES
from tenplex_jax._src.wsp.ledger import PATH, Ledger
from tenplex_jax._src.wsp.pieces import (
    PIECE_BYTES,
    SPREAD_BYTES,
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
      sync: a push's stage and every write of the ledger are fsynced before their replies (a
        crash of a store's machine keeps an acknowledged push); default: fsynced behind them
        (a kill of a store keeps it).

    Attributes:
      layout: every :class:`Piece` of the weights (after :meth:`create` or :meth:`open`).
      shapes: leaf path -> its shape.
      push_seconds: the phases of the last :meth:`push`, seconds: ``apply`` (waiting for the
        push before it to be added), ``stage`` (the puts and their checks), ``commit``.

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
        sync: bool = False,
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
        self.sync = sync
        self._seen = threading.local()  # per thread: the version of the last ledger it saw
        self._last = None  # the newest ledger any thread saw, and its version
        self._last_lock = threading.Lock()
        # piece key -> the clocks of its array as a store last replied (perhaps behind the
        # store's, never ahead unless the store lost a sum): the checks' pending waves
        self._clocks: dict[str, dict[str, int]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(self.clients), thread_name_prefix="wsp-ps"
        )
        # the apply of this client's last push, behind its acknowledgement (round 3)
        self._applier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wsp-apply")
        self._applying: concurrent.futures.Future | None = None

    def close(self) -> None:
        """Close the connections to every store (after the last push's apply has ended)."""
        with contextlib.suppress(WSPError, StoreError):
            self.settle()
        self._applier.shutdown(wait=True)
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
        """``work(client, pieces)`` for each store's pieces, the stores at once (the first on
        this thread, each other on one of its own); store index -> its result. The first error
        raised is raised, after every store's work has ended."""
        by_store: dict[int, list[Piece]] = {}
        for piece in self.layout:
            by_store.setdefault(piece.store, []).append(piece)
        (here, mine), *others = by_store.items()
        futures = {
            store: self._pool.submit(work, self.clients[store], pieces) for store, pieces in others
        }
        try:
            out = {here: work(self.clients[here], mine)}
        finally:
            concurrent.futures.wait(futures.values())
        return out | {store: future.result() for store, future in futures.items()}

    # -- the global weights ----------------------------------------------------------------------

    def create(
        self,
        weights: Mapping[str, np.ndarray],
        total: int | None,
        *,
        piece_bytes: int = PIECE_BYTES,
        stores: Mapping[str, Sequence[int]] | None = None,
        spread_bytes: int = SPREAD_BYTES,
    ) -> None:
        """Start a job: cut the initial weights into pieces over the stores (:func:`cut`) and
        write an empty ledger.

        Args:
          weights: leaf path -> array (:func:`weights_of` gives them), stored as float32.
          total: minibatches in the run (``None``: unbounded).
          piece_bytes: the largest piece of a leaf, bytes.
          stores: leaf path -> the stores (indices) its pieces may go to, e.g. those of the nodes
            that run its stage (default: any).
          spread_bytes: the fewest bytes of weights that take another store (default 1 MiB:
            smaller weights live on the first store, whose push stages, checks and commits in
            one request a piece; :func:`cut`).

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
        layout = cut(shapes, len(self.clients), piece_bytes, stores, spread_bytes)
        if not self.coordinator.cas_json(PATH, Ledger(total=total).to_json(), expect=None).swapped:
            raise WSPError(
                f"a job already exists on {self.addresses[0]} (its ledger {PATH!r})", "refused"
            )
        self.layout, self.shapes = layout, shapes
        self._clocks = {p.key: {} for p in layout}
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
        self.layout, self.shapes, self._clocks = layout, shapes, {}
        return self.layout

    # -- push and pull ---------------------------------------------------------------------------

    def push(self, vw: str, wave: int, updates: Mapping[str, np.ndarray]) -> Ledger:
        """Push a wave: stage and check its updates, commit it in the ledger (every store at
        once, a request per piece in each round), and return the ledger after the commit; the
        wave is added into the weights behind that (:meth:`settle` waits for it). A VW pushes
        on a thread of its own, beside its compute (:class:`VirtualWorker`).

        Args:
          vw: the pushing VW.
          wave: the wave it leased.
          updates: leaf path -> the change of that leaf over the wave (float32), for every leaf.

        Raises:
          WSPError: a leaf lacks an update or has another shape, or an update holds NaN or Inf
            or would overflow a weight (``"invalid"``: nothing is committed, the weights are
            untouched); the ledger refuses the commit (``"dropped"``: the wave's minibatches
            went to others; the staged updates are deleted); or a piece holds this push from
            another update (``"refused"``: another client pushes under this VW's name; raised
            by the call after the push, whose apply found it).
          StoreError: a store failed a request for longer than ``retry_seconds``.
        """
        flat = self._flat(vw, wave, updates)
        stage, tic = f"{STAGE}{vw}/{wave}/", time.perf_counter()
        phases = self.push_seconds = dict.fromkeys(("stage", "commit", "apply"), 0.0)

        def phase(name: str) -> None:
            nonlocal tic
            phases[name], tic = phases[name] + time.perf_counter() - tic, time.perf_counter()

        self.settle()  # the last push's apply first: one VW's pushes are added in turn
        phase("apply")
        if all(p.store == 0 for p in self.layout):  # small weights: the ledger's store only
            sources, seen, ledger = self._stage_committing(vw, wave, stage, flat)
        else:
            seen = self.last_ledger()
            sources, ledger = self._check(vw, wave, stage, seen, flat), None
        phase("stage")
        if ledger is None:
            ledger = self._commit(vw, wave, stage, seen, phase)
        self._applying = self._applier.submit(
            self.apply, vw, wave, wave - ledger.starts[vw], sources
        )
        return ledger

    def _stage_committing(
        self, vw: str, wave: int, stage: str, flat: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, str], Ledger, Ledger | None]:
        """Stage and check every piece (all on the ledger's store), the last piece's request
        committing the wave in the newest ledger this client saw: the store swaps it once that
        stage passed its check, if the piece holds every wave the check took as added. One
        request for a one-piece push.

        Returns:
          ``(sources, seen, ledger)``: the staged updates' checksums by piece, the ledger the
          checks were made beside, and the ledger after the commit; None when it did not swap
          (another change came first, or the ledger's JSON is too large for a stage's
          request): then every stage is checked beside ``seen``'s waves and :meth:`_commit`
          commits it.
        """
        self.last_ledger()
        seen, version = self._last
        after = None
        with contextlib.suppress(WSPError):  # refused here: the usual commit says why, or
            committed = seen.commit(vw, wave)  # commits on a newer ledger
            after = committed.to_json()
        if after is not None and len(json.dumps(after, separators=(",", ":"))) > MAX_SWAP_BYTES:
            after = None  # too large to ride in a stage's header
        beside, basis = self._beside(seen)
        client, sources, covered, cas = self.coordinator, {}, True, None
        with self._refused(vw, wave, stage):
            for p in self.layout:
                last = p is self.layout[-1]
                swap = after is not None and covered and last
                staged = client.stage(
                    stage + p.key,
                    [flat[s.leaf][s.start : s.stop] for s in p.spans],
                    into=WEIGHTS + p.key,
                    name=vw,
                    beside=beside[p.key],
                    sync=self.sync,
                    swap=Swap(PATH, after, version, basis[p.key]) if swap else None,
                )
                sources[p.key], cas = staged.update.checksum, staged.swap
                self._clocks[p.key] = dict(staged.into.clocks)
                covered &= _covers(self._clocks[p.key], basis[p.key])
        if cas is not None and cas.swapped:
            return sources, seen, self._swapped(committed, cas.version)
        if cas is not None and cas.value is not None:
            self._saw(Ledger.from_json(cas.value), cas.version)
        if not covered:  # a piece lacked a wave its check took as added: checked again
            self._check(vw, wave, stage, seen)
        return sources, seen, None

    def settle(self) -> None:
        """Wait until this client's last push is added into the weights (:meth:`push` adds it
        behind its acknowledgement); :meth:`pull`, :meth:`push` and the others call it first.

        Raises:
          WSPError: a piece holds that push from another update (``"refused"``, as
            :meth:`apply` says). A store that failed the add is not an error here: the wave is
            committed and staged, and the next pull adds it (the store's error comes from the
            request that needs the store).
        """
        future = self._applying  # kept: every thread waits for it, and hears its error
        if future is not None and isinstance(future.exception(), WSPError):
            raise future.exception()

    def _commit(self, vw: str, wave: int, stage: str, seen: Ledger, phase) -> Ledger:
        """Commit a staged wave, checked beside the waves ``seen`` commits, in the ledger if no
        wave was committed since ``seen``; else check it again beside those. So a committed
        wave is never refused when it is added: the ledger is never ahead of the weights for
        good."""
        for _ in range(STAGE_TRIES):

            def commit(led: Ledger, seen=seen) -> tuple[Ledger, None]:
                if led.pushed(vw, wave):  # in already: a try whose reply was lost
                    return led, None
                if led.committed != seen.committed:  # a wave committed since the check
                    raise _Stale
                return led.commit(vw, wave), None

            try:
                ledger, _ = self.update(commit, last=True)
            except _Stale:
                phase("commit")
                seen = self.last_ledger()  # the ledger the swap failed on
                self._check(vw, wave, stage, seen)
                phase("stage")
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

    def _check(
        self, vw: str, wave: int, stage: str, seen: Ledger, flat: Mapping | None = None
    ) -> dict[str, str]:
        """Check a wave's update of every piece beside the waves ``seen`` commits that the
        piece lacks (no order of adding them all can overflow), putting it under ``stage``
        first when ``flat`` (the updates) is given; the staged updates' checksums by piece. A
        piece found holding fewer waves than its check assumed (its store lost a sum) is
        checked again."""
        sources: dict[str, str] = {}
        for _ in range(STAGE_TRIES):
            beside, basis = self._beside(seen)
            held: dict[str, dict[str, int]] = {}  # piece key -> its clocks when checked

            def one(client: StoreClient, pieces: list[Piece], beside=beside, held=held) -> None:
                for p in pieces:
                    into, at = WEIGHTS + p.key, stage + p.key
                    if flat is not None and p.key not in sources:
                        runs = [flat[s.leaf][s.start : s.stop] for s in p.spans]
                        staged, info, _ = client.stage(
                            at, runs, into=into, name=vw, beside=beside[p.key], sync=self.sync
                        )
                        sources[p.key] = staged.checksum
                    else:
                        info, _ = client.accumulate(
                            into, at, name=vw, clock=0, check=True, beside=beside[p.key]
                        )
                    held[p.key] = self._clocks[p.key] = dict(info.clocks)

            with self._refused(vw, wave, stage):
                self._each_store(one)
            if all(_covers(held[key], b) for key, b in basis.items()):
                return sources
        self._drop_stage(stage)
        raise WSPError(
            f"push of wave {wave} by {vw!r}: a piece held fewer waves than its check assumed "
            f"in each of {STAGE_TRIES} checks (a store restarting over and over?)",
            "busy",
        )

    def _beside(self, ledger: Ledger) -> tuple[dict[str, list], dict[str, dict[str, int]]]:
        """Piece key -> ``(vw, push, stage)`` of each wave ``ledger`` commits that the piece
        lacked when a store last replied (it may hold some by the time the store checks: those
        are skipped there); and the clocks that list assumed. Pieces whose clocks are unknown,
        or whose list would be longer than a check takes, are listed first."""

        def pending(key: str) -> list[tuple[str, int, str]]:
            held = self._clocks[key]
            return [
                (v, n, f"{STAGE}{v}/{ledger.starts[v] + n}/{key}")
                for v, pushes in sorted(ledger.committed.items())
                for n in range(held.get(v, 0), pushes)
            ]

        keys = [p.key for p in self.layout]
        if any(k not in self._clocks or len(pending(k)) > wire.MAX_BESIDE for k in keys):
            for client in self.clients:
                for info in client.list(WEIGHTS):
                    self._clocks[info.path[len(WEIGHTS) :]] = dict(info.clocks)
        basis = {key: dict(self._clocks[key]) for key in keys}
        return {key: pending(key) for key in keys}, basis

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

    @contextlib.contextmanager
    def _refused(self, vw: str, wave: int, stage: str):
        """A stage's check refusing the update (the store's ``"nonfinite"``) raised as the
        push's ``WSPError "invalid"``, the wave's other stages deleted: nothing is committed."""
        try:
            yield
        except StoreError as error:
            if error.reason != "nonfinite":
                raise
            self._drop_stage(stage)
            raise WSPError(f"push of wave {wave} by {vw!r}: {error}", "invalid") from None

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
            return _accumulate(client, pieces, stage, vw, push, sources, self._clocks)

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
        self.settle()
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
        self.settle()
        deadline = time.monotonic() + timeout
        out, places = pull_buffer(self.layout, self.shapes)
        while True:
            ledger = ledger or self.ledger()
            read = functools.partial(
                _read, places=places, ledger=ledger, pending=pending, clocks=self._clocks
            )
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
        self.settle()
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
    client: StoreClient, pieces: list[Piece], stage: str, vw: str, push: int, sources, clocks
) -> tuple[list[str], list[str]]:
    """Push ``push`` of ``vw`` staged under ``stage`` added into ``pieces`` of one store (see
    :meth:`ParameterServer.apply`): the keys of the pieces it is out of turn for, and of those
    holding it from another update than ``sources`` says. Each piece's clocks after go into
    ``clocks``."""
    behind, other = [], []
    for p in pieces:
        try:
            info, applied = client.accumulate(
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
        clocks[p.key] = dict(info.clocks)
        if sources is not None and not applied:
            other.append(p.key)
    return behind, other


def _read(
    client: StoreClient, pieces: list[Piece], places, ledger: Ledger, pending, clocks
) -> tuple:
    """``pieces`` of one store read, each straight into its place in its leaves (``places``):
    the ``(vw, push)`` that ``ledger`` commits and a piece lacks, and the pieces that lack the
    ``pending`` push (see :meth:`ParameterServer.pull`). Each piece's clocks go into
    ``clocks``. A piece whose segment holds every wave the ledger commits is read from it with
    no request (``StoreClient.peek``); the others are asked for."""
    behind, lacking = set(), []
    for p in pieces:
        held = client.peek(WEIGHTS + p.key, places[p.index])  # no request: its segment
        if held is None or _behind(held, ledger):
            _, info = client.get(WEIGHTS + p.key, with_info=True, out=places[p.index])
            held = info.clocks
        clocks[p.key] = dict(held)
        behind |= _behind(held, ledger)
        if pending is not None and not _holds(held, ledger, *pending[:2]):
            lacking.append(p)
    return behind, lacking


def _behind(clocks: Iterable[tuple[str, int]], ledger: Ledger) -> set[tuple[str, int]]:
    """The ``(vw, push)`` that ``ledger`` commits and an array with these ``clocks`` (its
    :class:`ObjectInfo`'s: VW -> the pushes it holds) lacks."""
    held = dict(clocks)
    return {
        (vw, n) for vw, pushes in ledger.committed.items() for n in range(held.get(vw, 0), pushes)
    }


def _covers(held: Mapping[str, int], basis: Mapping[str, int]) -> bool:
    """Whether an array with clocks ``held`` holds every push ``basis`` counts (VW -> pushes):
    those a check took as added."""
    return all(held.get(vw, 0) >= n for vw, n in basis.items())


def _holds(clocks: Iterable[tuple[str, int]], ledger: Ledger, vw: str, wave: int) -> bool:
    """Whether an array with these ``clocks`` holds ``vw``'s push of its wave ``wave``."""
    return dict(clocks).get(vw, 0) > wave - ledger.starts[vw]
