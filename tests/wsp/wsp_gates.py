"""Virtual workers driven through a fixed interleaving of wave starts and commits.

:class:`Gates` holds each VW before each wave's start (its ``WorkerOptions.on_ready``) and each
push (its parameter server client's ``push``, wrapped) until the driver lets that one go, and
records what the VWs do, in the order they do it: waves ready, claimed (``on_wave``), WSP waits
begun (the client's ``wait``: a VW calls it only while its next wave may not start, or when
nothing is left to claim; with the commits of the ledger it decided on), pulls (with the
commits their ledger held), pushes made and returned. The driver (the test's thread) releases
one step at a time and waits for what it makes visible, so the runtime takes exactly the steps
a sequential reference takes (``wsp_reference.py``), with no sleeps::

    gates = Gates()
    workers = [gates.watch(make(name, **gates.options())) for name in ("a", "b")]
    with gates.running(workers):
        assert gates.start("a", 0).kind == "claimed"
        gates.commit("a", 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

from tests.wsp.wsp_reference import Version

WAIT_SECONDS = 120.0  # bounds every wait: a loaded 2-core machine compiles and trains slowly


@dataclasses.dataclass(frozen=True)
class Event:
    """Something a VW did: ``kind`` is "ready", "claimed" (``detail``: its minibatches),
    "waiting" (``detail``: the commits of the ledger it decided to wait on, vw -> waves), "pull"
    (``detail``: the commits of the ledger it pulled for), "pushing" (``detail``: the update it
    pushes), "pushed" or "error" (``detail``: the VW's error)."""

    kind: str
    vw: str
    wave: int | None
    detail: object = None


class Gates:
    """Holds VWs at their wave starts and pushes; records their events (see the module)."""

    def __init__(self, timeout: float = WAIT_SECONDS):
        self.timeout = timeout
        self.events: list[Event] = []
        self._changed = threading.Condition()
        self._starts: dict[str, int] = {}  # vw -> the waves it may start (a count)
        self._commits: dict[str, int] = {}  # vw -> the waves it may push (a count)
        self._ready: dict[str, int] = {}  # vw -> the wave it was last ready for
        self._seen: dict[int, dict[str, int]] = {}  # thread -> the commits of its last ledger
        self._open = False  # every gate open: the interleaving is over

    def options(self) -> dict:
        """The ``WorkerOptions`` fields a VW needs to be driven."""
        return {"on_ready": self._on_ready, "on_wave": self._on_wave}

    def watch(self, worker):
        """Wrap ``worker``'s parameter server client (its own): pushes held, pulls and waits
        recorded. ``worker``."""
        ps, name = worker.ps, worker.name
        push, pull, wait, read = ps.push, ps.pull, ps.wait, ps.ledger

        def held_push(vw, wave, updates, **kwargs):
            self._note(Event("pushing", name, wave, {p: x.copy() for p, x in updates.items()}))
            self._hold(lambda: self._commits.get(name, 0) > wave, f"{name}'s push of wave {wave}")
            ledger = push(vw, wave, updates, **kwargs)
            self._note(Event("pushed", name, wave))
            return ledger

        def noted_pull(*args, **kwargs):
            ledger = args[0] if args else kwargs.get("ledger")
            commits = None if ledger is None else dict(ledger.committed)
            self._note(Event("pull", name, self._ready.get(name), commits))
            return pull(*args, **kwargs)

        def seen(ledger):  # what the calling thread decides on next
            self._seen[threading.get_ident()] = dict(ledger.committed)
            return ledger

        def noted_wait(*args, **kwargs):
            decided = self._seen.get(threading.get_ident())
            self._note(Event("waiting", name, self._ready.get(name), decided))
            return seen(wait(*args, **kwargs))

        ps.push, ps.pull, ps.wait = held_push, noted_pull, noted_wait
        ps.ledger = lambda: seen(read())
        return worker

    # -- on the VWs' threads ---------------------------------------------------------------------

    def _note(self, event: Event) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def _hold(self, may: Callable[[], bool], what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._open or may(), self.timeout):
                raise AssertionError(f"{what} was held for {self.timeout} s: never let go")

    def _on_ready(self, vw: str, wave: int) -> None:
        with self._changed:
            self._ready[vw] = wave
        self._note(Event("ready", vw, wave))
        self._hold(lambda: self._starts.get(vw, 0) > wave, f"{vw}'s start of wave {wave}")

    def _on_wave(self, vw: str, wave: int, minibatches) -> None:
        self._note(Event("claimed", vw, wave, tuple(minibatches)))

    # -- the driver ------------------------------------------------------------------------------

    def start(self, vw: str, wave: int) -> Event:
        """Let ``vw`` start wave ``wave``; the first thing it does then: claim the wave
        ("claimed") or begin WSP's wait ("waiting")."""
        with self._changed:
            self._starts[vw] = wave + 1
            self._changed.notify_all()
        return self._first(vw, wave, ("claimed", "waiting"), f"{vw}'s start of wave {wave}")

    def claimed(self, vw: str, wave: int, after: tuple[str, int] | None = None) -> Event:
        """``vw``'s claim of ``wave``, once made; ``after``: the commit ``(vw, wave)`` that lets
        it go, so that a wait decided on a ledger holding that commit fails at once."""

        def waits_past(e: Event) -> bool:
            return e.kind == "waiting" and (e.detail or {}).get(after[0], 0) > after[1]

        kinds = ("claimed",) if after is None else ("claimed", waits_past)
        event = self._first(vw, wave, kinds, f"{vw}'s claim of wave {wave}")
        if event.kind != "claimed":
            raise AssertionError(f"{vw} waits to start wave {wave} after {after} committed")
        return event

    def commit(self, vw: str, wave: int) -> Event:
        """Let ``vw`` push wave ``wave``; its "pushing" event (with the update), once the push
        has returned (committed, and in the weights)."""
        with self._changed:
            self._commits[vw] = wave + 1
            self._changed.notify_all()
        self._first(vw, wave, ("pushed",), f"{vw}'s push of wave {wave}")
        return self._first(vw, wave, ("pushing",), f"{vw}'s push of wave {wave}")

    def _first(self, vw: str, wave: int, kinds: tuple, what: str) -> Event:
        """The first event of ``vw`` in ``wave`` of ``kinds`` (names, or tests of an event)."""

        def first() -> Event | None:
            of = lambda e: any(k(e) if callable(k) else e.kind == k for k in kinds)
            return next((e for e in self.events if e.vw == vw and e.wave == wave and of(e)), None)

        with self._changed:
            found = self._changed.wait_for(
                lambda: first() or any(e.kind == "error" for e in self.events), self.timeout
            )
            errors = [e for e in self.events if e.kind == "error"]
            if errors:
                raise AssertionError(f"waiting for {what}, a VW failed: {errors}")
            if not found:
                raise AssertionError(
                    f"{what}: not seen in {self.timeout} s; the last events: {self.events[-8:]}"
                )
            return first()

    def pulls(self, vw: str) -> list[dict[str, int] | None]:
        """The commits of each pull of ``vw`` (its join's first), in order."""
        return [e.detail for e in self.events if e.vw == vw and e.kind == "pull"]

    @contextlib.contextmanager
    def running(self, workers: Sequence) -> Iterator[None]:
        """``workers`` run on threads of their own; on exit every gate opens (the interleaving
        is over) and each is joined, its error raised."""
        threads = []
        for worker in workers:

            def run(worker=worker):
                try:
                    worker.run()
                except BaseException as error:  # the driver raises it, naming the VW
                    self._note(Event("error", worker.name, None, repr(error)))

            thread = threading.Thread(target=run, name=f"gates-{worker.name}", daemon=True)
            thread.start()
            threads.append(thread)
        try:
            yield
        finally:
            with self._changed:
                self._open = True
                self._changed.notify_all()
            for worker, thread in zip(workers, threads):
                thread.join(self.timeout)
                if thread.is_alive():  # it ends at its next step; the test fails
                    worker.crashed.set()
                    thread.join(self.timeout)
        alive = [w.name for w, t in zip(workers, threads) if t.is_alive()]
        errors = [e for e in self.events if e.kind == "error"]
        if alive or errors:
            raise AssertionError(f"VWs still running: {alive}; failed: {errors}")


def versions(
    records: Sequence, pulls: Sequence[dict[str, int] | None], names: Sequence[str]
) -> list[Version]:
    """What each minibatch of a VW's ``records`` read, by the runtime's account: the commits of
    its last pull before the read (``pulls``: its join's, then one per wave that pulled; a VW of
    ``names`` that had not joined yet counts none) and its own updates (``local_versions``). A
    wave's first minibatches read before its pull, its last after it."""
    pulled, out = iter(pulls), []
    held = next(pulled)
    for record in sorted(records, key=lambda r: r.wave):
        before = held
        if record.pulled:
            held = next(pulled)
        n = len(record.minibatches)
        for j, own in enumerate(record.local_versions):
            seen = held if j == n - 1 else before
            out.append(Version(tuple((vw, seen.get(vw, 0)) for vw in sorted(names)), own))
    return out
