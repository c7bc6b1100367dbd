"""A VW job for the tests' processes (``tests.wsp.wsp_jobs:job``): the models' GPT job, whose build
takes ``build_seconds`` longer, or fails; and the tails of a run's VW logs, for a failure's
message."""

from __future__ import annotations

import pathlib
import time

from tenplex_jax_models import wsp


def job(devices: int, *, build_seconds: float = 0.0, fail: bool = False, **options) -> dict:
    time.sleep(build_seconds)
    if fail:
        raise RuntimeError("this VW's build fails (as the test asked)")
    return wsp.job(devices, **options)


def tails(run_dir: pathlib.Path, chars: int = 600) -> str:
    """The last ``chars`` characters of each VW log in ``run_dir``."""
    logs = sorted(pathlib.Path(run_dir).glob("*.log"))
    return "\n".join(f"{p.name}: {p.read_text()[-chars:]}" for p in logs)
