"""Hydrozoa's scaling policy: take an offer of devices when the job's throughput per dollar with
one more virtual worker (VW) holds, keep it only if the measured numbers agree, and shrink by
removing the least efficient VW.

Throughput per dollar is samples per US dollar: the job's samples/s times 3,600 over the price of
the devices its VWs hold, $/hour. The policy is pure: it decides on :class:`Measured` windows
(samples each VW trained over some seconds, the price of its devices) and says why, with every
number it used, in a :class:`ScalingDecision`. A ``Scaler`` (``scaler.py``) runs it on a live
job.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

from tenplex_jax._src.errors import WSPError

SECONDS_PER_HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a job's VWs did over a window.

    Attributes:
      seconds: the window's length.
      samples: VW name -> the samples it trained (waves ended) in the window.
      devices: VW name -> how many devices it holds.
      usd_per_hour: VW name -> the price of its devices, $/hour.
      ended: the run ended before the window filled: its numbers are what there was.
    """

    seconds: float
    samples: Mapping[str, int]
    devices: Mapping[str, int]
    usd_per_hour: Mapping[str, float]
    ended: bool = False

    @property
    def throughput(self) -> float:
        """The job's samples/s."""
        return sum(self.samples.values()) / self.seconds if self.seconds > 0 else 0.0

    @property
    def price(self) -> float:
        """The job's devices' price, $/hour."""
        return sum(self.usd_per_hour.values())

    @property
    def per_dollar(self) -> float:
        """Samples per dollar (infinite when the devices are free)."""
        return _per_dollar(self.throughput, self.price)

    def rate(self, vw: str) -> float:
        """The samples/s of VW ``vw`` (0 when it trained none in the window)."""
        return self.samples.get(vw, 0) / self.seconds if self.seconds > 0 else 0.0

    def numbers(self, suffix: str = "") -> dict[str, float]:
        """The job's throughput, price and samples per dollar, keyed with ``suffix``."""
        return {
            f"samples_per_second{suffix}": self.throughput,
            f"usd_per_hour{suffix}": self.price,
            f"samples_per_usd{suffix}": self.per_dollar,
        }


def _per_dollar(throughput: float, price: float) -> float:
    return throughput * SECONDS_PER_HOUR / price if price > 0 else math.inf


class Action(enum.StrEnum):
    """What the policy decided (:class:`ScalingDecision`)."""

    ADD = "add"  # an offer taken: a VW added on its devices
    DECLINE = "decline"  # an offer declined
    KEEP = "keep"  # a VW added kept, after its review
    REMOVE = "remove"  # a VW removed (a review, or a shrink)
    ASK = "ask"  # ask the cluster manager for more devices
    HOLD = "hold"  # ask for none: more would not pay (or the cluster has none)


