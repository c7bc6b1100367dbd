"""The ledger a parameter server client caches (``last_ledger``, ``update(..., last=True)``),
with its threads racing as a VW's do: the compute thread reading the ledger while the push
thread commits. A read noted after a newer swap never takes the cache back; an answer the
cached ledger gives without a swap (a refusal, nothing to change) is asked of the stored
ledger; and a VW whose push fails raises it instead of waiting for its own commit for ever.

The interleavings are forced with events around real requests to real stores on 127.0.0.1
(the hang they stand for showed once in a full run on a loaded machine)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tenplex_jax.errors import WSPError
from tenplex_jax.wsp import ParameterServer, weights_of
from tenplex_jax_models import build_state
from tenplex_jax_models import wsp as job_parts

JOIN_SECONDS = 60.0  # a forced interleaving's threads end well within this, even under load


def test_a_read_noted_after_a_newer_commit_never_hides_the_clients_own_lease(stores):
    """The compute thread reads the ledger (wave 0 leased, uncommitted) and is held before it
    notes it; meanwhile the push thread commits wave 0 and wave 1 is leased. Noted last, the
    older read must not become the cache the next push commits from: that push's commit would
    find wave 0's lease, be refused, and the VW's last wave would never commit."""
    ps = ParameterServer([stores.start("s0").address])
    ps.create({"w": np.zeros(8, np.float32)}, total=None)
    ps.update(lambda led: (led.join("a"), None))
    ps.update(lambda led: led.claim("a", 0, 1))
    got_reply, release = threading.Event(), threading.Event()
    get_json = ps.coordinator.get_json

    def held(*args, **kwargs):
        reply = get_json(*args, **kwargs)
        if threading.current_thread() is reader:  # replied; noted once released
            got_reply.set()
            assert release.wait(JOIN_SECONDS)
        return reply

    ps.coordinator.get_json = held
    reader = threading.Thread(target=ps.ledger, name="compute", daemon=True)
    reader.start()
    try:
        assert got_reply.wait(JOIN_SECONDS)
        update = {"w": np.full(8, 0.5, np.float32)}
        ps.push("a", 0, update)  # the commit: a newer ledger noted
        ps.update(lambda led: led.claim("a", 1, 1))  # and the lease of wave 1
    finally:
        release.set()
        reader.join(JOIN_SECONDS)
    assert not reader.is_alive()
    ledger = ps.push("a", 1, update)  # from the cache: refused ("holds wave 0") if it went back
    assert ledger.pushed("a", 1) and ps.ledger().clocks["a"] == 2
    assert ps.last_ledger() == ledger  # the newest noted, whatever the order of the notes
    np.testing.assert_array_equal(ps.pull()["w"], np.ones(8, np.float32))
    ps.close()


def _clients(stores, total) -> tuple[ParameterServer, ParameterServer]:
    address = stores.start("s0").address
    first, second = ParameterServer([address]), ParameterServer([address])
    first.create({"w": np.zeros(4, np.float32)}, total=total)
    second.open()
    first.update(lambda led: (led.join("a"), None))
    return first, second


def test_a_change_refused_on_the_cached_ledger_is_asked_of_the_stored_one(stores):
    first, second = _clients(stores, total=None)
    first.ledger()  # cached: "b" has not joined
    second.update(lambda led: (led.join("b"), None))
    with pytest.raises(WSPError, match="never joined"):  # the cache alone would say so
        first.last_ledger().claim("b", 0, 1)
    ledger, minibatches = first.update(lambda led: led.claim("b", 0, 1), last=True)
    assert minibatches == (0,) and ledger.leases["b"].wave == 0
    assert second.ledger() == ledger
    # refused by the stored ledger too: raised (after one read of it)
    with pytest.raises(WSPError, match="'c' never joined") as error:
        first.update(lambda led: led.claim("c", 0, 1), last=True)
    assert error.value.reason == "dropped"
    first.close()
    second.close()


def test_nothing_to_change_on_the_cached_ledger_is_asked_of_the_stored_one(stores):
    """Nothing left to claim in the cache, while the stored ledger holds a minibatch handed
    back: a VW trusting the cache would wait for a commit that never comes."""
    first, second = _clients(stores, total=1)
    second.update(lambda led: (led.join("b"), None))
    assert second.update(lambda led: led.claim("b", 0, 1))[1] == (0,)
    first.ledger()  # cached: the run's one minibatch leased by "b"
    second.update(lambda led: (led.leave("b"), None))  # "b" hands it back
    assert first.last_ledger().claim("a", 0, 1)[1] == ()
    ledger, minibatches = first.update(lambda led: led.claim("a", 0, 1), last=True)
    assert minibatches == (0,) and ledger.leases["a"].minibatches == (0,)
    assert second.ledger() == ledger
    first.close()
    second.close()


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_a_vw_whose_last_push_fails_raises_it_instead_of_waiting_for_its_own_commit(
    stores, prefetch
):
    """The push of the run's last wave fails on its thread: nothing is left to claim, and the
    lease it holds is never committed, so the run is never done. The VW raises the push's
    error (it waited for a ledger change for ever before); its prefetch thread ends with it."""
    parts = job_parts.job(1, lr=3e-3, optimizer="momentum")
    _, state, _ = build_state("tiny", 3e-3, optimizer="momentum")
    address = stores.start("s0").address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=3)
        vw = job_parts.virtual_worker(
            parts,
            "vw",
            [0],
            [address],
            state,
            minibatches=1,
            distance=1,
            timeout=8.0,
            prefetch=prefetch,
        )
        push = vw.ps.push

        def failing(name, wave, updates):
            if wave == 2:
                raise WSPError("injected: the push of the last wave fails", "invalid")
            return push(name, wave, updates)

        vw.ps.push = failing
        raised: list[BaseException] = []

        def run():
            try:
                vw.run()
            except BaseException as error:  # the outcome, checked on the test's thread
                raised.append(error)

        runner = threading.Thread(target=run, name="vw", daemon=True)
        runner.start()
        runner.join(180)  # a compile and three waves; a hang runs past it
        assert not runner.is_alive(), "the VW waited for its own commit after its push failed"
        assert len(raised) == 1 and isinstance(raised[0], WSPError), raised
        assert "injected" in str(raised[0]) and raised[0].reason == "invalid"
        ledger = ps.ledger()
        assert ledger.clocks["vw"] == 2 and ledger.leases["vw"].wave == 2 and not ledger.done
        assert [r.wave for r in vw.records] == [0, 1]
        assert vw.prefetcher is None or not vw.prefetcher._thread.is_alive()
