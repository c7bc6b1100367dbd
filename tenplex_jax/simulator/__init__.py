"""The reconfiguration simulator: a resource trace replayed on a described cluster of thousands of
devices, with no devices (``tenplex-jax simulate``; docs/simulator.md)::

    sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=1024)
    result = tj.simulator.simulate(sim, tj.elastic.ResourceTrace.load("meshes/philly-538.toml"))
    result.policies["tenplex"].goodput  # a SimulationResult; result.to_json(): its JSON

``fixed_change`` prices one given change, ``transformation`` the Tenplex artifact's window of one
(after the save, before the restart), ``failure_trace`` draws node failures from a mean time
to failure; a ``Network`` turns a plan's bytes into seconds, ``Costs`` holds the rest.
"""

from tenplex_jax._src.simulator.artifact import Window, transformation
from tenplex_jax._src.simulator.costs import CheckpointInterval, Costs, Policy, young_daly
from tenplex_jax._src.simulator.failures import failure_trace, merge
from tenplex_jax._src.simulator.fixed import fixed_change
from tenplex_jax._src.simulator.network import Estimate, Network, Traffic, device_traffic
from tenplex_jax._src.simulator.replay import Layout, Simulation, scale, simulate
from tenplex_jax._src.simulator.results import (
    ChangeResult,
    EventResult,
    Outcome,
    PolicyCost,
    PolicySummary,
    SimulationResult,
)

__all__ = [
    "ChangeResult",
    "CheckpointInterval",
    "Costs",
    "Estimate",
    "EventResult",
    "Layout",
    "Network",
    "Outcome",
    "Policy",
    "PolicyCost",
    "PolicySummary",
    "Simulation",
    "SimulationResult",
    "Traffic",
    "Window",
    "device_traffic",
    "failure_trace",
    "fixed_change",
    "merge",
    "scale",
    "simulate",
    "transformation",
    "young_daly",
]