@dataclasses.dataclass(frozen=True)
class ScalingDecision:
    """A decision of the policy.

    Attributes:
      action: ``ADD`` or ``DECLINE`` (an offer), ``KEEP`` or ``REMOVE`` (a review of a VW added,
        or a shrink), ``ASK`` or ``HOLD`` (whether to ask the cluster for devices).
      vw: the VW removed or kept (None for an offer's decision).
      devices: the devices offered, or those of the VW.
      reason: why, in words.
      numbers: every number it was based on (throughput, price, samples per dollar, now and
        estimated or measured with the change).
    """

    action: Action
    vw: str | None
    devices: tuple[int, ...]
    reason: str
    numbers: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class ScalingPolicy:
    """Hydrozoa's rule for growing and shrinking a job of VWs.

    >>> now = Measured(seconds=10.0, samples={"vw1": 400}, devices={"vw1": 2},
    ...                usd_per_hour={"vw1": 2.0})
    >>> print(ScalingPolicy().offer(now, (2, 3), 2.0).action)
    add
    >>> print(ScalingPolicy(budget=3.0).offer(now, (2, 3), 2.0).action)
    decline

    Args:
      tolerance: take an offer when the estimated samples per dollar with it is at least this
        fraction of today's, and keep what was taken when the measured one is (``1``: only what
        pays; below: some efficiency for speed).
      floor: a throughput (samples/s) the user wants: below it, offers are taken (within the
        budget) whatever they cost per sample, and kept while they raise the throughput.
      budget: the most the job may spend, $/hour: an offer over it is declined.

    Raises:
      WSPError: a tolerance outside (0, 1], a negative floor or a budget <= 0 (``"invalid"``).
    """

    tolerance: float = 0.9
    floor: float | None = None
    budget: float | None = None

    def __post_init__(self):
        if not 0 < self.tolerance <= 1 or (self.floor or 0) < 0 or (self.budget or 1) <= 0:
            raise WSPError(
                f"a scaling policy needs 0 < tolerance <= 1, floor >= 0 and budget > 0; got "
                f"{self.tolerance}, {self.floor}, {self.budget}",
                "invalid",
            )

    def offer(self, now: Measured, devices: Sequence[int], usd_per_hour: float) -> ScalingDecision:
        """Take or decline an offer of devices for one more VW.

        Its throughput is estimated from the running VWs' samples/s per device (the same kind
        of device: a cluster of one type, or the caller's prices per type).

        Args:
          now: the job measured over its last window.
          devices: the devices offered.
          usd_per_hour: their price, $/hour.

        Returns:
          ``ADD`` or ``DECLINE``, with the numbers.
        """
        devices = tuple(devices)
        take, reason, numbers = self._weigh(now, len(devices), usd_per_hour, None)
        return ScalingDecision(
            action=Action.ADD if take else Action.DECLINE,
            vw=None,
            devices=devices,
            reason=reason,
            numbers=numbers,
        )

    def ask(
        self, now: Measured, count: int, usd_per_hour: float, per_device: float | None = None
    ) -> ScalingDecision:
        """Whether to ask the cluster manager for ``count`` more devices (one VW's), quoted at
        ``usd_per_hour``: the same rule as an offer's, on the samples/s ``per_device`` measured
        when the job last grew (the throughput a VW added brought, over its devices), or the
        running VWs' average before it ever grew. So it keeps asking while the measured growth
        holds the samples per dollar, and stops when the last devices added brought less.

        >>> now = Measured(seconds=10.0, samples={"vw1": 400}, devices={"vw1": 2},
        ...                usd_per_hour={"vw1": 2.0})
        >>> print(ScalingPolicy().ask(now, 2, 2.0).action)
        ask
        >>> print(ScalingPolicy().ask(now, 2, 2.0, per_device=5.0).action)   # growth measured poor
        hold

        Returns:
          ``ASK`` or ``HOLD``, with the numbers (``devices``: empty, none granted yet).
        """
        if count < 1 or usd_per_hour < 0 or (per_device is not None and per_device < 0):
            raise WSPError(
                f"an ask is for count >= 1 devices at a price and rate >= 0; got {count}, "
                f"${usd_per_hour}/h, {per_device} samples/s per device",
                "invalid",
            )
        take, reason, numbers = self._weigh(now, count, usd_per_hour, per_device)
        return ScalingDecision(
            action=Action.ASK if take else Action.HOLD,
            vw=None,
            devices=(),
            reason=f"{count} more devices: {reason}",
            numbers=numbers,
        )

    def _weigh(self, now: Measured, count: int, usd_per_hour: float, per_device):
        """``(take, reason, numbers)`` for ``count`` devices more at ``usd_per_hour``, each
        bringing ``per_device`` samples/s (None: the running VWs' average)."""
        held = sum(now.devices.values())
        if per_device is None:
            per_device = now.throughput / held if held else 0.0
        estimate = per_device * count
        price = now.price + usd_per_hour
        numbers = {
            **now.numbers(),
            "samples_per_second_per_device_added": per_device,
            "estimated_samples_per_second_with": now.throughput + estimate,
            "usd_per_hour_with": price,
            "estimated_samples_per_usd_with": _per_dollar(now.throughput + estimate, price),
        }
        if self.budget is not None and price > self.budget:
            return False, f"over the budget: ${price:.2f}/h with it > ${self.budget:.2f}/h", numbers
        if self.floor is not None and now.throughput < self.floor:
            below = f"below the floor: {now.throughput:.1f} < {self.floor:.1f} samples/s"
            return True, below, numbers
        with_ = numbers["estimated_samples_per_usd_with"]
        than = f"{self.tolerance:g} x {now.per_dollar:.0f}"
        if with_ >= self.tolerance * now.per_dollar:
            return True, f"it pays: {with_:.0f} samples/$ with it >= {than}", numbers
        return False, f"it does not pay: {with_:.0f} samples/$ with it < {than}", numbers

    def review(self, before: Measured, after: Measured, vw: str, devices: Sequence[int]):
        """Keep or remove a VW added, on the job measured before and after it.

        Args:
          before: the job's window before the VW was added.
          after: a window after it joined.
          vw: the VW added.
          devices: its devices.

        Returns:
          ``KEEP`` or ``REMOVE``, with the numbers.
        """
        numbers = {
            **before.numbers(),
            **after.numbers("_with"),
            "vw_samples_per_second": after.rate(vw),
        }
        decide = lambda action, reason: ScalingDecision(
            action=action, vw=vw, devices=tuple(devices), reason=reason, numbers=numbers
        )
        if self.floor is not None and before.throughput < self.floor:
            if after.throughput > before.throughput:
                return decide(Action.KEEP, "it raises the throughput toward the floor")
            return decide(Action.REMOVE, "it does not raise the throughput")
        measured = f"{after.per_dollar:.0f} samples/$ measured"
        than = f"{self.tolerance:g} x {before.per_dollar:.0f}"
        if after.per_dollar >= self.tolerance * before.per_dollar:
            return decide(Action.KEEP, f"it pays: {measured} >= {than}")
        return decide(Action.REMOVE, f"it does not pay: {measured} < {than}")

    def shrink(
        self, now: Measured, devices: Mapping[str, Sequence[int]], why: str
    ) -> ScalingDecision:
        """The VW to remove (a preemption without named devices, or a budget cut): the one
        training the fewest samples per dollar.

        Args:
          now: the job measured over its last window.
          devices: VW name -> its devices.
          why: what asks for the removal (for the decision's reason).

        Returns:
          ``REMOVE``, with each VW's samples per dollar among the numbers.

        Raises:
          WSPError: there is no VW (``"invalid"``).
        """
        if not devices:
            raise WSPError(f"{why}: there is no virtual worker to remove", "invalid")
        efficiency = {
            vw: _per_dollar(now.rate(vw), now.usd_per_hour.get(vw, 0.0)) for vw in devices
        }
        worst = min(sorted(efficiency), key=lambda vw: efficiency[vw])
        numbers = {**now.numbers(), **{f"samples_per_usd_{vw}": e for vw, e in efficiency.items()}}
        return ScalingDecision(
            action=Action.REMOVE,
            vw=worst,
            devices=tuple(devices[worst]),
            reason=f"{why}: {worst} trains the fewest samples per dollar ({efficiency[worst]:.0f})",
            numbers=numbers,
        )
