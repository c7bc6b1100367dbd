"""The planner: cluster descriptions, model profiles, the layout search and the config policy.

``Cluster.load("meshes/hetpipe.toml")`` reads device types and nodes; a ``ModelProfile`` holds
per-layer costs; ``choose(cluster, profile, global_batch)`` returns the fastest layouts that fit
(``estimate`` costs one); ``choose_config(n, abstract_state, rules, global_batch)`` is the rule
every part of tenplex_jax uses to pick a parallel config for ``n`` devices; ``Growth`` is the
growth rule's decision on an offer.
"""

from tenplex_jax._src.planner.cluster import GIB, Cluster, DeviceType
from tenplex_jax._src.planner.growth import Growth
from tenplex_jax._src.planner.policy import choose_config
from tenplex_jax._src.planner.profile import LayerProfile, ModelProfile
from tenplex_jax._src.planner.search import Candidate, Choice, Objective, choose, estimate

__all__ = [
    "GIB",
    "Candidate",
    "Choice",
    "Cluster",
    "DeviceType",
    "Growth",
    "LayerProfile",
    "ModelProfile",
    "Objective",
    "choose",
    "choose_config",
    "estimate",
]
