"""Run by tests/multihost/test_ray.py in a network namespace of its own (``unshare -rn``): a Ray
cluster of simulated nodes on 127.0.0.1, and ``examples/elastic_gpt.py`` launched on it by the
Ray launcher through node deaths and joins. Writes OUT/result.json for the test to check.

The namespace has loopback and one more interface, ``decoy0`` (10.255.0.1, one end of a veth
pair): Ray and everything
the job starts must keep to loopback, and anything that listens on every interface (0.0.0.0,
``::``) is seen listening there too. The listening sockets are sampled while the job runs.

Scenario (3 nodes with the ``tenplex`` resource; 3 processes x 2 CPU devices, replicas 1, a
commit every 2 steps, an orbax checkpoint every 4; each death injected while the job is paused at
a step boundary, its commits done):

1. after step 4: the node of process 0 dies (and its store); the job goes on with 2 processes on
   the other nodes, in their own processes, from their memory (a live version of step 4);
2. a node joins while that generation is paused after step 7 (a generation of warm standby
   processes that load their step could otherwise run past step 10 before Ray reports the node):
   growing pays over the planned run (``--planned-steps``); once the launcher asks for it, the job
   resumes and grows to 3 processes at a step boundary, nothing lost;
3. after step 10: a node and the node holding its replicas die together: the commit of step 10
   lost some shards' copies, but the node left holds a replica of every shard in memory and goes
   on from step 10, nothing lost, to the end of the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic_gpt.py"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
# seconds a Ray node gets to register with the cluster (Ray 2.60 waits 30, a constant of its
# own: a node starting on a loaded 2-core machine took longer), and a phase of the scenario
NODE_START_SECONDS = 180
PHASE_SECONDS = 300


def wait_for(predicate, what: str, running, timeout: float = PHASE_SECONDS) -> None:
    """Wait until ``predicate()``; an error naming ``what`` when ``running()`` (the launcher's
    thread) turns false first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if not running():
            raise RuntimeError(f"the launcher returned before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def listening() -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def namespace() -> None:
    """Loopback up, and the decoy interface beside it."""
    for command in (
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1"],
        ["ip", "addr", "add", "10.255.0.1/24", "dev", "decoy0"],
        ["ip", "link", "set", "decoy0", "up"],
        ["ip", "link", "set", "decoy1", "up"],
    ):
        subprocess.run(command, check=True)


def patient_node_start() -> None:
    """Give a starting Ray node ``NODE_START_SECONDS`` to register: Ray's node start-up polls
    ``services.get_node`` for 30 s (not configurable in Ray 2.60); each poll now waits longer."""
    import ray._private.services as services

    get_node = services.get_node

    def get(gcs_address, node_id):
        deadline = time.monotonic() + NODE_START_SECONDS
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get


def ray_logs(chars: int = 1500) -> str:
    """The tails of the newest Ray session's logs (raylets, GCS), for a cluster that failed."""
    logs = pathlib.Path("/tmp/ray/session_latest/logs")
    tails = []
    for path in sorted(logs.glob("*.err")) + sorted(logs.glob("gcs_server.out")):
        text = path.read_text(errors="replace").strip()
        if text:
            tails.append(f"--- {path.name}:\n{text[-chars:]}")
    return "\n".join(tails) or f"(no Ray logs in {logs})"


def start_cluster(nodes: dict) -> object:
    """A head and three nodes with the ``tenplex`` resource; a failure names the node and shows
    Ray's logs."""
    from ray.cluster_utils import Cluster

    patient_node_start()
    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
    except Exception as error:
        raise RuntimeError(f"the Ray head did not start: {error}\n{ray_logs()}") from error
    for i in range(3):
        try:
            node = cluster.add_node(num_cpus=1, resources={"tenplex": 1})
        except Exception as error:
            cluster.shutdown()
            raise RuntimeError(f"Ray node {i} did not start: {error}\n{ray_logs()}") from error
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    return cluster


def options(out: pathlib.Path, steps: int):
    from tenplex_jax.multihost import LaunchOptions

    script = ["--steps", str(steps), "--planned-steps", "100000", "--batch", "24"]
    script += ["--grad-units", "8", "--samples", "100", "--log", str(out / "steps.jsonl")]
    script += ["--out", str(out / "final.npz"), "--pause-after", "4,7,10"]
    return LaunchOptions(
        script=str(EXAMPLE),
        args=tuple(script),
        nprocs=3,
        devices_per_proc=2,
        replicas=1,
        commit_every=2,
        checkpoint_dir=out / "ckpt",
        checkpoint_every=4,
        grace=1.0,
        run_dir=out / "run",
        compile_cache=out / "jax-cache",
        start_timeout=NODE_START_SECONDS,
    )


def chaos(cluster, nodes: dict, launcher, result: dict, running) -> None:
    """The scenario's deaths and join, each at a pause, while ``running()`` (in the main
    thread: Ray's cluster utilities add nodes from there only)."""
    from tenplex_jax.errors import StoreError
    from tenplex_jax.multihost import RunDir
    from tenplex_jax.multihost.store import StoreClient

    run = RunDir(launcher.run_dir)
    generations = lambda: run.events("generation")

    def paused(step: int) -> bool:
        gen = generations()[-1]
        return all((run.path / f"paused-{step}-p{i}").exists() for i in range(gen["processes"]))

    def kill_slots(*slots: int) -> None:
        for slot in slots:
            cluster.remove_node(nodes.pop(launcher.nodes[slot]), allow_graceful=False)
        result["seen"].append({"killed_slots": list(slots), "time": time.time()})

    wait_for(lambda: generations() and paused(4), "generation 0 paused after step 4", running)
    try:
        StoreClient(launcher.slots[0].address, timeout=5).list("")
        result["notes"].append("a store answered without the token")
    except StoreError as error:
        result["no_token"] = error.reason
    kill_slots(generations()[-1]["slots"][0])  # process 0's node: the coordinator's
    wait_for(lambda: len(generations()) >= 2 and paused(7), "generation 1 paused", running)
    node = cluster.add_node(num_cpus=1, resources={"tenplex": 1})
    nodes[node.node_id] = node
    result["seen"].append({"joined": node.node_id, "time": time.time()})
    wait_for(lambda: run.events("request"), "the launcher's request to grow", running)
    # asked of the workers once they have the grown step ready (they train on meanwhile)
    asked = lambda: (run.path / "control.json").exists()
    wait_for(asked, "the workers asked to grow", running)
    (run.path / "resume-7").write_text("")
    grown = lambda: len(generations()) >= 3 and paused(10)
    wait_for(grown, "the grown generation paused after step 10", running)
    slots = generations()[-1]["slots"]
    kill_slots(slots[1], slots[2])  # slot 1's objects are replicated on slot 2 only


def main() -> int:
    out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    namespace()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from tenplex_jax._src.multihost.ray import RayLauncher

    result: dict = {"seen": [], "notes": []}
    sockets: set[tuple[str, int]] = set()  # the sampling thread's alone until it is joined
    started = time.monotonic()
    nodes: dict = {}
    cluster = start_cluster(nodes)
    result["cluster_seconds"] = time.monotonic() - started
    launcher = RayLauncher(options(out, steps), cluster.address, resource="tenplex")
    done = threading.Event()

    def sample():
        while not done.wait(0.25):
            sockets.update(listening())

    def launch():
        try:
            result["returncode"] = launcher.run()
        except BaseException:  # its traceback, in the result the test reports
            result["notes"].append(f"the launcher raised:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=launch)]
    for t in threads:
        t.start()
    try:
        try:
            chaos(cluster, nodes, launcher, result, threads[1].is_alive)
        except Exception as error:  # reported in the result; the launcher is stopped
            result["notes"].append(f"chaos: {error!r}")
            launcher._terminate = True
        threads[1].join(timeout=900)
    finally:
        done.set()
        threads[0].join(timeout=60)  # its last sample lands before the sockets are read
        token = out / "run" / "token"
        result["token"] = token.read_text().strip() if token.exists() else ""
        result["sockets"] = sorted(sockets)
        result["beyond_loopback"] = [s for s in result["sockets"] if s[0] not in LOOPBACK]
        result["seconds"] = time.monotonic() - started
        cluster.shutdown()
        (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
