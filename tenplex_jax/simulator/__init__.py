"""The reconfiguration simulator: a resource trace replayed on a described cluster of thousands of
devices, with no devices.

``network.py`` is the network model (a plan's bytes on links, NICs, host copies and storage, in
seconds); ``replay.py`` replays a trace under three policies (tenplex's distributed state
transformation from the tensor stores, the same through one node, checkpoint-restart) and reports
each event's costs and the goodput of each policy; ``costs.py`` holds what the network model does
not derive (restart and compile seconds, commit and checkpoint intervals)::

    sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=1024)
    result = tj.simulator.simulate(sim, tj.elastic.ResourceTrace.load("meshes/philly-538.toml"))
    result["policies"]["tenplex"]["goodput"]

``tenplex-jax simulate`` is its command line. Names load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "POLICIES": "costs",
    "Costs": "costs",
    "Estimate": "network",
    "Network": "network",
    "Traffic": "network",
    "device_traffic": "network",
    "Layout": "replay",
    "Simulation": "replay",
    "scale": "replay",
    "simulate": "replay",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
