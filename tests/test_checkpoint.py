"""The orbax tier: save a laid-out state with its PTC and data cursor, restore onto any layout."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import tenplex_jax as tj
from tenplex_jax_models import GPTConfig
from tests.helpers import RULES, assert_shards_equal, host_copy, train_state


def _placed(config, devices, seed=0):
    model, optimizer = train_state(seed=seed)
    nodes = {"model": model, "optimizer": optimizer}
    state = nnx.state(nodes)
    ptc = tj.PTC.of(state, RULES, config, devices)
    return tj.place(state, ptc), ptc


def _data_state(consumed=48):
    dataset = tj.DatasetPTC(np.arange(100), global_batch=16, seed=3)
    dataset.restore(dataclasses.replace(dataset.state(), consumed=consumed))
    return dataset.state()


def test_restores_onto_another_layout_with_step_and_cursor(tmp_path):
    devices = jax.devices()
    state, ptc = _placed(tj.ParallelConfig(data=2, fsdp=2, tensor=2), devices)
    want = host_copy(state)
    cursor = _data_state()
    saved = tj.save_checkpoint(tmp_path, state, ptc, step=7, data_state=cursor)
    assert saved.step == 7 and tj.latest_checkpoint(tmp_path) == 7

    target = ptc.relayout(tj.ParallelConfig(data=3), devices[5:8])
    restored = tj.restore_checkpoint(tmp_path, target)
    assert restored.tenplex and restored.step == 7 and restored.data_state == cursor
    assert restored.source["config"] == {
        "axes": [["pipe", 1], ["data", 2], ["fsdp", 2], ["tensor", 2]],
        "axis_types": ["Auto"] * 4,
    }
    # and the record written before meshes had names of their own still reads
    old = {"data": 2, "fsdp": 2, "tensor": 2, "pipe": 1}
    assert tj.ParallelConfig.from_json(old) == tj.ParallelConfig.from_json(
        restored.source["config"]
    )
    assert_shards_equal(restored.state, want, target)
    # the restored cursor resumes the dataset where it stood
    dataset = tj.DatasetPTC(np.arange(100), global_batch=16, seed=3)
    dataset.restore(restored.data_state)
    assert dataset.step == 3


def test_async_save_survives_the_state_being_donated(tmp_path):
    devices = jax.devices()
    state, ptc = _placed(tj.ParallelConfig(fsdp=4), devices[:4])
    want = host_copy(state)
    saved = tj.save_checkpoint(tmp_path, state, ptc, step=1, wait=False)
    for leaf in jax.tree.leaves(state):  # what a donating train step does to the old buffers
        leaf.delete()
    saved.wait()
    restored = tj.restore_checkpoint(tmp_path, ptc)
    assert_shards_equal(restored.state, want, ptc)


def test_keeps_steps_and_reads_the_one_asked(tmp_path):
    state, ptc = _placed(tj.ParallelConfig(data=2), jax.devices()[:2])
    first = host_copy(state)
    tj.save_checkpoint(tmp_path, state, ptc, step=1, keep=2)
    later, _ = _placed(tj.ParallelConfig(data=2), jax.devices()[:2], seed=1)
    for step in (2, 3):
        tj.save_checkpoint(tmp_path, later, ptc, step=step, keep=2)
    assert tj.latest_checkpoint(tmp_path) == 3
    with pytest.raises(tj.errors.CheckpointError, match="no finished checkpoint for step 1"):
        tj.restore_checkpoint(tmp_path, ptc, step=1)  # deleted by keep=2
    assert not all(np.array_equal(a, b) for a, b in zip(first, host_copy(later)))
    assert_shards_equal(tj.restore_checkpoint(tmp_path, ptc, step=2).state, host_copy(later), ptc)
    with pytest.raises(tj.errors.CheckpointError, match="already exists"):
        tj.save_checkpoint(tmp_path, later, ptc, step=3)


def test_unfinished_step_is_never_read(tmp_path):
    state, ptc = _placed(tj.ParallelConfig(data=2), jax.devices()[:2])
    tj.save_checkpoint(tmp_path, state, ptc, step=4)
    # a save killed half-way leaves orbax's temporary directory behind, never a step directory
    shutil.copytree(tmp_path / "4", tmp_path / "9.orbax-checkpoint-tmp-1234")
    assert tj.latest_checkpoint(tmp_path) == 4
    assert tj.restore_checkpoint(tmp_path, ptc).step == 4
    with pytest.raises(tj.errors.CheckpointError, match="no finished checkpoint for step 9"):
        tj.restore_checkpoint(tmp_path, ptc, step=9)


def test_restores_a_plain_orbax_checkpoint_given_the_rules(tmp_path):
    devices = jax.devices()
    model, _ = train_state(seed=2)
    with ocp.StandardCheckpointer() as checkpointer:  # plain orbax: no tenplex record
        checkpointer.save(tmp_path / "plain", nnx.state(model))
    want = host_copy(nnx.state(model))

    target = tj.PTC.of(nnx.state(model), RULES, tj.ParallelConfig(fsdp=2, tensor=2), devices[:4])
    restored = tj.restore_checkpoint(tmp_path / "plain", target)
    assert not restored.tenplex and restored.step is None and restored.data_state is None
    assert_shards_equal(restored.state, want, target)

    # into the model part of a {"model", "optimizer"} state, from a CheckpointManager directory
    manager = ocp.CheckpointManager(tmp_path / "managed")
    manager.save(12, args=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))))
    manager.wait_until_finished()
    nodes = nnx.state({"model": model})
    target = tj.PTC.of(nodes, RULES, tj.ParallelConfig(data=2, tensor=2), devices[4:])
    restored = tj.restore_checkpoint(tmp_path / "managed", target, prefix="model")
    assert restored.step == 12 and not restored.tenplex
    assert_shards_equal(restored.state, want, target)
    with pytest.raises(tj.errors.CheckpointError, match="pass prefix= to map them"):
        tj.restore_checkpoint(tmp_path / "managed", target)


def test_bad_checkpoints_are_refused_clearly(tmp_path):
    devices = jax.devices()
    state, ptc = _placed(tj.ParallelConfig(data=2), devices[:2])
    with pytest.raises(tj.errors.CheckpointError, match="no finished checkpoint step"):
        tj.restore_checkpoint(tmp_path, ptc)
    with pytest.raises(tj.errors.CheckpointError, match="not a directory"):
        tj.restore_checkpoint(tmp_path / "nowhere", ptc)
    tj.save_checkpoint(tmp_path, state, ptc, step=1)

    wider = dataclasses.replace(GPTConfig.tiny(), d_model=64)
    model, optimizer = train_state(wider)
    other = tj.PTC.of(
        nnx.state({"model": model, "optimizer": optimizer}), RULES, ptc.config, devices[:2]
    )
    with pytest.raises(
        tj.errors.CheckpointError,
        match=r"target's shape and dtype.*wants \(2, 64\).*mesh=\{pipe: 1, data: 2",
    ):
        tj.restore_checkpoint(tmp_path, other)

    model_only = tj.PTC.of(nnx.state({"model": model}), RULES, ptc.config, devices[:2])
    with pytest.raises(tj.errors.CheckpointError, match="must be in the checkpoint"):
        tj.restore_checkpoint(tmp_path, model_only, prefix="params")

    with pytest.raises(tj.errors.PlanError, match="does not match the PTC"):
        tj.save_checkpoint(tmp_path, nnx.state({"model": model}), ptc, step=2)
    assert tj.latest_checkpoint(tmp_path) == 1
