"""Parameter-server clients for the push tests: two VWs of one job, and a client whose apply (the
add behind a push's acknowledgement) is held until the test lets it go."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from tenplex_jax.wsp import ParameterServer

BIG = {"w": np.array([2e38] + [0.0] * 7, np.float32)}  # finite alone, Inf twice


def two_vws(stores) -> tuple[ParameterServer, ParameterServer]:
    """Two VWs' clients of one job over 2 stores, each holding the lease of its wave 0."""
    addresses = [stores.start(f"s{i}").address for i in range(2)]
    first, second = ParameterServer(addresses), ParameterServer(addresses)
    first.create({"w": np.zeros(8, np.float32)}, total=None)
    second.open()
    for ps, vw in ((first, "a"), (second, "b")):
        ps.update(lambda led, vw=vw: (led.join(vw), None))
        ps.update(lambda led, vw=vw: led.claim(vw, 0, 1))
    return first, second


@dataclasses.dataclass(frozen=True)
class HeldApply:
    """Events around a held apply: ``started`` once it is called (the wave is committed),
    ``release`` lets it add, ``done`` once it has returned or raised."""

    started: threading.Event
    release: threading.Event
    done: threading.Event


def hold_apply(ps: ParameterServer) -> HeldApply:
    """Make ``ps``'s apply wait for the returned ``release`` (60 s at most) before it adds."""
    held = HeldApply(threading.Event(), threading.Event(), threading.Event())
    apply = ps.apply

    def held_apply(*args, **kwargs):
        held.started.set()
        held.release.wait(60)
        try:
            return apply(*args, **kwargs)
        finally:
            held.done.set()

    ps.apply = held_apply
    return held
