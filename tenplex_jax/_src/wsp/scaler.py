"""Hydrozoa's coordinator running its scaling policy on a live job: a :class:`Scaler` measures the
coordinator's VWs over windows of committed waves, takes or declines offers (``scaler.offer``),
asks a cluster manager for devices while more would pay (``scaler.grow``), reviews what it added
(``scaler.review``), and logs each decision as an event of the coordinator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp.coordinator import Coordinator, VWEventKind
from tenplex_jax._src.wsp.ledger import Ledger
from tenplex_jax._src.wsp.manager import ClusterManager
from tenplex_jax._src.wsp.policy import Action, Measured, ScalingDecision, ScalingPolicy

RECORDS_SECONDS = 10.0  # the longest a measurement waits for its committed waves' records
ENDED = "the run ended before a window could be measured"


class Scaler:
    """Runs a :class:`ScalingPolicy` on a coordinator's live job (Hydrozoa's coordinator).

    Windows are counted in committed waves: a measurement waits (on the ledger, not by polling)
    until ``window`` more waves are committed after ``warmup`` waves since the last change, and
    counts the samples of each VW's waves that ended in it.

    Args:
      coordinator: the job's :class:`Coordinator`.
      policy: the policy.
      usd_per_device_hour: the price of one device, $/hour: a number, or ``f(device id)``.
      window: waves a measurement spans.
      warmup: waves after a change before a measurement starts (a joiner compiles and pulls).
      timeout: seconds a measurement may wait.

    Attributes:
      decisions: every decision taken, in order.
      added: ``(vw, devices, the window before it)`` of the last VW added and not yet reviewed.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        policy: ScalingPolicy,
        usd_per_device_hour: float | Callable[[int], float],
        *,
        window: int = 12,
        warmup: int = 3,
        timeout: float = 300.0,
    ):
        self.coordinator, self.policy = coordinator, policy
        self.price = (
            usd_per_device_hour
            if callable(usd_per_device_hour)
            else lambda device: float(usd_per_device_hour)
        )
        self.window, self.warmup, self.timeout = window, warmup, timeout
        self.decisions: list[ScalingDecision] = []
        self.added: tuple[str, tuple[int, ...], Measured] | None = None

    def measure(self) -> Measured:
        """The job over its next window: after ``warmup`` more waves, ``window`` waves (fewer
        when the run ends first).

        Raises:
          WSPError: the waves did not come within ``timeout`` (``"busy"``).
        """
        before = self._waves(self.warmup)
        tic = time.time()
        after = self._waves(self.window)
        toc = time.time()
        members = dict(self.coordinator.members)
        # the waves committed in the window, each VW's: a wave's record is added after its
        # commit (once its push is applied), so records are matched by wave, not by time
        window = {
            vw: range(
                after.starts.get(vw, 0) + before.committed.get(vw, 0),
                after.starts.get(vw, 0) + after.committed.get(vw, 0),
            )
            for vw in members
        }
        deadline = time.monotonic() + min(self.timeout, RECORDS_SECONDS)  # a killed VW's never come
        while True:
            records = [r for r in self.coordinator.records() if r.wave in window.get(r.vw, ())]
            if len(records) >= sum(map(len, window.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.01)  # the records of committed waves: their pushes being applied
        samples = dict.fromkeys(members, 0)
        for record in records:
            samples[record.vw] += len(record.samples)
        waves = sum(map(len, window.values()))
        return Measured(
            seconds=toc - tic,
            samples=samples,
            devices={vw: len(m.devices) for vw, m in members.items()},
            usd_per_hour={vw: sum(self.price(d) for d in m.devices) for vw, m in members.items()},
            ended=after.done and waves < self.window,
        )

    def _waves(self, count: int) -> Ledger:
        """Wait for ``count`` more waves to be committed (or the run to end); the ledger then."""
        ps, deadline = self.coordinator.ps, time.monotonic() + self.timeout
        ledger = ps.ledger()
        target = sum(ledger.committed.values()) + count
        while sum(ledger.committed.values()) < target and not ledger.done:  # done: no more
            if time.monotonic() > deadline:
                raise WSPError(
                    f"{count} waves were not committed within {self.timeout:.0f} s", "busy"
                )
            ledger = ps.wait(1.0)
        return ledger

    def offer(self, devices: Sequence[int]) -> ScalingDecision:
        """An offer of devices for one more VW: measured now, then added or declined (declined
        when the run ended before it could be measured).

        Args:
          devices: the device ids offered.

        Returns:
          The decision (added: ``coordinator.members`` holds the new VW).
        """
        now = self.measure()
        if now.ended:  # nothing to weigh, and no run left to add to
            ended = {"action": Action.DECLINE, "vw": None, "reason": ENDED}
            return self._log(
                ScalingDecision(devices=tuple(devices), numbers=now.numbers(), **ended)
            )
        decision = self.policy.offer(now, devices, sum(self.price(d) for d in devices))
        if decision.action == Action.ADD:
            (vw,) = self.coordinator.add(devices)
            decision = dataclasses.replace(decision, vw=vw)
            self.added = (vw, tuple(devices), now)
        return self._log(decision)

    def review(self) -> ScalingDecision | None:
        """Measure the job with the VW last added and keep or remove it (None: nothing to
        review); kept when the run ended before it could be measured."""
        if self.added is None:
            return None
        vw, devices, before = self.added
        self.added = None
        after = self.measure()
        if after.ended:  # not removed on a window the run's end cut short
            numbers = {**before.numbers(), **after.numbers("_with")}
            kept = {"action": Action.KEEP, "vw": vw, "reason": ENDED, "numbers": numbers}
            return self._log(ScalingDecision(devices=tuple(devices), **kept))
        decision = self.policy.review(before, after, vw, devices)
        if decision.action == Action.REMOVE:
            self.coordinator.remove(vw)
        return self._log(decision)

    def grow(self, manager: ClusterManager, group: int) -> list[ScalingDecision]:
        """Ask ``manager`` for ``group`` devices at a time while the policy says one more VW
        pays (:meth:`ScalingPolicy.ask`): each ask is measured first, each VW added on the
        devices granted is reviewed, and the samples/s it brought per device is what the next
        ask estimates with. Stops at a ``HOLD`` (it would not pay, or over the budget), when
        the manager has fewer devices (``HOLD``, the partial grant released), when a review
        removes the VW (its devices released), or when the run ends.

        Args:
          manager: the :class:`ClusterManager` (``LocalPool``, a cluster's).
          group: devices per VW.

        Returns:
          The decisions of this growth, in order (also in :attr:`decisions` and the
          coordinator's events).
        """
        first, per_device = len(self.decisions), None
        while True:
            now = self.measure()
            quote = manager.quote(group)
            if now.ended or quote is None:
                why = ENDED if now.ended else f"the cluster has fewer than {group} devices free"
                hold = {"action": Action.HOLD, "vw": None, "devices": (), "reason": why}
                self._log(ScalingDecision(numbers=now.numbers(), **hold))
                break
            asked = self._log(self.policy.ask(now, group, quote, per_device))
            if asked.action == Action.HOLD:
                break
            granted = manager.request(group)
            if len(granted) < group:  # taken meanwhile: the part granted goes back
                manager.release(granted)
                why = f"the cluster granted {len(granted)} of {group} devices"
                hold = {"action": Action.HOLD, "vw": None, "devices": granted, "reason": why}
                self._log(ScalingDecision(numbers=now.numbers(), **hold))
                break
            (vw,) = self.coordinator.add(granted)
            self._log(dataclasses.replace(asked, action=Action.ADD, vw=vw, devices=granted))
            self.added = (vw, granted, now)
            review = self.review()
            if review.action == Action.REMOVE:
                manager.release(granted)
                break
            if review.reason == ENDED:
                break
            n = review.numbers
            per_device = max(n["samples_per_second_with"] - n["samples_per_second"], 0.0) / group
        return self.decisions[first:]

    def shrink(self, why: str) -> ScalingDecision:
        """Remove the VW training the fewest samples per dollar (a preemption of any devices, a
        budget cut).

        Args:
          why: what asks for it (in the decision's reason).
        """
        devices = {vw: m.devices for vw, m in self.coordinator.members.items()}
        decision = self.policy.shrink(self.measure(), devices, why)
        self.coordinator.remove(decision.vw)
        return self._log(decision)

    def _log(self, decision: ScalingDecision) -> ScalingDecision:
        self.decisions.append(decision)
        self.coordinator.add_event(VWEventKind.DECIDE, decision.vw, decision.devices, decision)
        return decision
