"""Live versions, piece by piece: what the survivors of a failure write from their memory, what the
launcher then restores, and faults during that recovery. Real store processes (the launcher's
own, for four slots); this process's 8 CPU devices stand in for the job's four processes
(``hosts``: devices 2p and 2p + 1 are process p's), so each survivor's part is written as its
process would, with its own store's client. The end-to-end runs are ``test_launch.py`` (zero lost
steps through two failures), ``test_launch_bitwise.py`` (a rewind) and ``test_ray.py``."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.multihost.commit import (
    Committer,
    commit_live,
    latest_complete,
    pull,
    read_manifest,
)
from tenplex_jax._src.multihost.launch import Launcher
from tenplex_jax._src.multihost.rundir import LiveReport, record_path, write
from tenplex_jax._src.multihost.spec import LaunchOptions
from tenplex_jax._src.multihost.store.client import StoreClient
from tenplex_jax._src.multihost.worker import _completed
from tenplex_jax.multihost import RunDir, Source
from tests.helpers import RULES, abstract_state, assert_shards_equal, host_copy, train_state

HOSTS = [0, 0, 1, 1, 2, 2, 3, 3]
DATA = tj.ParallelConfig(data=4, fsdp=2)  # each process holds every box: fsdp is inside it
SHARDED = tj.ParallelConfig(data=2, fsdp=4)  # process p's boxes are on process p +- 2 too


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(
        LaunchOptions("train.py", nprocs=4, run_dir=str(tmp_path)), log=lambda *a, **k: None
    )
    (tmp_path / "logs").mkdir()
    try:
        launcher._start_stores(range(4))
        yield launcher
    finally:
        launcher._teardown()


@pytest.fixture
def clients(launcher):
    out = {i: StoreClient(s.address, timeout=30.0) for i, s in launcher.slots.items()}
    yield out
    for client in out.values():
        client.close()


def laid_out(config, scale: float = 1.0):
    ptc = tj.PTC.of(abstract_state(), RULES, config, range(8), hosts=HOSTS)
    state = jax.tree.map(lambda x: x * scale, nnx.state(train_state()))
    return ptc, jax.device_put(state, ptc.shardings(ptc.mesh()))


def dataset():
    return tj.DatasetPTC(np.arange(40), 8, seed=1)


def test_the_survivors_memory_restores_every_shard_bit_for_bit(launcher, clients, tmp_path):
    ptc, state = laid_out(SHARDED)
    survivors = [1, 2, 3]  # process 0 died; its boxes are process 2's too
    data = dataset()
    data.step = 7
    parts = [
        commit_live(clients, state, ptc, 7, data.state(), [0, 1, 2, 3], survivors, p)
        for p in survivors
    ]
    assert sum(nbytes for _, nbytes in parts) == ptc.nbytes  # each distinct box once
    launcher.slots[0].store.kill()  # the dead process's store goes with it
    launcher.slots[0].store.wait()
    assert launcher._choose_source(0) == tj.multihost.Restore(source=Source.LIVE, step=7)
    # the next generation: 3 processes' devices, pulled by each as its own slot
    live = {s: c for s, c in clients.items() if s != 0}
    manifest = read_manifest(live, 7, live=True)
    assert manifest.live and manifest.slots == (1, 2, 3) and manifest.data_state.consumed == 56
    target = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=3, fsdp=2), range(6))
    arrays, report = pull(live, manifest, target, 1)
    assert 0 not in report.by_slot
    restored = jax.tree_util.tree_unflatten(target.treedef, arrays)
    assert_shards_equal(restored, host_copy(state), target)


def test_a_survivor_without_a_box_writes_nothing_and_names_the_leaves(clients):
    ptc, state = laid_out(SHARDED)
    with pytest.raises(PlanError, match="no survivor holds every box of the leaves"):
        commit_live(clients, state, ptc, 3, None, [0, 1, 2, 3], [0, 2], 2)
    assert clients[2].list("l") == [] and clients[2].list_json("l") == []


def test_a_second_failure_during_the_recovery_restores_one_whole_version(
    launcher, clients, tmp_path
):
    """Survivors 0, 1 and 2 write the live version of step 5; the last commit is of step 4
    (values x 0.5: a mix would show). Then faults: survivor 2 dies before writing its part, or
    the store of a part dies after it was written. Each time the launcher restores one whole
    version (the commit of step 4), says why in a rewind event, and deletes the live version."""
    ptc, state = laid_out(DATA)
    _, older = laid_out(DATA, scale=0.5)
    committers = [
        Committer(p, [0, 1, 2, 3], [clients[s] for s in range(4)], _Replicated(clients), 1)
        for p in range(4)
    ]
    data = dataset()
    data.step = 4
    for committer in committers:  # one after the other: they share this process's clients
        committer.commit(older, ptc, 4, data.state(), wait=True)
    assert latest_complete(clients).step == 4
    survivors = [0, 1, 2]
    data.step = 5
    for p in (0, 1):  # survivor 2 dies before it writes: its marker never comes
        commit_live(clients, state, ptc, 5, data.state(), [0, 1, 2, 3], survivors, p)
        record = LiveReport(step=5, newest=5, objects=1, nbytes=1, seconds=0.0)
        write(record_path(tmp_path, LiveReport, 0, p), record)
    assert latest_complete(clients, live=True) is None
    assert launcher._choose_source(0) == tj.multihost.Restore(source=Source.STORE, step=4)
    [rewind] = RunDir(tmp_path).events("rewind")
    assert (rewind["step"], rewind["source"], rewind["newest"]) == (4, "store", 5)
    assert clients[0].list("l") == []  # the incomplete live version is gone
    # again, complete but not replicated, then the store holding one of its parts dies
    for p in survivors:
        commit_live(clients, state, ptc, 5, data.state(), [0, 1, 2, 3], survivors, p)
    assert latest_complete(clients, live=True).step == 5
    launcher.slots[2].store.kill()
    launcher.slots[2].store.wait()
    assert launcher._choose_source(0) == tj.multihost.Restore(source=Source.STORE, step=4)
    lost = RunDir(tmp_path).events("replicas_lost")[-1]  # survivor 2's part: on store 2 alone
    assert lost["step"] == 5 and lost["leaves"]
    rewind = RunDir(tmp_path).events("rewind")[-1]
    assert (rewind["step"], rewind["newest"]) == (4, 5) and "a store lost" in rewind["detail"]
    live = {s: c for s, c in clients.items() if s != 2}
    manifest = latest_complete(live)
    target = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=3, fsdp=2), range(6))
    arrays, _ = pull(live, manifest, target, 0)
    restored = jax.tree_util.tree_unflatten(target.treedef, arrays)
    assert_shards_equal(restored, host_copy(older), target)  # step 4's, whole
    for c in committers:
        c.close()


def test_a_live_version_replicated_outlives_a_survivors_store(launcher, clients):
    """With ``--replicas 1`` each part is on its writer's store and the next survivor's: the
    store of a survivor that dies with the failure (after the survivors were told) loses
    nothing, and that survivor's memory still serves, through the others' stores."""
    ptc, state = laid_out(DATA)
    survivors = [0, 1, 2]
    launcher.slots[1].store.kill()  # survivor 1's store dies before it writes
    launcher.slots[1].store.wait()
    data = dataset()
    data.step = 5
    live = {s: c for s, c in clients.items() if s != 1}
    for p in survivors:
        commit_live(live, state, ptc, 5, data.state(), [0, 1, 2, 3], survivors, p, replicas=1)
    assert launcher._choose_source(0) == tj.multihost.Restore(source=Source.LIVE, step=5)
    manifest = read_manifest(live, 5, live=True)
    target = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, fsdp=2), range(4))
    arrays, report = pull(live, manifest, target, 0)
    assert 1 not in report.by_slot
    restored = jax.tree_util.tree_unflatten(target.treedef, arrays)
    assert_shards_equal(restored, host_copy(state), target)


def test_a_held_state_is_live_only_while_alive_and_done():
    _, state = laid_out(DATA)
    assert _completed(state, deadline=time.monotonic() + 60.0)  # its placement ends
    jax.block_until_ready(state)
    assert _completed(state, deadline=0.0)  # done: no wait
    copy = jax.tree.map(lambda x: x.copy(), state)
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(copy)
    assert not _completed(copy, deadline=float("inf"))  # donated by a step: gone


class _Replicated:
    """What ``Committer`` writes objects through: each to its writer's store and the next one."""

    def __init__(self, clients):
        self.clients = clients

    def put(self, process, path, data, *, box, global_shape):
        for slot in (process, (process + 1) % 4):
            self.clients[slot].put(path, data, box=box, global_shape=global_shape)

    def close(self):
        pass


def test_tenplex_central_sends_every_byte_through_the_first_store(clients):
    """``--central``: every process's objects of a commit go to the first process's store, and
    a pull reads every piece from there; the others hold nothing."""
    ptc, state = laid_out(SHARDED)
    committers = [
        Committer(
            p, [0, 1, 2, 3], [clients[s] for s in range(4)], _Replicated(clients), 1, central=True
        )
        for p in range(4)
    ]
    data = dataset()
    data.step = 2
    for committer in committers:
        committer.commit(state, ptc, 2, data.state(), wait=True)
    assert {o.path for o in clients[0].list("v")} and all(
        clients[s].list("v") == [] for s in (1, 2, 3)
    )
    manifest = latest_complete(clients)
    assert manifest.replicas == 0 and {o.slots for o in manifest.objects} == {(0,)}
    assert sum(o.nbytes for o in manifest.objects) == ptc.nbytes
    target = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(tensor=2, data=3), range(6))
    arrays, report = pull(clients, manifest, target, 2)
    assert set(report.by_slot) == {0}  # all of it from the central store, none from its own
    assert_shards_equal(
        jax.tree_util.tree_unflatten(target.treedef, arrays), host_copy(state), target
    )
    for committer in committers:
        committer.close()
