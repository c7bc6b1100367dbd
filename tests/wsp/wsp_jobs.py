"""A VW job for the tests' processes (``tests.wsp.wsp_jobs:job``): the models' GPT job, whose build
takes ``build_seconds`` longer, or fails."""

from __future__ import annotations

import time

from tenplex_jax_models import wsp


def job(devices: int, *, build_seconds: float = 0.0, fail: bool = False, **options) -> dict:
    time.sleep(build_seconds)
    if fail:
        raise RuntimeError("this VW's build fails (as the test asked)")
    return wsp.job(devices, **options)
