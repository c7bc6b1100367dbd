"""The ledger's rules, exhaustively: exactly-once data over any joins, deaths and leaves, and the
WSP bound over random speeds (pure: no stores, no devices)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex_jax._src.wsp.ledger import Beats, Ledger
from tenplex_jax.errors import WSPError

TIMEOUT = 10.0


class Sim:
    """VWs acting on one ledger as the worker loop does: decide (go / pull / wait), claim, train,
    push; a push commits later, on its own thread (``land``), while the VW decides and claims
    its next wave (its lease ahead); it settles its push before the next push, a pull or
    leaving. They join, die (their heartbeats stop: dropped once a watcher has seen them stopped
    for the timeout; a push in flight dies with them) and leave at random."""

    def __init__(self, total: int, nm: int, distance: int):
        self.ledger, self.now = Ledger(total=total), 0.0
        self.beats, self.watched = {}, Beats()  # each live VW's heartbeat; one watcher's record
        self.nm, self.distance = nm, distance
        self.state: dict[str, dict] = {}  # live VWs: wave, fresh, phase, the weights' tags
        self.tags: set = set()  # every committed (vw, wave): the global weights
        self.count = 0
        self.starts: list[tuple] = []  # (vw, wave, slowest clock) at every wave start

    def join(self):
        self.count += 1
        vw = f"vw{self.count}"
        self.beats[vw] = 0  # a VW beats before it joins
        self.ledger = self.ledger.join(vw)
        # a join pulls: its weights hold every committed wave
        clock = self.ledger.clocks[vw]
        self.state[vw] = {
            "wave": clock,
            "fresh": self.ledger.min_clock,
            "phase": "wait",
            "known": set(self.tags),
            "members": frozenset(self.ledger.clocks),  # the members at its last pull
            "pushing": None,  # the wave whose push is in flight
        }

    def land(self, vw: str):
        """The push in flight commits (its thread's work; the VW settles it)."""
        s = self.state[vw]
        if s["pushing"] is not None:
            self.ledger = self.ledger.commit(vw, s["pushing"])
            self.tags.add((vw, s["pushing"]))
            s["pushing"] = None

    def step(self, vw: str):
        s = self.state[vw]
        self.beats[vw] += 1
        if s["phase"] == "wait":
            decision = self.ledger.decide(vw, s["wave"], s["fresh"], self.distance, s["members"])
            if decision == "wait":
                return
            others = [c for u, c in self.ledger.clocks.items() if u != vw]
            if decision == "pull":  # its push in flight is added where the stores lack it
                s["fresh"], s["known"] = min([*others, s["wave"]]), set(self.tags)
                s["members"] = frozenset(self.ledger.clocks)
                if s["pushing"] is not None:
                    s["known"].add((vw, s["pushing"]))
            # the slowest: the others' commits, and its own waves (a push in flight commits next)
            slowest = min([*others, s["wave"]])
            self.starts.append((vw, s["wave"], slowest, frozenset(s["known"])))
            self.ledger, got = self.ledger.claim(vw, s["wave"], self.nm)
            if got:
                s["phase"] = "train"
            else:  # nothing to claim: finished when the run is, else others may still return some
                self.starts.pop()
                s["phase"] = "done" if self.ledger.done else "wait"
        elif s["phase"] == "train":
            self.land(vw)  # pushes commit in order
            s["pushing"] = s["wave"]
            s["known"].add((vw, s["wave"]))  # its own update is in its weights
            s["wave"] += 1
            s["phase"] = "wait"

    def watch(self):
        self.watched = self.watched.observe(self.ledger.clocks, self.beats, self.now)

    def die(self, vw: str):
        del self.state[vw]  # falls silent; a watcher drops it once silent for the timeout
        self.watch()
        self.now += TIMEOUT / 2
        for other in self.state:
            self.beats[other] += 1
        self.watch()
        assert not self.watched.silent(self.now, TIMEOUT)  # not yet
        self.now += TIMEOUT
        for other in self.state:
            self.beats[other] += 1
        self.watch()
        silent = self.watched.silent(self.now, TIMEOUT)
        assert silent == (vw,)
        self.ledger, dropped = self.ledger.drop(silent)
        assert dropped == (vw,)

    def leave(self, vw: str):
        self.land(vw)
        del self.state[vw]
        self.ledger = self.ledger.leave(vw)


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "step", "step", "land", "join", "die", "leave"]),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(1, 40),
    nm=st.integers(1, 4),
    distance=st.integers(0, 3),
    actions=ACTIONS,
    late=st.booleans(),
)
def test_every_minibatch_is_trained_exactly_once_and_wsp_holds_over_joins_and_deaths(
    total, nm, distance, actions, late
):
    sim = Sim(total, nm, distance)
    sim.join()
    for action, pick in actions:
        sim.now += 0.1
        live = sorted(sim.state)
        if action == "join" and len(live) < 6:
            sim.join()
        elif action in ("die", "leave") and len(live) > 1:
            getattr(sim, action)(live[pick % len(live)])
        elif action == "land" and live:
            sim.land(live[pick % len(live)])
        elif live:
            sim.step(live[pick % len(live)])
    if not sim.state:
        sim.join()
    for round in range(100 * total + 100):  # the survivors finish the run
        if sim.ledger.done:
            break
        for vw in sorted(sim.state):
            sim.step(vw)
            if not late or round % 3 == 2:  # pushes land at once, or a few rounds later
                sim.land(vw)
    for vw in sorted(sim.state):  # the last pushes, settled before leaving
        sim.land(vw)
    assert sim.ledger.done
    trained = sim.ledger.trained()
    assert sorted(trained) == list(range(total))  # each minibatch exactly once
    for vw, wave, slowest, known in sim.starts:
        # WSP: never more than D waves ahead of the slowest member when a wave starts, and the
        # weights hold every wave every VW committed before wave - D
        assert wave - slowest <= distance
        required = {(u, c) for u, c in sim.tags if c < wave - distance}
        committed_then = {(u, c) for u, c in required if (u, c) in known or u == vw}
        assert required <= known | committed_then


