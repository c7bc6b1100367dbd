"""The ledger of an asynchronous job: who trains, which minibatches they hold, what is done.

One small record, kept as one JSON object in a tensor store and changed only by compare-and-swap
(:meth:`tenplex_jax.multihost.store.StoreClient.cas_json`), so every change is atomic whatever the
virtual workers (VWs) do concurrently. Everything here is pure: ``Ledger`` methods return a new
ledger (and a result), so the rules are tested exhaustively without stores or devices.

- **The data cursor.** Minibatches are the dataset PTC's global batches ``0, 1, 2, ...``.
  ``claim`` leases a VW the next ``Nm`` for its wave, those handed back first; a VW whose push is
  in flight may lease one wave ahead, which its commit turns into its lease.
- **Commits.** ``commit`` turns a VW's lease for wave ``c`` into a log entry ``(vw, c,
  minibatches)`` and advances its clock to ``c + 1``: the log is the exactly-once proof.
- **Members and deaths.** A VW ``join``s at the slowest member's clock. A VW that sees a member's
  heartbeats (:class:`Beats`, not in the ledger) stand still past the timeout has it ``drop``ped:
  its leases go back and it leaves the clock barrier; its late commit is refused. ``leave`` is the
  graceful exit.
- **Compaction.** ``compact`` moves all but the newest log entries into archived segments
  (``archive`` names the newest; :meth:`ParameterServer.history` reads the whole log).
- **Wave synchronous parallel.** ``may_start(vw, wave, D)``: a VW starts wave ``k`` only when every
  member has committed at least ``k - D`` waves.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

from tenplex_jax._src.errors import WSPError

PATH = "wsp/ledger"  # the ledger's JSON object in the coordinating store


class Start(enum.StrEnum):
    """What a VW does before a wave (:meth:`Ledger.decide`)."""

    GO = "go"  # its weights are fresh enough
    PULL = "pull"  # the slowest has committed enough waves: pull the global weights, then go
    WAIT = "wait"  # for the slowest member's next commit


@dataclasses.dataclass(frozen=True)
class Lease:
    """The minibatches a VW trains in its wave ``wave``."""

    wave: int
    minibatches: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The record of an asynchronous job: who trains, which minibatches they hold, what is done.

    Pure and frozen: every change returns a new ledger (and a result); the parameter server
    stores it and changes it by compare-and-swap (``ParameterServer.update``).

    >>> ledger = Ledger(total=4).join("vw1")
    >>> ledger, minibatches = ledger.claim("vw1", wave=0, count=3)
    >>> minibatches
    (0, 1, 2)
    >>> ledger = ledger.commit("vw1", 0)
    >>> ledger.trained(), dict(ledger.clocks), ledger.done
    ([0, 1, 2], {'vw1': 1}, False)

    Attributes:
      total: minibatches in the run (None: unbounded).
      cursor: the next fresh minibatch of the global order.
      returned: minibatches handed back (by a VW that left or was dropped), claimed first.
      clocks: each live member's clock: the waves it counts as done (a joiner starts at the
        slowest's clock).
      leases: each live member's claimed, uncommitted minibatches (a ``Lease``: its wave and
        minibatches).
      ahead: each live member's lease of the wave after its leased one, claimed while the push
        of that one is in flight (at most one; the commit makes it the member's lease).
      committed: how many waves every VW, live or gone, has pushed (its waves ``starts[vw] ..
        starts[vw] + committed[vw] - 1``).
      starts: the clock each VW joined at.
      log: the newest committed waves in commit order: ``(vw, wave, minibatches)`` (the older
        ones are archived).
      dropped: VWs dropped (died or fell silent).
      left: VWs that left gracefully.
      undone: waves an operator rolled back (``roll_back``), as log entries: their
        minibatches went back to be trained again; the push still counts in the VW's clock.
      archived: how many minibatches the archived log entries hold.
      archive: the store path of the newest archived segment of the log (``None``: none).
    """

    total: int | None = None
    cursor: int = 0
    returned: tuple[int, ...] = ()
    clocks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    leases: Mapping[str, Lease] = dataclasses.field(default_factory=dict)
    ahead: Mapping[str, Lease] = dataclasses.field(default_factory=dict)
    committed: Mapping[str, int] = dataclasses.field(default_factory=dict)
    starts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    log: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    dropped: tuple[str, ...] = ()  # died or fell silent
    left: tuple[str, ...] = ()  # left gracefully
    undone: tuple[tuple[str, int, tuple[int, ...]], ...] = ()  # rolled back by an operator
    archived: int = 0
    archive: str | None = None

    # -- reading -------------------------------------------------------------------------------

    @property
    def min_clock(self) -> int | None:
        """The slowest live member's committed waves (None without members)."""
        return min(self.clocks.values()) if self.clocks else None

    def may_start(self, vw: str, wave: int, distance: int) -> bool:
        """WSP's rule: whether ``vw`` may start ``wave``: every member has committed ``wave -
        distance`` waves (``distance``: ``D``). Always without members; every member's clock
        counts, not ``vw``'s."""
        slowest = self.min_clock
        return slowest is None or wave - slowest <= distance

    def decide(
        self,
        vw: str,
        wave: int,
        fresh: int,
        distance: int,
        members: Iterable[str] | None = None,
    ) -> Start:
        """What a VW does before a wave.

        Args:
          vw: the VW.
          wave: the wave it is about to start.
          fresh: its weights hold every member's first ``fresh`` waves (the slowest's clock at
            its last pull).
          distance: WSP's ``D``.
          members: the members when it last pulled (default: the ledger's now). One that
            joined since holds none of its waves in the VW's weights, and may have joined below
            ``fresh`` (at the ledger's slowest clock, the VW's own while its push was in
            flight): ``fresh`` is at most its start.

        Returns:
          ``GO`` (fresh enough: ``fresh >= wave - D``), ``PULL`` (the slowest has committed
          ``wave - D`` waves: pull, then go) or ``WAIT``.
        """
        if members is not None:
            known = set(members)
            fresh = min([fresh, *(self.starts[m] for m in self.clocks if m not in known)])
        if fresh >= wave - distance:
            return Start.GO
        return Start.PULL if self.may_start(vw, wave, distance) else Start.WAIT

    @property
    def done(self) -> bool:
        """Every minibatch of the run trained: none left at the cursor, returned or leased."""
        return (
            self.total is not None
            and self.cursor >= self.total
            and not self.returned
            and not self.leases  # (a lease ahead comes with a lease)
        )

    def pushed(self, vw: str, wave: int) -> bool:
        """Whether ``vw`` has committed its wave ``wave`` (live, dropped or gone since)."""
        start = self.starts.get(vw, 0)
        return vw in self.committed and start <= wave < start + self.committed[vw]

    def trained(self) -> list[int]:
        """The committed minibatches of the log held here, in commit order (each exactly once,
        by construction; :meth:`ParameterServer.history` gives a ledger holding the whole log)."""
        return [m for _, _, minibatches in self.log for m in minibatches]

    @property
    def trained_count(self) -> int:
        """How many minibatches are committed: the archived ones and the log's."""
        return self.archived + sum(len(m) for _, _, m in self.log)

    def _check_member(self, vw: str, what: str) -> None:
        if vw not in self.clocks:
            gone = (
                "was dropped (silent past the timeout)"
                if vw in self.dropped
                else ("has left" if vw in self.left else "never joined")
            )
            raise WSPError(
                f"{what}: virtual worker {vw!r} {gone}; live members: {sorted(self.clocks)}",
                "dropped",
            )

    # -- changes -------------------------------------------------------------------------------

    def join(self, vw: str) -> Ledger:
        """A VW joins at the slowest member's clock (0 in an empty job), so it never holds the
        others back.

        Raises:
          WSPError: the name ``vw`` has been a member (``"refused"``).
        """
        if vw in self.committed or vw in self.clocks:
            raise WSPError(
                f"a virtual worker's name is used once; {vw!r} has been a member", "refused"
            )
        clock = self.min_clock or 0
        return dataclasses.replace(
            self,
            clocks={**self.clocks, vw: clock},
            committed={**self.committed, vw: 0},
            starts={**self.starts, vw: clock},
        )

    def drop(self, silent: Iterable[str]) -> tuple[Ledger, tuple[str, ...]]:
        """Drop members found silent (their heartbeats stopped: :class:`Beats`): their leased
        minibatches go back, and they leave the clock barrier.

        Args:
          silent: names; those no longer members (dropped or left meanwhile) are ignored.

        Returns:
          ``(ledger, dropped)``: the new ledger and the names dropped.
        """
        names = tuple(sorted(set(silent) & set(self.clocks)))
        ledger = self
        for vw in names:
            ledger = ledger._without(vw, dropped=True)
        return ledger, names

    def leave(self, vw: str) -> Ledger:
        """A member leaves gracefully: its uncommitted minibatches go back.

        Raises:
          WSPError: ``vw`` is not a member (``"dropped"``).
        """
        self._check_member(vw, "leave")
        return self._without(vw, dropped=False)

    def _without(self, vw: str, dropped: bool) -> Ledger:
        held = [lease.minibatches for lease in (self.leases.get(vw), self.ahead.get(vw)) if lease]
        back = tuple(sorted((*self.returned, *(m for minibatches in held for m in minibatches))))
        return dataclasses.replace(
            self,
            returned=back,
            clocks={k: v for k, v in self.clocks.items() if k != vw},
            leases={k: v for k, v in self.leases.items() if k != vw},
            ahead={k: v for k, v in self.ahead.items() if k != vw},
            dropped=self.dropped + ((vw,) if dropped else ()),
            left=self.left + (() if dropped else (vw,)),
        )

    def claim(self, vw: str, wave: int, count: int) -> tuple[Ledger, tuple[int, ...]]:
        """Lease a member minibatches for its next wave: returned ones first, then the cursor's.

        The next wave is its clock's; while it holds that wave's lease (its push in flight), the
        one after, as its lease ahead. Asking again for a leased wave returns the same lease (a
        retried request).

        Args:
          vw: the member.
          wave: its clock, or its clock + 1 while it holds its clock's lease.
          count: the most minibatches to lease (its ``Nm``).

        Returns:
          ``(ledger, minibatches)``; no minibatches (and the same ledger) when none is left now.

        Raises:
          WSPError: ``vw`` is not a member (``"dropped"``), or ``wave`` is neither its next
            nor, while it holds that one's lease, the one after (``"refused"``).
        """
        self._check_member(vw, "claim")
        lease, ahead, clock = self.leases.get(vw), self.ahead.get(vw), self.clocks[vw]
        for held in (lease, ahead):
            if held is not None and held.wave == wave:
                return self, held.minibatches
        allowed = clock if lease is None else (clock + 1 if ahead is None else None)
        if wave != allowed:
            raise WSPError(
                f"virtual worker {vw!r} has committed {clock} waves and holds "
                + (f"wave {lease.wave}'s lease" if lease else "no lease")
                + (f" and wave {ahead.wave}'s lease ahead" if ahead else "")
                + "; it may claim "
                + ("no wave before a commit" if allowed is None else f"wave {allowed}")
                + f", not wave {wave}",
                "refused",
            )
        taken = self.returned[:count]
        fresh = count - len(taken)
        end = self.cursor + fresh if self.total is None else min(self.cursor + fresh, self.total)
        minibatches = (*taken, *range(self.cursor, end))
        if not minibatches:
            return self, ()
        held = "leases" if wave == clock else "ahead"
        return dataclasses.replace(
            self,
            returned=self.returned[len(taken) :],
            cursor=end,
            **{held: {**getattr(self, held), vw: Lease(wave=wave, minibatches=minibatches)}},
        ), minibatches

    def commit(self, vw: str, wave: int) -> Ledger:
        """A member's wave is pushed: log its minibatches and advance its clock (the atomic point
        of a push); its lease ahead, if any, becomes its lease.

        Raises:
          WSPError: ``vw`` was dropped, its minibatches gone to others (``"dropped"``), or holds
            no lease for the wave (``"refused"``).
        """
        self._check_member(vw, "commit")
        lease = self.leases.get(vw)
        if lease is None or lease.wave != wave:
            raise WSPError(
                f"commit of wave {wave} by {vw!r}: it holds "
                f"{'no lease' if lease is None else f'wave {lease.wave}'}",
                "refused",
            )
        leases = {k: v for k, v in self.leases.items() if k != vw}
        if vw in self.ahead:
            leases[vw] = self.ahead[vw]
        return dataclasses.replace(
            self,
            clocks={**self.clocks, vw: wave + 1},
            committed={**self.committed, vw: wave + 1 - self.starts[vw]},
            leases=leases,
            ahead={k: v for k, v in self.ahead.items() if k != vw},
            log=self.log + ((vw, wave, lease.minibatches),),
        )

    def roll_back(self, vw: str, wave: int) -> Ledger:
        """Undo the last committed wave (an operator's, after its update was taken out of the
        weights): its log entry moves to ``undone`` and its minibatches go back, to be trained
        again; the VW's clock and committed count stay (the push counts, as a no-op).

        Raises:
          WSPError: ``(vw, wave)`` is not the last log entry (``"refused"``).
        """
        if not self.log or self.log[-1][:2] != (vw, wave):
            last = self.log[-1][:2] if self.log else None
            raise WSPError(
                f"only the last committed wave can be rolled back; it is {last}, not {(vw, wave)}",
                "refused",
            )
        entry = self.log[-1]
        return dataclasses.replace(
            self,
            log=self.log[:-1],
            undone=self.undone + (entry,),
            returned=tuple(sorted((*self.returned, *entry[2]))),
        )

    def compact(self, keep: int, archive: str) -> tuple[Ledger, tuple]:
        """Move all but the newest ``keep`` log entries out (the roll-back-able last one always
        stays): the parameter server has written them, as a segment at ``archive``, first.

        Args:
          keep: log entries kept (>= 1).
          archive: the store path of the segment holding the entries moved out (it names the
            previous segment, :attr:`archive`).

        Returns:
          ``(ledger, moved)``: the new ledger and the entries moved out, oldest first (none, and
          the same ledger, when the log holds at most ``keep``).
        """
        keep = max(1, keep)
        moved = self.log[:-keep]
        if not moved:
            return self, ()
        return dataclasses.replace(
            self,
            log=self.log[-keep:],
            archived=self.archived + sum(len(m) for _, _, m in moved),
            archive=archive,
        ), moved

    # -- the JSON record -----------------------------------------------------------------------

    def to_json(self) -> dict:
        """The ledger as a JSON-able dict: each field by its name, a lease as ``[wave,
        minibatches]``, a tuple as a list. (Written out, not ``dataclasses.asdict``: its deep
        copy was a tenth of a push.)"""
        entries = lambda log: [[vw, wave, list(ms)] for vw, wave, ms in log]
        leases = lambda held: {k: [v.wave, list(v.minibatches)] for k, v in held.items()}
        return {
            "total": self.total,
            "cursor": self.cursor,
            "returned": list(self.returned),
            "clocks": dict(self.clocks),
            "leases": leases(self.leases),
            "ahead": leases(self.ahead),
            "committed": dict(self.committed),
            "starts": dict(self.starts),
            "log": entries(self.log),
            "dropped": list(self.dropped),
            "left": list(self.left),
            "undone": entries(self.undone),
            "archived": self.archived,
            "archive": self.archive,
        }

    @classmethod
    def from_json(cls, record: Mapping) -> Ledger:
        """The ledger of a :meth:`to_json` ``record`` (as read back from the store).

        Raises:
          WSPError: the record is malformed (``"corrupt"``).
        """
        try:
            lease = lambda w, ms: Lease(wave=int(w), minibatches=tuple(int(m) for m in ms))
            return cls(
                total=None if record["total"] is None else int(record["total"]),
                cursor=int(record["cursor"]),
                returned=tuple(int(m) for m in record["returned"]),
                clocks={str(k): int(v) for k, v in record["clocks"].items()},
                leases={str(k): lease(*v) for k, v in record["leases"].items()},
                ahead={str(k): lease(*v) for k, v in record.get("ahead", {}).items()},
                committed={str(k): int(v) for k, v in record["committed"].items()},
                starts={str(k): int(v) for k, v in record["starts"].items()},
                log=log_entries(record["log"]),
                dropped=tuple(str(v) for v in record["dropped"]),
                left=tuple(str(v) for v in record["left"]),
                undone=log_entries(record.get("undone", ())),
                archived=int(record.get("archived", 0)),
                archive=None if record.get("archive") is None else str(record["archive"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise WSPError(f"the ledger record is malformed: {error!r:.200}", "corrupt") from None


def log_entries(entries) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """Log entries ``(vw, wave, minibatches)`` as read back from JSON."""
    return tuple((str(vw), int(w), tuple(int(m) for m in ms)) for vw, w, ms in entries)


@dataclasses.dataclass(frozen=True)
class Beats:
    """What one VW saw of the members' heartbeats: each one's last beat and when (on its own
    monotonic clock) that beat changed. Heartbeats are counters in objects of their own, never
    clock readings, so no two hosts' clocks are compared; a member is silent once its beat has
    stayed the same, or absent, for ``timeout`` seconds of watching.

    >>> beats = Beats().observe(["a", "b"], {"a": 1, "b": 7}, now=0.0)
    >>> beats = beats.observe(["a", "b"], {"a": 2, "b": 7}, now=5.0)
    >>> beats.silent(now=5.0, timeout=3.0)
    ('b',)
    """

    last: Mapping[str, tuple[int | None, float]] = dataclasses.field(default_factory=dict)

    def observe(self, members: Iterable[str], beats: Mapping[str, int], now: float) -> Beats:
        """Note the members' beats read at ``now``: a changed one restarts its member's clock; a
        member seen for the first time starts watched.

        Args:
          members: the ledger's members (only they are kept).
          beats: member -> its heartbeat counter, as read (absent: no heartbeat object).
          now: the observer's monotonic clock, seconds.
        """
        last = {}
        for vw in members:
            beat, before = beats.get(vw), self.last.get(vw)
            last[vw] = before if before is not None and before[0] == beat else (beat, now)
        return Beats(last=last)

    def silent(self, now: float, timeout: float) -> tuple[str, ...]:
        """The members whose beat has not changed for longer than ``timeout`` seconds."""
        return tuple(sorted(vw for vw, (_, t) in self.last.items() if now - t > timeout))
