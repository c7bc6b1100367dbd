"""The persistent tier: a train state, its PTC and the dataset cursor as an orbax checkpoint.

``save_checkpoint`` writes the state with orbax (every process writes its own shards, so it works
under ``jax.distributed``) next to a small JSON record: the step, the PTC it was saved from (leaf
paths, shapes, dtypes, specs, config, devices) and the dataset's :class:`DataState`.
``restore_checkpoint`` reads it back onto *any* PTC — another config, other devices, another
process count — because orbax restores each leaf straight into the target ``NamedSharding``.

It also restores a checkpoint written by plain orbax, without the tenplex record: the target PTC,
built from the model and its logical-axis rules, supplies the shardings that the checkpoint lacks.
Leaves are matched by tree path; ``nnx.State`` saved as such stores each leaf as ``<path>/value``,
which matches ``<path>``; ``prefix=`` maps checkpoint paths under a part of the state (a checkpoint
of ``nnx.state(model)`` restores into the ``"model/"`` part of a ``{"model", "optimizer"}`` state).

>>> tj.save_checkpoint("ckpt", state, ptc, step=100, data_state=dataset.state())
>>> new = tj.PTC.of(abstract_state, rules, tj.ParallelConfig(data=3), jax.devices()[:3])
>>> restored = tj.restore_checkpoint("ckpt", new)       # latest step, laid out as `new`
>>> state, step = restored.state, restored.step
>>> dataset.restore(restored.data_state)                # the cursor resumes exactly once

Only finished checkpoints are read: orbax writes each step into a temporary directory and renames it
when every process is done, so a save killed half-way is never restored.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from tenplex_jax import tree
from tenplex_jax.data import DataState
from tenplex_jax.errors import CheckpointError, where
from tenplex_jax.executor import check_tree
from tenplex_jax.ptc import PTC

FORMAT = "tenplex_jax/checkpoint/1"
STATE, RECORD = "state", "tenplex"


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore_checkpoint`` read: the state laid out as the target PTC, and its context.

    ``step`` and ``data_state`` are ``None`` when the checkpoint does not say (plain orbax);
    ``source`` is the saved PTC's JSON record, ``None`` for plain orbax checkpoints.
    """

    state: Any
    step: int | None
    data_state: DataState | None
    source: dict | None
    path: pathlib.Path

    @property
    def tenplex(self) -> bool:
        return self.source is not None


@dataclasses.dataclass(frozen=True)
class Saved:
    """A save in flight (``wait=False``) or done: ``wait()`` blocks until the step is on disk."""

    step: int
    path: pathlib.Path
    manager: ocp.CheckpointManager = dataclasses.field(repr=False)

    def wait(self) -> Saved:
        self.manager.close()  # waits for the background write, then releases its threads
        return self


def save_checkpoint(
    directory,
    state,
    ptc: PTC,
    *,
    step: int,
    data_state: DataState | None = None,
    wait: bool = True,
    keep: int | None = None,
) -> Saved:
    """Write ``state`` (laid out as ``ptc``) as step ``step`` under ``directory``.

    With ``wait=False`` the arrays are copied off the devices before this returns and written in the
    background; call ``.wait()`` on the result before relying on the step. ``keep`` bounds the number
    of steps kept (oldest deleted first). Every process of a multi-process job must call this.
    """
    paths, arrays, _ = tree.arrays(state)
    check_tree(paths, ptc)
    for array, leaf in zip(arrays, ptc.leaves):
        if tuple(np.shape(array)) != leaf.shape:
            raise CheckpointError(
                f"the state has shape {tuple(np.shape(array))} where the PTC says otherwise: "
                + where(leaf.path, leaf.shape, leaf.spec, ptc.config.describe())
            )
    directory = pathlib.Path(directory).absolute()
    record = {
        "format": FORMAT,
        "step": int(step),
        "ptc": ptc.to_json(),
        "data_state": None if data_state is None else dataclasses.asdict(data_state),
    }
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=not wait)
    manager = ocp.CheckpointManager(directory, options=options)
    if int(step) in manager.all_steps():
        raise CheckpointError(
            f"step {step} already exists under {directory}; steps are written once"
        )
    manager.save(
        int(step),
        args=ocp.args.Composite(
            **{
                STATE: ocp.args.PyTreeSave(_nested(paths, arrays)),
                RECORD: ocp.args.JsonSave(record),
            }
        ),
    )
    saved = Saved(int(step), directory / str(int(step)), manager)
    return saved.wait() if wait else saved


