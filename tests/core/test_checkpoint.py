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
        match=r"target's shape and dtype.*target on Mesh\('pipe': 1, 'data': 2, 'fsdp': 1, "
        r"'tensor': 1; Auto\).* in both with another shape or dtype: '[\w/]+' is float32\[2, 64\] "
        r"spec=P\(.*\) in the target, float32\[2, 32\] in the checkpoint",
    ):
        tj.restore_checkpoint(tmp_path, other)

    model_only = tj.PTC.of(nnx.state({"model": model}), RULES, ptc.config, devices[:2])
    with pytest.raises(tj.errors.CheckpointError, match="must be in the checkpoint"):
        tj.restore_checkpoint(tmp_path, model_only, prefix="params")

    with pytest.raises(tj.errors.PlanError, match="does not match the PTC"):
        tj.save_checkpoint(tmp_path, nnx.state({"model": model}), ptc, step=2)
    assert tj.latest_checkpoint(tmp_path) == 1


# -- every file of a step is checked: nothing damaged or unfinished is restored -------------------


def _two_steps(tmp_path):
    """Steps 3 and 5 of a laid-out state (the second one trained a little further)."""
    state, ptc = _placed(tj.ParallelConfig(data=2, fsdp=2, tensor=2), jax.devices())
    tj.save_checkpoint(tmp_path, state, ptc, step=3, data_state=_data_state(48))
    later = jax.tree.map(lambda x: x + 1 if jnp_float(x) else x, state)
    tj.save_checkpoint(tmp_path, later, ptc, step=5, data_state=_data_state(80))
    return state, later, ptc


def jnp_float(x) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def _chunk(step_dir, leaf_dir: str):
    """A data file of one leaf (a chunk: one saved shard)."""
    chunks = sorted(
        p for p in (step_dir / "state" / leaf_dir).iterdir() if not p.name.startswith(".")
    )
    return chunks[len(chunks) // 2]


def test_a_flipped_bit_in_a_leafs_file_is_refused_naming_the_leaf_and_step(tmp_path):
    state, _, ptc = _two_steps(tmp_path)
    chunk = _chunk(tmp_path / "5", "model.tok_embed")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit
    chunk.write_bytes(raw)
    with pytest.raises(tj.errors.CheckpointError) as err:
        tj.restore_checkpoint(tmp_path, ptc, step=5)
    message = str(err.value)
    assert "step 5" in message and "damaged" in message, message
    assert "leaf 'model/tok_embed'" in message and chunk.name in message, message
    # the newest intact step is named and restored instead
    assert tj.latest_checkpoint(tmp_path) == 3
    restored = tj.restore_checkpoint(tmp_path, ptc)
    assert restored.step == 3 and restored.data_state.consumed == 48
    assert_shards_equal(restored.state, host_copy(state), ptc)
    # a restore that does not read the damaged leaf is not refused: only the files read are checked
    optimizer_only = tj.PTC.of(
        nnx.state({"optimizer": train_state()[1]}), RULES, ptc.config, jax.devices()
    )
    assert tj.restore_checkpoint(tmp_path, optimizer_only, step=5).step == 5


@pytest.mark.parametrize(
    "damage, rule",
    [
        ("truncate", r"model/w1.*has \d+ bytes"),
        ("remove", r"model/w1.*is missing"),
        ("metadata", r"file state/_METADATA has"),
        ("record", r"file tenplex/.* has"),
        ("no file list", r"unfinished or damaged: it has no file list"),
        ("file list", r"file list tenplex-files.json cannot be read"),
    ],
)
def test_a_damaged_or_unfinished_step_is_a_checkpoint_error_and_passed_over(tmp_path, damage, rule):
    _, _, ptc = _two_steps(tmp_path)
    step_dir = tmp_path / "5"
    if damage == "truncate":
        chunk = _chunk(step_dir, "model.w1")
        chunk.write_bytes(chunk.read_bytes()[:-7])
    elif damage == "remove":
        _chunk(step_dir, "model.w1").unlink()
    elif damage == "metadata":
        path = step_dir / "state" / "_METADATA"
        path.write_text(path.read_text().replace('"', "'", 1))
    elif damage == "record":
        path = step_dir / "tenplex" / "metadata"
        path.write_text(path.read_text().replace('"step": 5', '"step": 6'))
    elif damage == "no file list":  # killed after orbax finished, before the list was written
        (step_dir / "tenplex-files.json").unlink()
    else:
        path = step_dir / "tenplex-files.json"
        path.write_text(path.read_text().replace("crc32:", "crc33:", 1))
    with pytest.raises(tj.errors.CheckpointError, match=rf"step 5.*{rule}"):
        tj.restore_checkpoint(tmp_path, ptc, step=5)
    assert tj.latest_checkpoint(tmp_path) == 3


def test_a_record_with_a_fractional_step_is_refused(tmp_path):
    from tenplex_jax._src import checkpoint

    _, _, ptc = _two_steps(tmp_path)
    step_dir = tmp_path / "5"
    path = step_dir / "tenplex" / "metadata"
    path.write_text(path.read_text().replace('"step": 5', '"step": 5.9'))
    checkpoint._write_file_list(step_dir)  # a consistent file list: the record itself is wrong
    with pytest.raises(tj.errors.CheckpointError, match=r"step 5.9 is not an integer"):
        tj.restore_checkpoint(tmp_path, ptc, step=5)


def test_an_asynchronous_save_lists_its_files_when_it_is_waited_for(tmp_path):
    state, ptc = _placed(tj.ParallelConfig(fsdp=4), jax.devices()[:4])
    saved = tj.save_checkpoint(tmp_path, state, ptc, step=2, wait=False)
    saved.wait()
    assert (tmp_path / "2" / "tenplex-files.json").is_file()
    assert tj.latest_checkpoint(tmp_path) == 2
    assert_shards_equal(tj.restore_checkpoint(tmp_path, ptc).state, host_copy(state), ptc)


def test_a_save_on_a_new_layout_compiles_nothing(tmp_path, caplog):
    # orbax's default cuts every replicated shard into slices across its replicas, a device
    # slice each, compiled anew for each layout: 1.4 s of a step boundary after a preemption
    state, ptc = _placed(tj.ParallelConfig(data=4), jax.devices()[:4])
    want = host_copy(state)
    jax.block_until_ready(state)
    with jax.log_compiles(True), caplog.at_level("DEBUG", logger="jax"):
        tj.save_checkpoint(tmp_path, state, ptc, step=1)
    compiled = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert not compiled, compiled[:3]
    assert_shards_equal(tj.restore_checkpoint(tmp_path, ptc).state, want, ptc)
