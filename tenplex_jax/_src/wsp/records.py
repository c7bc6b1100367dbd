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
    first store, ``coordinator``. A request the store fails raises ``StoreError``."""

    coordinator: StoreClient
    _seen: threading.local  # per thread of the client: ``version``, of the last ledger it read
    # or wrote (a thread waits for what it has not seen, whatever the client's other threads saw)

    def ledger(self) -> Ledger:
        """The job's :class:`Ledger` as stored now.

        Raises:
          StoreError: there is no job (``"not_found"``), or the store failed the request.
          WSPError: the stored ledger is malformed (``"corrupt"``).
        """
        record, self._seen.version, _ = self.coordinator.get_json(PATH, versioned=True)
        return Ledger.from_json(record)

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
        return Ledger.from_json(record)

    def update(self, change: Callable[[Ledger], tuple[Ledger, object]], tries: int = 1000):
        """Change the ledger atomically: compare-and-swap, retried on conflict; then compact its
        log if it is long.

        Args:
          change: ``change(ledger) -> (ledger, result)``, pure (it may run several times). What
            it raises (a ``WSPError`` of the ledger's rules) propagates.
          tries: conflicts in a row before giving up.

        Returns:
          ``(ledger, result)`` of the call whose ledger was stored.

        Raises:
          WSPError: the ledger changed under ``tries`` tries (``"busy"``), or what ``change``
            raises.
          StoreError: the store failed a request.
        """
        record, version, _ = self.coordinator.get_json(PATH, versioned=True)
        for _ in range(tries):
            before = Ledger.from_json(record)
            ledger, result = change(before)
            if ledger == before:  # nothing to write (a claim with nothing left, say)
                self._seen.version = version
                return ledger, result
            # a reply lost after the swap: the store answers the request's retry as swapped
            cas = self.coordinator.cas_json(PATH, ledger.to_json(), expect=version)
            if cas.swapped:
                self._seen.version = cas.version
                if len(ledger.log) > 2 * LOG_KEPT:
                    ledger = self._compact(ledger, cas.version)
                return ledger, result
            record, version = cas.value, cas.version
        raise WSPError(f"the ledger changed under {tries} tries in a row", "busy")

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
        cas = self.coordinator.cas_json(PATH, compacted.to_json(), expect=version)
        if not cas.swapped:
            return ledger
        self._seen.version = cas.version
        return compacted

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