def latest_checkpoint(directory) -> int | None:
    """The newest finished step under ``directory``, or ``None`` if there is none."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    steps = ocp.path.step.latest_step_metadata(directory, ocp.path.step.standard_name_format())
    return None if steps is None else steps.step


def restore_checkpoint(directory, target: PTC, *, step: int | None = None, prefix: str = ""):
    """Read a checkpoint onto ``target``'s layout; returns :class:`Restored`.

    ``directory`` is a directory of steps (as written by ``save_checkpoint`` or an orbax
    ``CheckpointManager``; ``step`` defaults to the latest finished one) or one plain orbax PyTree
    checkpoint. Every leaf of ``target`` must be in the checkpoint with the same shape and dtype;
    checkpoint leaves the target lacks are not read. ``prefix`` is prepended to checkpoint paths.
    """
    item, step_dir = _locate(pathlib.Path(directory).absolute(), step)
    record = _read_record(step_dir / RECORD) if step_dir is not None else None
    stored = _stored_leaves(item)
    mesh = target.mesh()
    restore_paths, targets = [], []
    for leaf in target.leaves:
        key = _lookup(stored, prefix, leaf.path)
        if key is None:
            raise CheckpointError(_missing_message(leaf, target, stored, prefix, item))
        shape, dtype = stored[key]
        if shape is not None and tuple(shape) != leaf.shape or not _same_dtype(dtype, leaf.dtype):
            raise CheckpointError(
                f"a checkpoint leaf must have the target's shape and dtype: {item} has {key!r} "
                f"as {tuple(shape or ())} {dtype}, the target wants {leaf.shape} {leaf.dtype}: "
                + where(leaf.path, leaf.shape, leaf.spec, target.config.describe())
            )
        restore_paths.append(key)
        sharding = NamedSharding(mesh, leaf.spec)
        targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
    tree = _nested(restore_paths, targets)
    restored = ocp.PyTreeCheckpointer().restore(
        item,
        args=ocp.args.PyTreeRestore(
            item=tree,
            restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
            partial_restore=True,
        ),
    )
    arrays = [_get(restored, key) for key in restore_paths]
    state = jax.tree_util.tree_unflatten(target.treedef, arrays)
    if record is None:
        return Restored(state, _plain_step(step_dir), None, None, item)
    data = record.get("data_state")
    return Restored(
        state,
        int(record["step"]),
        None if data is None else DataState(**data),
        record["ptc"],
        item,
    )


def _nested(paths: list[str], values: list) -> dict:
    """``["a/b", "a/c"]`` → ``{"a": {"b": ..., "c": ...}}`` (string keys, as orbax stores them)."""
    tree: dict = {}
    for path, value in zip(paths, values):
        *parents, name = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def _get(tree: dict, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _locate(directory: pathlib.Path, step: int | None) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(the PyTree item directory, the step directory or None for a bare PyTree checkpoint)."""
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: not a directory")
    if _is_pytree(directory):
        if step is not None:
            raise CheckpointError(f"{directory} is a single checkpoint; it has no step {step}")
        return directory, None
    if step is None:
        step = latest_checkpoint(directory)
        if step is None:
            raise CheckpointError(f"no finished checkpoint step under {directory}")
    step_dir = directory / str(int(step))
    if not step_dir.is_dir() or not ocp.path.step.is_checkpoint_finalized(step_dir):
        have = ocp.path.step.checkpoint_steps(directory)
        raise CheckpointError(
            f"no finished checkpoint for step {step} under {directory}; finished: {sorted(have)}"
        )
    for name in (STATE, "default"):
        if _is_pytree(step_dir / name):
            return step_dir / name, step_dir
    if _is_pytree(step_dir):
        return step_dir, step_dir
    items = sorted(p.name for p in step_dir.iterdir() if _is_pytree(p))
    if len(items) == 1:
        return step_dir / items[0], step_dir
    raise CheckpointError(
        f"step {step} under {directory} must hold one PyTree item (or one named {STATE!r}), "
        f"found {items}"
    )


def _is_pytree(path: pathlib.Path) -> bool:
    return (path / "_METADATA").is_file() or (path / "manifest.ocdbt").is_file()


def _read_record(path: pathlib.Path) -> dict | None:
    if not path.is_dir():
        return None
    record = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a tenplex_jax checkpoint record (format {FORMAT!r}): {str(record)[:200]}"
        )
    return record


def _stored_leaves(item: pathlib.Path) -> dict[str, tuple[tuple[int, ...] | None, Any]]:
    """Checkpoint path → (shape, dtype) from the checkpoint's metadata; nothing is read yet."""
    tree = ocp.PyTreeCheckpointHandler().metadata(item)
    tree = getattr(tree, "tree", tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): (
            getattr(meta, "shape", None),
            getattr(meta, "dtype", None),
        )
        for path, meta in leaves
    }


def _lookup(stored: dict, prefix: str, path: str) -> str | None:
    if prefix:
        if not path.startswith(prefix.rstrip("/") + "/"):
            return None
        path = path[len(prefix.rstrip("/")) + 1 :]
    for key in (path, path + "/value"):  # nnx.State saved as such keeps the Variable's `value`
        if key in stored:
            return key
    return None


def _missing_message(leaf, target: PTC, stored: dict, prefix: str, item) -> str:
    near = [k for k in stored if k.endswith(leaf.path.split("/")[-1])][:3]
    hint = ""
    if near:
        hint = f"; the checkpoint has similar paths {near} — pass prefix= to map them"
    return (
        f"every target leaf must be in the checkpoint: {item} (prefix {prefix!r}) has no "
        f"{leaf.path!r}; it holds {len(stored)} leaves, e.g. {list(stored)[:4]}{hint}: "
        + where(leaf.path, leaf.shape, leaf.spec, target.config.describe())
    )


def _same_dtype(stored, wanted) -> bool:
    if stored is None:
        return True
    try:
        return np.dtype(stored) == np.dtype(wanted)
    except TypeError:  # PRNG key dtypes are not numpy dtypes
        return str(stored) == str(wanted)


def _plain_step(step_dir: pathlib.Path | None) -> int | None:
    if step_dir is None:
        return None
    try:
        return int(step_dir.name)
    except ValueError:
        return None


def read_record(directory, step: int | None = None) -> dict | None:
    """The tenplex JSON record of a checkpoint step (``None`` for plain orbax), without its arrays."""
    _, step_dir = _locate(pathlib.Path(directory).absolute(), step)
    return None if step_dir is None else _read_record(step_dir / RECORD)
