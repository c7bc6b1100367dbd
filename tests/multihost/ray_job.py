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
   the other nodes, in their own processes, the dead node's shards from their replicas;
2. a node joins while that generation is paused after step 7 (a generation of warm standby
   processes that load their step could otherwise run past step 10 before Ray reports the node):
   growing pays over the planned run (``--planned-steps``); once the launcher asks for it, the job
   resumes and grows to 3 processes at a step boundary, nothing lost;
3. after step 10: a node and the node holding its replicas die together: no copy of some shards
   survives; the launcher names the leaves and restores the orbax checkpoint of step 8 on the node
   left, which trains the lost steps again and finishes the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic_gpt.py"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def events(run: pathlib.Path) -> list[dict]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generations(run: pathlib.Path) -> list[dict]:
    return [e for e in events(run) if e["event"] == "generation"]


def wait_for(predicate, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def listening() -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def main() -> int:
    out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    for command in (
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1"],
        ["ip", "addr", "add", "10.255.0.1/24", "dev", "decoy0"],
        ["ip", "link", "set", "decoy0", "up"],
        ["ip", "link", "set", "decoy1", "up"],
    ):
        subprocess.run(command, check=True)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from ray.cluster_utils import Cluster

    from tenplex_jax._src.multihost.ray import RayLauncher
    from tenplex_jax._src.multihost.spec import LaunchOptions
    from tenplex_jax.errors import StoreError
    from tenplex_jax.multihost.store import StoreClient

    run = out / "run"
    result: dict = {"seen": [], "notes": []}
    sockets: set[tuple[str, int]] = set()  # the sampling thread's alone until it is joined
    started = time.monotonic()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    nodes = {}
    for _ in range(3):
        node = cluster.add_node(num_cpus=1, resources={"tenplex": 1})
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    result["cluster_seconds"] = time.monotonic() - started
    options = LaunchOptions(
        str(EXAMPLE),
        (
            "--steps",
            str(steps),
            "--planned-steps",
            "100000",
            "--batch",
            "24",
            "--grad-units",
            "8",
            "--samples",
            "100",
            "--log",
            str(out / "steps.jsonl"),
            "--out",
            str(out / "final.npz"),
            "--pause-after",
            "4,7,10",
        ),
        nprocs=3,
        devices_per_proc=2,
        replicas=1,
        commit_every=2,
        checkpoint_dir=out / "ckpt",
        checkpoint_every=4,
        grace=1.0,
        run_dir=run,
        compile_cache=out / "jax-cache",
    )
    launcher = RayLauncher(options, cluster.address, resource="tenplex")
    done = threading.Event()

    def sample():
        while not done.wait(0.25):
            sockets.update(listening())

    def paused(step: int) -> bool:
        gen = generations(run)[-1]
        return all((run / f"paused-{step}-p{i}").exists() for i in range(gen["processes"]))

    def kill_slots(*slots: int) -> None:
        for slot in slots:
            cluster.remove_node(nodes.pop(launcher.nodes[slot]), allow_graceful=False)
        result["seen"].append({"killed_slots": list(slots), "time": time.time()})

    def chaos():  # in the main thread: Ray's cluster utilities add nodes from there only
        try:
            wait_for(lambda: generations(run) and paused(4), "generation 0 paused after step 4")
            try:
                StoreClient(launcher.slots[0].address, timeout=5).list("")
                result["notes"].append("a store answered without the token")
            except StoreError as error:
                result["no_token"] = error.reason
            kill_slots(generations(run)[-1]["slots"][0])  # process 0's node: the coordinator's
            wait_for(lambda: len(generations(run)) >= 2 and paused(7), "generation 1 paused")
            node = cluster.add_node(num_cpus=1, resources={"tenplex": 1})
            nodes[node.node_id] = node
            result["seen"].append({"joined": node.node_id, "time": time.time()})
            asked = lambda: any(e["event"] == "request" for e in events(run))
            wait_for(asked, "the launcher's request to grow")
            # asked of the workers once they have the grown step ready (they train on meanwhile)
            wait_for(lambda: (run / "control.json").exists(), "the workers asked to grow")
            (run / "resume-7").write_text("")
            wait_for(
                lambda: len(generations(run)) >= 3 and paused(10),
                "the grown generation paused after step 10",
            )
            slots = generations(run)[-1]["slots"]
            kill_slots(slots[1], slots[2])  # slot 1's objects are replicated on slot 2 only
        except Exception as error:  # reported in the result; the launcher is stopped below
            result["notes"].append(f"chaos: {error!r}")
            launcher._terminate = True

    def launch():
        result["returncode"] = launcher.run()

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=launch)]
    for t in threads:
        t.start()
    try:
        chaos()
        threads[1].join(timeout=900)
    finally:
        done.set()
        threads[0].join(timeout=60)  # its last sample lands before the sockets are read
        result["token"] = (run / "token").read_text().strip() if (run / "token").exists() else ""
        result["sockets"] = sorted(sockets)
        result["beyond_loopback"] = [s for s in result["sockets"] if s[0] not in LOOPBACK]
        result["seconds"] = time.monotonic() - started
        cluster.shutdown()
        (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
