"""HetPipe's tick tables (``tenplex_jax._src.wsp.pipeline``): the wave program's fill and drain
against the unbroken pipeline, the staleness both keep, the blocked minibatch. No JAX: a plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp.pipeline import schedule

WAVES = 8


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("nm", [1, 2, 3, 4, 8])
def test_the_wave_program_fills_and_drains_every_wave(stages, nm):
    table = schedule(stages, nm, [0] * WAVES, unbroken=False)
    assert table.idle_ticks() == ((2 * (stages - 1),) * stages,) * WAVES
    assert table.ticks == WAVES * 2 * (nm + stages - 1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("nm", [1, 2, 3, 4, 8])
def test_the_unbroken_pipeline_idles_only_where_nm_cannot_cover_a_round_trip(stages, nm):
    # a minibatch's forward and backward take 2 * stages ticks on the first stage and the next
    # nm minibatches may enter only after it: below nm = stages the stages wait for the landing
    table = schedule(stages, nm, [0] * WAVES, unbroken=True)
    steady = table.idle_ticks()[2:-1]  # the first wave fills, the last drains
    assert steady == ((2 * max(stages - nm, 0),) * stages,) * len(steady)
    fill = table.idle_ticks()[0]
    assert sum(fill) <= stages * 2 * (stages - 1)
    wave_ticks = (table.entered(5 * nm) - table.entered(3 * nm)) / 2
    assert wave_ticks == 2 * max(nm, stages)  # against 2 (nm + stages - 1) per wave program


@pytest.mark.parametrize("unbroken", [False, True])
@pytest.mark.parametrize("nm", [1, 2, 4])
def test_every_minibatch_reads_the_weights_holding_its_updates_up_to_p_minus_nm(unbroken, nm):
    table = schedule(2, nm, [0, 3, 0, 5], unbroken=unbroken)
    for p in range(nm, 4 * nm):  # p - nm landed before p entered
        assert table.landed(p - nm) < table.entered(p), p
    # the updates land in order (at once at a wave program's end): the weights stashed when
    # p - nm landed hold exactly p - nm + 1 own updates, missing the nm - 1 after it
    landings = [table.landed(p) for p in range(4 * nm)]
    assert landings == sorted(landings)
    assert len(set(landings)) == (4 * nm if unbroken else 4)


def test_only_the_blocked_minibatch_waits_and_those_in_flight_go_on():
    free = schedule(2, 4, [0] * 6, unbroken=True)
    blocked = schedule(2, 4, [0, 0, 6, 0, 0, 0], unbroken=True)
    last = 2 * 4 + 3  # wave 2's last minibatch: it reads the pulled weights
    for p in range(last):  # everything before it runs as without the block
        assert blocked.forward[p] == free.forward[p] and blocked.backward[p] == free.backward[p]
    assert blocked.entered(last) == blocked.landed(last - 4) + 1 + 6
    # the wave program waits its whole wave: every stage idles the wait on top of its drain
    program = schedule(2, 4, [0, 0, 6, 0, 0, 0], unbroken=False).idle_ticks()
    assert program[1] == (2 + 6, 2 + 6)
    assert sum(map(sum, blocked.idle_ticks())) < sum(map(sum, program))


def test_a_table_that_breaks_a_rule_is_refused():
    table = schedule(2, 2, [0, 0], unbroken=True)
    table.check()
    # read as Nm = 1, minibatch 1 enters before the update it must hold has landed
    with pytest.raises(WSPError, match="minibatch 1 enters at tick 1, before minibatch 0 landed"):
        dataclasses.replace(table, nm=1).check()
    twice = list(table.backward)
    twice[1] = (table.forward[0][0], twice[1][1])
    with pytest.raises(WSPError, match="stage 0 runs two slots at one tick"):
        dataclasses.replace(table, backward=tuple(twice)).check()


@pytest.mark.parametrize(
    "args, rule",
    [
        ((0, 2, [0]), "stages >= 1, got 0"),
        ((2, 0, [0]), "nm >= 1, got 0"),
        ((2, 2, []), "waves >= 1, got 0"),
        ((2, 2, [0, -1]), r"waits of ints >= 0, got \(0, -1\)"),
        ((True, 2, [0]), "stages >= 1, got True"),
    ],
)
def test_bad_arguments_name_the_rule_and_the_value(args, rule):
    with pytest.raises(WSPError, match=rule):
        schedule(*args, unbroken=True)


@pytest.mark.parametrize("unbroken", [False, True])
def test_the_arrays_an_executor_indexes_hold_every_slot_and_landing_once(unbroken):
    table = schedule(3, 2, [0, 4, 0], unbroken=unbroken)
    forward, backward, landing = table.arrays()
    assert forward.shape == backward.shape == (table.ticks, 3)
    for p in range(6):
        for s in range(3):
            assert list(np.flatnonzero(forward[:, s] == p)) == [table.forward[p][s]]
            assert list(np.flatnonzero(backward[:, s] == p)) == [table.backward[p][s]]
        assert list(np.nonzero(landing == p)[0]) == [table.landed(p)]
    landed = landing[landing >= 0]
    assert list(landed) == list(range(6))  # each once, in order
    assert landing.shape[1] == (2 if not unbroken else 1)  # a wave program lands its wave at once
