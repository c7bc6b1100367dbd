"""Hydrozoa's scaling policy: its decisions on measured windows (pure), and a Scaler growing,
reviewing and shrinking a live job of virtual workers on a parameter server on 127.0.0.1."""

from __future__ import annotations

import jax
import pytest

from tenplex_jax._src.wsp.manager import LocalPool
from tenplex_jax._src.wsp.scaler import ENDED
from tenplex_jax.elastic import ResourceTrace
from tenplex_jax.errors import WSPError
from tenplex_jax.wsp import (
    Coordinator,
    Measured,
    ParameterServer,
    Scaler,
    ScalingPolicy,
    Threads,
    VWEventKind,
    weights_of,
)
from tenplex_jax_models import wsp as job_parts
from tests.helpers import Stores

TOTAL = 120  # minibatches of the live run: it outlasts a joining VW's build, under load too


def _job(**rates) -> Measured:
    """Ten seconds of VWs of 2 devices at $1/device-hour, each at its samples/s."""
    return Measured(
        seconds=10.0,
        samples={vw: int(10 * r) for vw, r in rates.items()},
        devices=dict.fromkeys(rates, 2),
        usd_per_hour=dict.fromkeys(rates, 2.0),
    )


def test_an_offer_is_taken_when_the_throughput_per_dollar_holds_with_it():
    now = _job(vw1=40.0, vw2=40.0)  # 80 samples/s for $4/h: 72,000 samples/$
    taken = ScalingPolicy(tolerance=0.9).offer(now, (4, 5), 2.0)
    assert taken.action == "add" and taken.devices == (4, 5)
    assert taken.numbers["samples_per_usd"] == pytest.approx(72_000)
    assert taken.numbers["estimated_samples_per_second_with"] == pytest.approx(120.0)
    assert taken.numbers["estimated_samples_per_usd_with"] == pytest.approx(72_000)
    # devices at 4x the price: 120 samples/s for $12/h is 36,000 samples/$, half of today's
    dear = ScalingPolicy(tolerance=0.9).offer(now, (4, 5), 8.0)
    assert dear.action == "decline" and "does not pay" in dear.reason
    assert ScalingPolicy(tolerance=0.5).offer(now, (4, 5), 8.0).action == "add"
    # a throughput floor takes it anyway, a budget declines it whatever it pays
    assert ScalingPolicy(floor=100.0).offer(now, (4, 5), 8.0).action == "add"
    over = ScalingPolicy(floor=100.0, budget=10.0).offer(now, (4, 5), 8.0)
    assert over.action == "decline" and "budget" in over.reason
    assert over.numbers["usd_per_hour_with"] == 12.0


def test_a_vw_added_is_kept_only_if_the_measured_numbers_agree():
    before = _job(vw1=40.0, vw2=40.0)
    pays = _job(vw1=38.0, vw2=38.0, vw3=38.0)  # 114 for $6/h: 68,400 >= 0.9 x 72,000
    kept = ScalingPolicy().review(before, pays, "vw3", (4, 5))
    assert kept.action == "keep" and kept.numbers["vw_samples_per_second"] == pytest.approx(38.0)
    crowded = _job(vw1=30.0, vw2=30.0, vw3=20.0)  # 80 for $6/h: 48,000
    removed = ScalingPolicy().review(before, crowded, "vw3", (4, 5))
    assert removed.action == "remove" and removed.vw == "vw3"
    assert removed.numbers["samples_per_usd_with"] == pytest.approx(48_000)
    # below a floor, what raises the throughput stays
    assert ScalingPolicy(floor=200.0).review(before, crowded, "vw3", (4, 5)).action == "remove"
    assert ScalingPolicy(floor=200.0).review(before, pays, "vw3", (4, 5)).action == "keep"


def test_a_shrink_removes_the_vw_training_the_fewest_samples_per_dollar():
    now = _job(vw1=40.0, vw2=25.0, vw3=40.0)
    devices = {"vw1": (0, 1), "vw2": (2, 3), "vw3": (4, 5)}
    decision = ScalingPolicy().shrink(now, devices, "a budget cut")
    assert (decision.action, decision.vw, decision.devices) == ("remove", "vw2", (2, 3))
    assert decision.numbers["samples_per_usd_vw2"] == pytest.approx(45_000)
    with pytest.raises(WSPError, match="no virtual worker"):
        ScalingPolicy().shrink(now, {}, "a preemption")
    with pytest.raises(WSPError, match="tolerance"):
        ScalingPolicy(tolerance=1.5)