def test_a_dropped_vws_lease_goes_back_and_its_late_commit_is_refused():
    led = Ledger(total=10).join("a").join("b")
    led, mine = led.claim("a", 0, 3)
    led, theirs = led.claim("b", 0, 3)
    assert mine == (0, 1, 2) and theirs == (3, 4, 5)
    led, dropped = led.drop(["a", "gone"])  # a name no longer a member is ignored
    assert dropped == ("a",) and led.returned == (0, 1, 2) and led.min_clock == 0
    with pytest.raises(WSPError, match="dropped") as refused:
        led.commit("a", 0)
    assert refused.value.reason == "dropped"
    led = led.commit("b", 0)
    led, again = led.claim("b", 1, 4)
    assert again == (0, 1, 2, 6)  # the returned minibatches first, then the cursor's
    with pytest.raises(WSPError, match="used once"):
        led.join("a")


def test_a_vw_leases_one_wave_ahead_while_its_push_is_in_flight():
    led = Ledger(total=10).join("a").join("b")
    led, first = led.claim("a", 0, 3)
    led, ahead = led.claim("a", 1, 3)  # wave 0's push in flight
    assert (first, ahead) == ((0, 1, 2), (3, 4, 5))
    assert led.claim("a", 1, 3) == (led, ahead)  # a retried claim: the same lease
    with pytest.raises(WSPError, match="no wave before a commit") as refused:
        led.claim("a", 2, 3)  # one ahead at most
    assert refused.value.reason == "refused"
    with pytest.raises(WSPError, match="may claim wave 0, not wave 1"):
        led.claim("b", 1, 3)  # nothing in flight: no lease ahead
    assert Ledger.from_json(led.to_json()) == led
    # the record names every field (it is written out field by field)
    assert list(led.to_json()) == [f.name for f in dataclasses.fields(Ledger)]
    committed = led.commit("a", 0)  # the lease ahead becomes the lease
    assert committed.leases["a"].wave == 1 and not committed.ahead
    assert committed.claim("a", 2, 3)[1] == (6, 7, 8)
    with pytest.raises(WSPError, match="holds wave 0"):
        led.commit("a", 1)  # in order
    dropped, _ = led.drop(["a"])  # both leases go back
    assert dropped.returned == (0, 1, 2, 3, 4, 5) and not dropped.ahead
    left = committed.leave("a")
    assert left.returned == (3, 4, 5) and left.trained() == [0, 1, 2]


