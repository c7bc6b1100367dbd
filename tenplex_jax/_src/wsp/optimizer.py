"""Optimizer state shared through the parameter server's stores, so a joining VW keeps it.

The parameter server holds the weights only; each VW's optimizer state is its own. A VW shares it
every few waves (``optimizer_every``) and when it leaves, and a joining VW takes the freshest one
shared instead of fresh moments and a step count of 0. A share is written new, then named: each
leaf under ``wsp/optimizer/<vw>/<wave>/<leaf>`` (spread over the stores), then the VW's manifest
(``wsp/optimizer/<vw>``: its wave, each leaf's store and checksum) replaced, then its older share
deleted. A reader takes the freshest manifest whose every leaf it reads with the manifest's
checksum, else the next freshest: a share half written, or deleted under it, is never taken.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tenplex_jax._src.errors import StoreError
from tenplex_jax._src.wsp.ps import ParameterServer

PREFIX = "wsp/optimizer/"


def share(ps: ParameterServer, vw: str, wave: int, leaves: Mapping[str, np.ndarray]) -> None:
    """Share ``vw``'s optimizer state as of its clock ``wave`` (leaf path -> host array).

    Raises:
      StoreError: a store failed a request (the previous share stays the one named).
    """
    root = f"{PREFIX}{vw}/{wave}/"
    entries = {}
    for i, (path, x) in enumerate(sorted(leaves.items())):
        store = i % len(ps.clients)
        entries[path] = [store, ps.clients[store].put(root + path, np.asarray(x)).checksum]
    before = ps.coordinator.get_json(PREFIX + vw, default=None)
    ps.coordinator.put_json(PREFIX + vw, {"vw": vw, "wave": wave, "leaves": entries})
    if before is not None and before["wave"] != wave:
        for client in ps.clients:
            client.delete(f"{PREFIX}{vw}/{before['wave']}/")


def freshest(ps: ParameterServer) -> tuple[str, int, dict[str, np.ndarray]] | None:
    """The freshest optimizer state any VW shared, whole: ``(vw, wave, leaves)``, or None.

    Raises:
      StoreError: a store failed a request other than a missing or changed object.
    """
    manifests = [ps.coordinator.get_json(p, default=None) for p in ps.coordinator.list_json(PREFIX)]
    for m in sorted(filter(None, manifests), key=lambda m: (-m["wave"], m["vw"])):
        root, out = f"{PREFIX}{m['vw']}/{m['wave']}/", {}
        try:
            for path, (store, checksum) in m["leaves"].items():
                array, info = ps.clients[store].get(root + path, with_info=True)
                if info.checksum != checksum:
                    break  # replaced under the manifest
                out[path] = array
            else:
                return m["vw"], m["wave"], out
        except StoreError as error:
            if error.reason != "not_found":
                raise
    return None