def test_the_policy_asks_for_devices_while_the_measured_growth_holds_the_samples_per_dollar():
    now = _job(vw1=40.0, vw2=40.0)  # 80 samples/s on 4 devices for $4/h
    asked = ScalingPolicy(tolerance=0.9).ask(now, 2, 2.0)  # the average: 20 samples/s a device
    assert asked.action == "ask" and asked.devices == ()
    assert asked.numbers["estimated_samples_per_second_with"] == pytest.approx(120.0)
    assert asked.reason.startswith("2 more devices: it pays")
    # the last growth brought 5 samples/s a device: 90 for $6/h is 54,000 < 0.9 x 72,000
    poor = ScalingPolicy(tolerance=0.9).ask(now, 2, 2.0, per_device=5.0)
    assert poor.action == "hold" and "does not pay" in poor.reason
    assert poor.numbers["estimated_samples_per_usd_with"] == pytest.approx(54_000)
    assert ScalingPolicy(tolerance=0.7).ask(now, 2, 2.0, per_device=5.0).action == "ask"
    assert ScalingPolicy(budget=5.0).ask(now, 2, 2.0).action == "hold"  # $6/h over the budget
    assert ScalingPolicy(floor=200.0).ask(now, 2, 20.0, per_device=1.0).action == "ask"
    with pytest.raises(WSPError, match="count >= 1 devices"):
        ScalingPolicy().ask(now, 0, 2.0)


def test_a_local_pool_grants_quotes_and_takes_back_devices():
    pool = LocalPool([4, 5, 6], usd_per_device_hour=lambda d: float(d))
    assert pool.quote(2) == 9.0 and pool.quote(4) is None
    assert pool.request(2) == (4, 5) and pool.request(2) == (6,) and pool.free == []
    pool.release([5])
    assert pool.free == [5] and pool.granted == [(2, (4, 5)), (2, (6,))]
    with pytest.raises(WSPError, match=r"devices \[5\] were not granted"):
        pool.release([5])
    with pytest.raises(WSPError, match="each device once"):
        LocalPool([1, 1])


def test_a_scaler_grows_a_live_job_by_asking_a_pool_while_it_pays(tmp_path):
    started = Stores(tmp_path)
    try:
        addresses = [started.start(f"s{i}").address for i in range(2)]
        parts = job_parts.job(1)
        state = parts["init"]()
        steps = job_parts.step_cache(parts, jax.devices())

        def make(name, devices):  # each VW on the device granted to it
            return job_parts.virtual_worker(
                parts,
                name,
                devices,
                addresses,
                state,
                distance=1,
                timeout=3.0,
                steps=steps,
                slowdown=3.0,  # a slower device's pace: VWs added add throughput under load
            )

        pool = LocalPool([1, 2, 3], usd_per_device_hour=1.0)
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=TOTAL)
            with Coordinator(ps, Threads(make)) as coordinator:
                coordinator.add([0])
                policy = ScalingPolicy(tolerance=0.05, budget=3.5)  # at most 3 devices
                scaler = Scaler(coordinator, policy, usd_per_device_hour=1.0, window=4, warmup=1)
                grown = scaler.grow(pool, group=1)
                coordinator.wait(timeout=240)
            assert not coordinator.runner.errors
            ledger = ps.history()
        assert ledger.done and sorted(ledger.trained()) == list(range(TOTAL))
        actions = [(d.action, d.devices) for d in grown]
        added = [devices for action, devices in actions if action == "add"]
        assert [ids for _, ids in pool.granted] == added  # granted only what it added
        for i, (action, _) in enumerate(actions):  # ask, add, review; again; until a stop
            assert action == ("ask", "add", "keep")[i % 3] or i == len(actions) - 1
        last = grown[-1]
        kept = [d for d in grown if d.action == "keep"]
        if last.action == "hold" and last.reason != ENDED:  # every VW paid: the budget stops it
            assert added == [(1,), (2,)] and "over the budget" in last.reason
            assert pool.free == [3] and len(kept) == 2
            rate = kept[0].numbers
            per_device = rate["samples_per_second_with"] - rate["samples_per_second"]
            assert grown[3].numbers["samples_per_second_per_device_added"] == pytest.approx(
                max(per_device, 0.0)
            )  # the second ask estimated with what the first VW brought
        elif last.action == "remove":  # measured, it did not pay: its device went back
            assert last.devices[0] in pool.free
        members = [e.vw for e in coordinator.events if e.kind == VWEventKind.ADD]
        assert members == ["vw1"] + [d.vw for d in grown if d.action == "add"]
    finally:
        started.reap()