def test_a_joiner_starts_at_the_slowest_clock_and_the_record_round_trips():
    led = Ledger(total=None).join("a")
    for wave in range(3):
        led, _ = led.claim("a", wave, 1)
        led = led.commit("a", wave)
    led = led.join("b")
    assert led.clocks == {"a": 3, "b": 3} and led.may_start("b", 3, 0)
    assert not led.may_start("a", 4, 0) and led.may_start("a", 4, 1)
    assert led.decide("a", 4, 3, 0) == "wait" and led.decide("a", 4, 3, 1) == "go"
    assert Ledger.from_json(led.to_json()) == led
    with pytest.raises(WSPError, match="malformed"):
        Ledger.from_json({"total": 3})


def test_a_joiner_below_a_vws_pull_holds_that_vw_back_as_wsp_says():
    # a is the slowest; its push of wave 1 is in flight when it pulls (the pull adds that push):
    # its weights hold every member's first 2 waves. c joins at the ledger's slowest clock, a's
    # committed 1: a's wave 3 must wait for c's wave 1 (D = 1), then pull it
    led = Ledger(total=None).join("a").join("b")
    for wave in range(2):
        led = led.claim("b", wave, 1)[0].commit("b", wave)
        led = led.claim("a", wave, 1)[0]
    led = led.commit("a", 0)
    pulled = {"fresh": min(led.clocks["b"], 2), "members": frozenset(led.clocks)}
    assert led.clocks == {"a": 1, "b": 2} and pulled["fresh"] == 2
    late = led.commit("a", 1).join("c")  # a's push landed before the join: c starts at 2
    assert late.clocks["c"] == 2 and late.decide("a", 3, distance=1, **pulled) == "go"
    early = led.join("c")  # while a's push of wave 1 is in flight: c starts at a's 1
    assert early.clocks == {"a": 1, "b": 2, "c": 1}
    assert early.decide("a", 3, distance=1, **pulled) == "wait"  # c has committed none
    early = early.commit("a", 1).claim("c", 1, 1)[0].commit("c", 1)
    assert early.clocks == {"a": 2, "b": 2, "c": 2}
    assert early.decide("a", 3, distance=1, **pulled) == "pull"  # c's wave 1 is not in a's weights
    assert early.decide("a", 3, pulled["fresh"], 1) == "go"  # what the rule was without members


def test_compaction_moves_all_but_the_newest_entries_and_keeps_the_count():
    led = Ledger(total=None).join("a")
    for wave in range(5):
        led, _ = led.claim("a", wave, 2)
        led = led.commit("a", wave)
    compacted, moved = led.compact(2, "wsp/log/x")
    assert moved == led.log[:3] and compacted.log == led.log[3:]
    assert compacted.archived == 6 and compacted.archive == "wsp/log/x"
    assert compacted.trained_count == led.trained_count == 10
    assert Ledger.from_json(compacted.to_json()) == compacted
    assert compacted.compact(2, "wsp/log/y") == (compacted, ())  # nothing more to move
    assert led.compact(0, "z")[0].log == led.log[-1:]  # the last entry always stays


def test_a_member_is_silent_only_after_its_beat_stood_still_for_the_timeout():
    watched = Beats().observe(["a", "b"], {"a": 0}, now=0.0)  # b has no heartbeat object yet
    watched = watched.observe(["a", "b"], {"a": 1}, now=TIMEOUT)
    assert watched.silent(TIMEOUT, TIMEOUT) == ()
    watched = watched.observe(["a", "b"], {"a": 1, "b": 0}, now=TIMEOUT + 1)  # b beats at last
    assert watched.silent(TIMEOUT + 1.5, TIMEOUT) == ()
    assert watched.silent(2 * TIMEOUT + 0.5, TIMEOUT) == ("a",)
    assert watched.silent(2 * TIMEOUT + 1.5, TIMEOUT) == ("a", "b")
    assert watched.observe(["b"], {"b": 0}, now=50.0).last.keys() == {"b"}  # members only
