"""Recovery on Ray against the local launcher and an orbax restart, in one run, side by side.

The same job (``examples/elastic_gpt.py``, the GPT of the recovery benchmark, 3 processes x 2 CPU
devices, a commit and a pause after step 2) loses its last process three ways:

- **ray**: on a Ray cluster of 3 simulated nodes (``ray.cluster_utils.Cluster``, each its own
  raylet) launched by ``tenplex-jax launch --ray``; the node of the last slot dies (its raylet,
  worker and store); the next generation restores from the surviving stores' replicas;
- **local store**: ``tenplex-jax launch`` on this host; the last worker and its store are
  SIGKILLed; restore from the stores;
- **local orbax**: the same as a plain restart from the orbax checkpoint, as a JAX job restarts
  today (``--replicas 0 --no-standby --no-keep --no-executable-cache``: see ``recovery``).

Kill → first step on the new config, the restore alone, and the phases between (``start`` is
where Ray's actor creation and scheduling show; the tenplex variants kill once process 0 has
compiled ahead the layout after a loss, as a failure comes after a job's first seconds); then
memory per node on Ray (RSS of each raylet, store and worker, sampled while the job runs), and
the cluster's start-up. Everything runs in a
network namespace of its own (``unshare -rn``), so every socket is on loopback.

    python -m tenplex_jax_benchmarks.ray_recovery [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tenplex_jax_benchmarks.recovery import EXAMPLE, FULL_MODEL, recover_once, timings

NPROCS, DEVICES, KILL_AFTER, STEPS = 3, 2, 2, 5  # 3 steps after the kill: a steady one timed


def ray_once(run: pathlib.Path, model: str) -> dict:
    """One job on a fresh 3-node Ray cluster; the last slot's node dies after step 2."""
    import psutil

    from tenplex_jax._src.multihost.ray import RayLauncher
    from tenplex_jax.multihost import LaunchOptions, RunDir

    tic = time.monotonic()
    cluster, nodes = _cluster()
    cluster_seconds = time.monotonic() - tic
    script = ("--model", model, "--steps", str(STEPS), "--log", str(run / "steps.jsonl"))
    options = LaunchOptions(
        script=str(EXAMPLE),
        args=(*script, "--pause-after", str(KILL_AFTER)),
        nprocs=NPROCS,
        devices_per_proc=DEVICES,
        commit_every=KILL_AFTER,
        run_dir=run,
    )
    launcher = RayLauncher(options, cluster.address, resource="tenplex")
    memory: dict[str, list[int]] = {"raylet": [], "store": [], "worker": [], "head": []}
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                role = _role(p.info["cmdline"] or [])
                if role and p.info["memory_info"] is not None:
                    memory[role].append(p.info["memory_info"].rss)

    thread = threading.Thread(target=launcher.run, daemon=True)
    sampler = threading.Thread(target=sample, daemon=True)
    thread.start()
    sampler.start()
    try:
        deadline = time.monotonic() + 600
        paused = [run / f"paused-{KILL_AFTER}-p{i}" for i in range(NPROCS)]
        _until(lambda: all(p.exists() for p in paused), thread, deadline, "reach its pause")
        # a failure comes after the job's first seconds: process 0 compiled the next layout
        # ahead, the others lowered it
        ready = lambda: RunDir(run).ahead(0, processes=NPROCS)
        _until(ready, thread, deadline, "compile ahead for a loss")
        killed = time.time()
        cluster.remove_node(nodes[launcher.nodes[NPROCS - 1]], allow_graceful=False)
        thread.join(timeout=600)
    finally:
        done.set()
        sampler.join(timeout=10)
        cluster.shutdown()
    result = timings(run, killed, NPROCS)
    result["cluster_seconds"] = cluster_seconds
    result["memory_mib"] = {role: statistics.median(v) / 2**20 for role, v in memory.items() if v}
    return result


def _cluster():
    """A fresh Ray cluster of ``NPROCS`` nodes with the ``tenplex`` resource, and its nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    nodes = {}
    for _ in range(NPROCS):
        node = cluster.add_node(num_cpus=1, resources={"tenplex": 1})
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    return cluster, nodes


def _until(predicate, thread, deadline: float, what: str) -> None:
    while not predicate():
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the Ray job did not {what}")
        time.sleep(0.05)


def _role(cmdline: list[str]) -> str | None:
    """Which part of a node a process is: its raylet, the job's store or worker, the head's GCS."""
    program = pathlib.Path(cmdline[0]).name if cmdline else ""
    if "tenplex_jax.multihost.store" in cmdline:
        return "store"
    if "tenplex_jax.multihost" in cmdline and str(EXAMPLE) in cmdline:
        return "worker"
    return {"raylet": "raylet", "gcs_server": "head"}.get(program)


def inside(repeats: int, model: str, out: pathlib.Path) -> None:
    runs: dict[str, list[dict]] = {"ray": [], "local store": [], "local orbax": []}
    for _ in range(repeats):
        for variant in runs:
            with tempfile.TemporaryDirectory(prefix="tenplex-ray-recovery-") as run_dir:
                run = pathlib.Path(run_dir)
                if variant == "ray":
                    result = ray_once(run, model)
                else:
                    result = recover_once(
                        variant.split()[1],
                        run,
                        model=model,
                        nprocs=NPROCS,
                        devices_per_proc=DEVICES,
                        kill_after=KILL_AFTER,
                        after=STEPS - KILL_AFTER,
                    )
            runs[variant].append(result)
            print(
                f"  {variant:12s} kill -> first step {result['recovery_seconds']:.2f} s, "
                f"restore {result['restore_seconds'] * 1e3:.0f} ms; "
                + ", ".join(f"{k} {v:.2f}" for k, v in result["phases"].items()),
                flush=True,
            )
    median = lambda v, key: statistics.median(r[key] for r in runs[v])
    row = {
        "kind": "ray_recovery",
        "model": model,
        "processes": NPROCS,
        "repeats": repeats,
        "load_average": os.getloadavg(),
        "runs": runs,
        "median_seconds": {v: median(v, "recovery_seconds") for v in runs},
        "median_restore_seconds": {v: median(v, "restore_seconds") for v in runs},
        "median_phases": {
            v: {k: statistics.median(r["phases"][k] for r in runs[v]) for k in runs[v][0]["phases"]}
            for v in runs
        },
        "ray_memory_mib": runs["ray"][-1]["memory_mib"],
        "ray_cluster_seconds": median("ray", "cluster_seconds"),
    }
    out.write_text(json.dumps(row, indent=1) + "\n")
    print(
        json.dumps(
            {
                k: row[k]
                for k in (
                    "median_seconds",
                    "median_restore_seconds",
                    "median_phases",
                    "ray_memory_mib",
                    "ray_cluster_seconds",
                )
            },
            indent=1,
        )
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default=FULL_MODEL)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("ray_recovery.json"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        for command in (["ip", "link", "set", "lo", "up"],):
            subprocess.run(command, check=True)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        inside(args.repeats, args.model, args.out)
        return 0
    command = [
        shutil.which("unshare") or "unshare",
        "-rn",
        sys.executable,
        "-m",
        "tenplex_jax_benchmarks.ray_recovery",
        "--inside",
        "--repeats",
        str(args.repeats),
        "--model",
        args.model,
        "--out",
        str(args.out.absolute()),
    ]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