def test_a_scaler_follows_a_trace_growing_reviewing_and_shrinking_a_live_job(tmp_path):
    started = Stores(tmp_path)
    try:
        addresses = [started.start(f"s{i}").address for i in range(2)]
        parts = job_parts.job(1)
        state = parts["init"]()
        steps = job_parts.step_cache(parts, jax.devices())

        def make(name, devices):  # on device 0 whatever it is offered: one compiled step
            return job_parts.virtual_worker(
                parts,
                name,
                [0],
                addresses,
                state,
                distance=1,
                timeout=3.0,
                steps=steps,
                # a wave sleeps twice its compute (a device 3x slower, every VW alike): the
                # trace's events land mid-run even when a VW's build holds the scaler for
                # seconds (at full speed the run could end first, its last measurements empty)
                slowdown=3.0,
            )

        trace = ResourceTrace.from_dict(
            {
                "devices": 4,
                "steps": TOTAL,
                "events": [
                    {"step": 4, "kind": "offer", "devices": [1]},  # the same price: it pays
                    {"step": 30, "kind": "offer", "devices": [2]},  # over the $2.50 budget
                    {"step": 50, "kind": "preempt", "count": 1},  # any device: the least efficient
                ],
            }
        )
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=TOTAL)
            with Coordinator(ps, Threads(make)) as coordinator:
                coordinator.add([0])
                policy = ScalingPolicy(tolerance=0.05, budget=2.5)
                scaler = Scaler(coordinator, policy, usd_per_device_hour=1.0, window=4, warmup=1)
                coordinator.follow(trace, group=1, timeout=240, scaler=scaler)
                coordinator.wait(timeout=120)
                followed = len(scaler.decisions)
                # the run is over: an offer is declined and a VW under review kept, saying why,
                # never decided on the empty window's 0 samples/s
                late = scaler.offer([3])
                scaler.added = ("vw1", (0,), scaler.measure())
                kept = scaler.review()
            assert not coordinator.runner.errors
            assert (late.action, late.vw, late.devices, late.reason) == (
                "decline",
                None,
                (3,),
                ENDED,
            )
            assert (kept.action, kept.vw, kept.reason) == ("keep", "vw1", ENDED)
            assert [d.action for d in scaler.decisions[followed:]] == ["decline", "keep"]
            del scaler.decisions[followed:]
            ledger = ps.history()
        actions = [(d.action, d.vw, d.devices) for d in scaler.decisions]
        assert actions[0] == ("add", "vw2", (1,))
        review = actions[1]
        assert review[:2] in (("keep", "vw2"), ("remove", "vw2"))
        assert actions[2] == ("decline", None, (2,))
        if review[0] == "keep":  # the preemption took the VW training the fewest samples per $
            assert actions[3][0] == "remove" and len(actions) == 4
            assert ledger.done and sorted(ledger.trained()) == list(range(TOTAL))
        added = [e.vw for e in coordinator.events if e.kind == VWEventKind.ADD]
        assert added == ["vw1", "vw2"]  # the declined offer started nothing
        decided = [e.decision for e in coordinator.events if e.kind == VWEventKind.DECIDE]
        assert decided == scaler.decisions + [late, kept]  # and the two after the run
        for decision in decided[: len(actions)]:  # each logged with the numbers it was based on
            assert decision.reason and decision.numbers["samples_per_second"] > 0
            assert decision.numbers["usd_per_hour"] >= 1.0
            assert decision.numbers["samples_per_usd"] > 0
    finally:
        started.reap()
