"""The parameter server's records in its first store: the ledger, its archived log, heartbeats.

The ledger (:mod:`~tenplex_jax._src.wsp.ledger`) is one JSON object changed by compare-and-swap,
written by claims and commits only: heartbeats are counters in objects of their own
(``wsp/beat/<vw>/beat``); a waiting client blocks on the store until the ledger changes (``wait``);
past ``2 * LOG_KEPT`` entries, all but the newest ``LOG_KEPT`` move into an immutable segment
(``wsp/log/...``, named by its content, each naming the one before, written before the ledger
names it), so the ledger stays small however long the run (``history`` reads the whole log). A
compaction that loses a race leaves its segment unnamed (a few KiB, never read).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable

from tenplex_jax._src import checksums
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.multihost.store.client import StoreClient
from tenplex_jax._src.wsp.ledger import PATH, Ledger, log_entries

BEATS = "wsp/beat/"  # each VW's heartbeat counter (JSON in the first store)
LOG = "wsp/log/"  # the ledger's archived log segments (JSON in the first store)
LOG_KEPT = 16  # log entries the ledger keeps when compacted; it compacts past twice as many


class Records:
    """The ledger and the heartbeats of a parameter server (its base class): a client of the
    first store, ``coordinator``. A request the store fails raises ``StoreError``.

    Every write of the ledger is fsynced before its reply when ``sync`` (a crash of the
    machine keeps it), else behind it (a kill of the store keeps it)."""

    coordinator: StoreClient
    sync: bool
    _seen: threading.local  # per thread of the client: ``version``, of the last ledger it read
    # or wrote (a thread waits for what it has not seen, whatever the client's other threads saw)
    _last: tuple[Ledger, int] | None  # the newest ledger any thread read or wrote, its version
    _last_lock: threading.Lock  # threads race to note theirs: an older one must not win

    def ledger(self) -> Ledger:
        """The job's :class:`Ledger` as stored now.

        Raises:
          StoreError: there is no job (``"not_found"``), or the store failed the request.
          WSPError: the stored ledger is malformed (``"corrupt"``).
        """
        record, self._seen.version, _ = self.coordinator.get_json(PATH, versioned=True)
        return self._saw(Ledger.from_json(record), self._seen.version)

    def _saw(self, ledger: Ledger, version: int) -> Ledger:
        """Remember ``ledger`` (version ``version``) if it is the newest one seen; ``ledger``.

        Threads note what they read after their requests return, in any order: a read that
        started before another thread's swap may be noted after it. Versions only grow (the
        store's counter outlives restarts), so the newest is kept: a cache that went back
        would hide this client's own writes (a commit, a lease) from its next change."""
        with self._last_lock:
            if self._last is None or version > self._last[1]:
                self._last = (ledger, version)
        return ledger

    def last_ledger(self) -> Ledger:
        """The newest ledger this client read or wrote (read now if none): perhaps older than
        the one stored, never newer, and holding every change this client made. A change
        made from it with ``update(..., last=True)`` still swaps only the ledger it was made
        from."""
        last = self._last
        return last[0] if last is not None else self.ledger()

    def wait(self, seconds: float) -> Ledger:
        """The ledger once it is newer than the last one this thread of the client read or
        wrote: the store answers when it changes (a blocking wait, no polling), or after
        ``seconds`` (then as it is).

        Raises:
          StoreError: there is no job (``"not_found"``), or the store failed the request.
          WSPError: the stored ledger is malformed (``"corrupt"``).
        """
        seen = getattr(self._seen, "version", None)
        if seen is None:
            return self.ledger()
        record, self._seen.version, _ = self.coordinator.get_json(
            PATH, versioned=True, newer_than=seen, wait=seconds
        )
        return self._saw(Ledger.from_json(record), self._seen.version)

    def update(
        self,
        change: Callable[[Ledger], tuple[Ledger, object]],
        tries: int = 1000,
        *,
        last: bool = False,
    ):
        """Change the ledger atomically: compare-and-swap, retried on conflict; then compact its
        log if it is long.

        Args:
          change: ``change(ledger) -> (ledger, result)``, pure (it may run several times). What
            it raises (a ``WSPError`` of the ledger's rules) propagates.
          tries: conflicts in a row before giving up.
          last: start from the last ledger this client saw (:meth:`last_ledger`) instead of
            reading it: one request fewer when no other client wrote it since (a swap from
            an older one fails and is retried from the ledger its reply carries). Only a swap
            proves a ledger current: when ``change`` raises, or changes nothing, on the cached
            one, it runs again on the ledger read from the store, whose answer counts.

        Returns:
          ``(ledger, result)`` of the call whose ledger was stored.

        Raises:
          WSPError: the ledger changed under ``tries`` tries (``"busy"``), or what ``change``
            raises.
          StoreError: the store failed a request.
        """
        cached = self._last if last else None
        if cached is not None:
            before, version = cached
        else:
            before, version = self._read()
        for _ in range(tries):
            try:
                ledger, result = change(before)
            except WSPError:
                if cached is None:
                    raise
                # refused on a ledger perhaps older than the store's: ask the stored one
                cached, (before, version) = None, self._read()
                continue
            if ledger == before:  # nothing to write (a claim with nothing left, say)
                if cached is not None:  # perhaps only in the cache: ask the stored ledger
                    cached, (before, version) = None, self._read()
                    continue
                self._seen.version = version
                return ledger, result
            # a reply lost after the swap: the store answers the request's retry as swapped
            cas = self.coordinator.cas_json(PATH, ledger.to_json(), expect=version, sync=self.sync)
            if cas.swapped:
                return self._swapped(ledger, cas.version), result
            before = self._saw(Ledger.from_json(cas.value), cas.version)
            version, cached = cas.version, None  # the store's ledger now: its answers count
        raise WSPError(f"the ledger changed under {tries} tries in a row", "busy")

    def _swapped(self, ledger: Ledger, version: int) -> Ledger:
        """``ledger``, just stored as ``version`` by this thread, noted as seen; compacted when
        its log is long."""
        self._seen.version = version
        self._saw(ledger, version)
        return self._compact(ledger, version) if len(ledger.log) > 2 * LOG_KEPT else ledger

    def _read(self) -> tuple[Ledger, int]:
        """The ledger as stored now and its version (noted as seen by the client, not by the
        thread: only a wait's read or a swap moves the thread's own)."""
        record, version, _ = self.coordinator.get_json(PATH, versioned=True)
        return self._saw(Ledger.from_json(record), version), version

    def _compact(self, ledger: Ledger, version: int) -> Ledger:
        """Archive all but the newest ``LOG_KEPT`` log entries: a segment written durably
        first (named by its content: a racing compaction of the same ledger writes the same
        one), then named in the ledger by a compare-and-swap of the version just written. The
        ledger as stored after (unchanged when another change came first: a later update
        compacts)."""
        moved = ledger.log[:-LOG_KEPT]
        segment = {"log": [[vw, w, list(m)] for vw, w, m in moved], "previous": ledger.archive}
        digest = checksums.of(json.dumps(segment, sort_keys=True).encode())
        path = f"{LOG}{ledger.archived:012d}-{digest.removeprefix(checksums.PREFIX)}"
        self.coordinator.put_json(path, segment, flush=False)
        compacted, _ = ledger.compact(LOG_KEPT, path)
        cas = self.coordinator.cas_json(PATH, compacted.to_json(), expect=version, sync=self.sync)
        if not cas.swapped:
            return ledger
        self._seen.version = cas.version
        return self._saw(compacted, cas.version)

    def history(self, ledger: Ledger | None = None) -> Ledger:
        """The ledger with its whole log: the archived segments read back, oldest first.

        Args:
          ledger: the ledger (default: the one stored now).

        Raises:
          StoreError: a segment the ledger names cannot be read, or a store failed a request.
          WSPError: a segment is malformed (``"corrupt"``).
        """
        ledger = ledger or self.ledger()
        segments, path = [], ledger.archive
        while path is not None:
            segment = self.coordinator.get_json(path)
            try:
                segments.append(log_entries(segment["log"]))
                path = segment["previous"]
            except (KeyError, TypeError, ValueError) as error:
                raise WSPError(
                    f"the log segment {path!r} is malformed: {error!r:.200}", "corrupt"
                ) from None
        log = tuple(entry for segment in reversed(segments) for entry in segment) + ledger.log
        return dataclasses.replace(ledger, log=log, archived=0, archive=None)

    def beat(self, vw: str, count: int) -> None:
        """VW ``vw``'s heartbeat (before it joins, then every quarter of its timeout): its counter
        ``count`` in an object of its own, never the ledger; any change shows it alive."""
        self.coordinator.put_json(f"{BEATS}{vw}/beat", {"beat": int(count)}, flush=False)

    def beats(self) -> dict[str, int]:
        """Every VW's last heartbeat counter (VWs that never beat, or whose object is gone, are
        absent)."""
        out = {}
        for path in self.coordinator.list_json(BEATS):
            record = self.coordinator.get_json(path, default=None)
            if isinstance(record, dict) and isinstance(record.get("beat"), int):
                out[path[len(BEATS) : -len("/beat")]] = record["beat"]
        return out

    def forget(self, vw: str) -> None:
        """Delete ``vw``'s heartbeat object (once it has left or was dropped)."""
        self.coordinator.delete(f"{BEATS}{vw}/")
