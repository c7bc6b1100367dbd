"""Hydrozoa's third thread of a worker: data prefetching beside compute and communication.

A VW's next wave is known only once its minibatches are leased from the ledger, and it claims
them after it pushed the wave before (its clock then), so on its own the VW reads and places
each wave's minibatches while its devices idle. The ledger lets a VW hold one **lease ahead**
(the wave after the one whose push is in flight), and a claim asked again returns the same
lease: a :class:`Prefetcher` thread claims wave ``k + 1`` ahead as soon as wave ``k - 1``'s push
has committed, while wave ``k`` computes, then reads and places its minibatches on the devices.
When the VW claims wave ``k + 1`` itself (after WSP's wait) it gets that lease back, and its
data path takes the batches already placed. Exactly-once holds as before: a lease ahead is the
ledger's, returned when the VW leaves, is dropped or dies.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable

from tenplex_jax._src.errors import StoreError, WSPError

SETTLE_SECONDS = 0.5  # the longest the thread blocks on a push before it looks at ``closed``


class Prefetcher:
    """Claims a VW's next wave ahead and reads and places its minibatches on a thread.

    Args:
      name: the VW's name (the thread's).
      claim: ``claim(wave) -> minibatches``: lease ``wave`` ahead from the ledger (the
        ``Nm`` ids, none when the run has none left).
      load: ``load(minibatch) -> batch``: read and place one minibatch (``device_batch``).
      ended: ``ended() -> bool``: whether the VW has ended without closing it (crashed,
        dropped): the thread then ends by itself.

    Attributes:
      hits: minibatches the VW took placed.
      misses: minibatches it read itself (not prefetched, or not yet claimed ahead).
      seconds: the thread's seconds reading and placing.
      skipped: why a wave was not claimed ahead (a refusal, the VW dropped), in order.
    """

    def __init__(
        self,
        name: str,
        claim: Callable[[int], tuple[int, ...]],
        load: Callable[[int], tuple],
        ended: Callable[[], bool] = lambda: False,
    ):
        self.claim, self.load, self.ended = claim, load, ended
        self.hits = self.misses = 0
        self.seconds = 0.0
        self.skipped: list[str] = []
        self._ready: dict[int, concurrent.futures.Future] = {}
        self._taken: set[int] = set()  # read by the VW itself: never placed again
        self._lock = threading.Lock()
        self._asked = -1  # the last wave asked for
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"wsp-prefetch-{name}")
        self._thread.start()

    def ahead(self, wave: int, after: concurrent.futures.Future | None) -> None:
        """Claim ``wave`` ahead once ``after`` (the push in flight, which must commit first: the
        ledger allows one lease ahead) has settled, and place its minibatches; asked once."""
        if wave > self._asked:
            self._asked = wave
            self._requests.put((wave, after))

    def take(self, minibatch: int):
        """The placed batch of ``minibatch`` (waiting while it is being placed), or None: the VW
        reads it itself."""
        with self._lock:
            future = self._ready.pop(minibatch, None)
            if future is None:
                self._taken.add(minibatch)
                self.misses += 1
                return None
            self.hits += 1
        return future.result()

    def close(self) -> None:
        """Stop the thread, drop what it placed (the VW is leaving)."""
        self._closed.set()
        self._requests.put(None)
        self._thread.join()
        with self._lock:
            for future in self._ready.values():
                future.cancel()  # (placed ones keep their result; a take raises, never hangs)
            self._ready.clear()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _next(self):
        """The next request; None once closed or the VW ended."""
        while not (self._closed.is_set() or self.ended()):
            try:
                return self._requests.get(timeout=SETTLE_SECONDS)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        while (request := self._next()) is not None:
            wave, after = request
            while after is not None and not self._closed.is_set():
                done, _ = concurrent.futures.wait([after], timeout=SETTLE_SECONDS)
                if done:
                    break
            if self._closed.is_set():
                return
            try:
                minibatches = self.claim(wave)
            except (WSPError, StoreError) as error:  # refused (a push failed), dropped: the VW
                self.skipped.append(f"wave {wave}: {error}")  # claims and reads it itself
                continue
            with self._lock:
                mine = [k for k in minibatches if k not in self._taken]
                futures = {k: concurrent.futures.Future() for k in mine}
                self._ready.update(futures)
            for k, future in futures.items():
                if self._closed.is_set():
                    return
                tic = time.perf_counter()
                try:
                    future.set_result(self.load(k))
                except BaseException as error:  # raised where the VW takes it
                    future.set_exception(error)
                self.seconds += time.perf_counter() - tic
