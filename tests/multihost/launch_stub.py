"""A stand-in worker for the launcher's process-management test: no training, only the protocol.

Started like every worker (``python -m tenplex_jax.multihost``, which joins ``jax.distributed``).
Generation 0: process 1 exits with status 3 at once (and must not wait in JAX's shutdown barrier
for its peer), process 0 hangs (as a survivor blocked in a collective would) until the launcher
kills it. Later generations: write ``ready-g<gen>`` and wait
for the launcher's control file, then exit 0 as a worker does after its final commit.
"""

import json
import os
import pathlib
import sys
import time

spec = json.loads(os.environ["TENPLEX_JOB"])
run = pathlib.Path(spec["run_dir"])
if spec["generation"] == 0:
    if spec["process_id"] == 1:
        sys.exit(3)
    time.sleep(300)
    sys.exit(0)
(run / f"ready-g{spec['generation']}-p{spec['process_id']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while not (run / "control.json").exists():
    if time.monotonic() > deadline:
        sys.exit(4)
    time.sleep(0.05)
sys.exit(0)
