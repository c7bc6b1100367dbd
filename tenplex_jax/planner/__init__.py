"""The planner: cluster descriptions, model profiles, the layout search and the config policy.

>>> cluster = tj.planner.Cluster.load("meshes/hetpipe.toml")
>>> choice = tj.planner.choose(cluster, profile, global_batch=32)    # fastest layout that fits
>>> print(choice)                                                     # top candidates and why
>>> tj.planner.choose_config(6, abstract_state, rules, 24, workers=8) # the default (data, fsdp)

``cluster.py`` reads device types and nodes, ``profile.py`` holds per-layer costs, ``search.py``
is the cost model and search (``choose``, ``estimate``), ``policy.py`` the one rule every part of
tenplex_jax uses to pick a config for a device count.
"""

from tenplex_jax.planner.cluster import GIB, Cluster, DeviceType
from tenplex_jax.planner.policy import choose_config
from tenplex_jax.planner.profile import LayerProfile, ModelProfile
from tenplex_jax.planner.search import Candidate, Choice, choose, estimate

__all__ = [
    "GIB",
    "Candidate",
    "Choice",
    "Cluster",
    "DeviceType",
    "LayerProfile",
    "ModelProfile",
    "choose",
    "choose_config",
    "estimate",
]
