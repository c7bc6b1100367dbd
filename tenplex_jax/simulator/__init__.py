"""The reconfiguration simulator: a resource trace replayed on a described cluster of thousands of
devices, with no devices (``tenplex-jax simulate`` is its command line)::

    sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=1024)
    result = tj.simulator.simulate(sim, tj.elastic.ResourceTrace.load("meshes/philly-538.toml"))
    result["policies"]["tenplex"]["goodput"]

A ``Network`` turns a plan's bytes into seconds on links, NICs, host copies and storage; three
policies (``POLICIES``) are compared: tenplex's transformation from the tensor stores, the same
through one node, and checkpoint-restart, with the costs the network does not derive in ``Costs``.
``fixed_change`` prices one given change (no planner), ``failure_trace`` draws node failures from a
mean time to failure (``merge`` lays them beside another trace), ``young_daly`` is the checkpoint
interval every policy uses when a failure rate is known.
"""

from tenplex_jax._src.simulator.costs import POLICIES, Costs, young_daly
from tenplex_jax._src.simulator.failures import failure_trace, merge
from tenplex_jax._src.simulator.fixed import fixed_change
from tenplex_jax._src.simulator.network import Estimate, Network, Traffic, device_traffic
from tenplex_jax._src.simulator.replay import Layout, Simulation, scale, simulate

__all__ = [
    "POLICIES",
    "Costs",
    "Estimate",
    "Layout",
    "Network",
    "Simulation",
    "Traffic",
    "device_traffic",
    "failure_trace",
    "fixed_change",
    "merge",
    "scale",
    "simulate",
    "young_daly",
]
