"""The persistent tier: a train state, its PTC and the dataset cursor as an orbax checkpoint.

:func:`save_checkpoint` writes the state with orbax (a directory per leaf) beside a JSON record of
the step, the PTC and the :class:`DataState`; process 0 then lists the step's files with their
sizes and crc32 (``FILES``), last. :func:`restore_checkpoint` reads a step onto any PTC, checking
the files it reads against that list, and reads plain orbax checkpoints (unchecked) too.
``docs/checkpoints.md`` states the contract.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from tenplex_jax._src import checksums, tree
from tenplex_jax._src.data import DataState
from tenplex_jax._src.errors import CheckpointError, DataError
from tenplex_jax._src.executor import check_tree
from tenplex_jax._src.ptc import PTC

FORMAT = "tenplex_jax/checkpoint/2"  # 2: a leaf per directory, the step's files checksummed
FORMATS = ("tenplex_jax/checkpoint/1", FORMAT)  # 1: OCDBT, no file list (read unchecked)
STATE, RECORD = "state", "tenplex"
FILES = "tenplex-files.json"  # in a step directory: its files, sizes and checksums


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore_checkpoint`` read: the state laid out as the target PTC, and its context.

    Attributes:
      state: the state, laid out as the target PTC says, in its tree structure.
      step: the saved step; ``None`` when the checkpoint does not say (a bare orbax PyTree
        checkpoint).
      data_state: the dataset position saved with it (``dataset.restore(restored.data_state)``);
        ``None`` when none was saved or the checkpoint is plain orbax.
      source: the saved PTC's JSON record (:meth:`tenplex_jax.PTC.to_json`); ``None`` for plain
        orbax checkpoints.
      path: the orbax PyTree directory that was read.
    """

    state: Any
    step: int | None
    data_state: DataState | None
    source: dict | None
    path: pathlib.Path

    @property
    def tenplex(self) -> bool:
        """Whether ``save_checkpoint`` wrote it (it carries a PTC record), not plain orbax."""
        return self.source is not None


@dataclasses.dataclass(frozen=True)
class Saved:
    """A save in flight (``wait=False``) or done: what ``save_checkpoint`` returns.

    Attributes:
      step: the step saved.
      path: the step's directory.
      finisher: the thread that waits for orbax and then writes the step's file list.
      outcome: ``[]`` while the save runs, then ``[None]`` or ``[the error it raised]``.
    """

    step: int
    path: pathlib.Path
    finisher: threading.Thread = dataclasses.field(repr=False)
    outcome: list = dataclasses.field(repr=False)  # [] while running, then [None] or [error]

    def wait(self) -> Saved:
        """Block until the step is on disk, its file list included.

        Returns:
          This record.

        Raises:
          Exception: whatever the background save raised (orbax's errors, ``OSError``).
        """
        self.finisher.join()
        if self.outcome and self.outcome[0] is not None:
            raise self.outcome[0]
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

    An orbax checkpoint (each process writes its own shards) beside a JSON record of the step,
    the PTC and the dataset position; process 0 then lists every file of the step with its
    checksum, last, so a step without that list is unfinished. Every process of a multi-process
    job must call this. Example::

        tj.save_checkpoint("ckpt", state, ptc, step=100, data_state=dataset.state())

    Args:
      directory: the directory of steps (created if missing).
      state: the state, laid out as ``ptc`` says (the tree ``ptc`` was built from).
      ptc: its layout, recorded so a restore knows where it came from.
      step: the step number; each is written once.
      data_state: the dataset's position (``DatasetPTC.state()``), restored with the state.
      wait: block until the step is on disk; with ``False`` the arrays are copied off the
        devices before this returns and written in the background.
      keep: keep at most this many steps, deleting the oldest (default: all).

    Returns:
      A :class:`tenplex_jax.typing.Saved`; with ``wait=False`` call its ``wait()`` before relying
      on the step.

    Raises:
      PlanError: the state's leaves are not the PTC's.
      CheckpointError: the step already exists.
    """
    paths, arrays, _ = tree.arrays(state)
    check_tree(paths, arrays, ptc)
    directory, step = pathlib.Path(directory).absolute(), int(step)
    record = {
        "format": FORMAT,
        "step": step,
        "ptc": ptc.to_json(),
        "data_state": None if data_state is None else dataclasses.asdict(data_state),
    }
    manager = _manager(directory, keep, wait)
    if step in manager.all_steps():
        manager.close()
        raise CheckpointError(
            f"step {step} already exists under {directory}; steps are written once"
        )
    items = {STATE: ocp.args.PyTreeSave(_nested(paths, arrays)), RECORD: ocp.args.JsonSave(record)}
    manager.save(step, args=ocp.args.Composite(**items))
    saved = _finishing(manager, step, directory / str(step))
    return saved.wait() if wait else saved


def _manager(directory: pathlib.Path, keep: int | None, wait: bool) -> ocp.CheckpointManager:
    """An orbax manager of steps that stores a directory per leaf (no OCDBT: a damaged file
    names its leaf) beside the tenplex record."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=not wait)
    return ocp.CheckpointManager(
        directory,
        options=options,
        item_handlers={
            STATE: ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=_handlers()),
            RECORD: ocp.JsonCheckpointHandler(),
        },
    )


def _finishing(manager: ocp.CheckpointManager, step: int, step_dir: pathlib.Path) -> Saved:
    """The save, finished on a thread: orbax's writes, then (process 0) the step's file list,
    last, since a step without it is unfinished; then the manager is closed."""
    outcome: list = []

    def finish():
        try:
            manager.wait_until_finished()
            if jax.process_index() == 0:
                _write_file_list(step_dir)
            outcome.append(None)
        except Exception as error:
            outcome.append(error)
        finally:
            manager.close()

    finisher = threading.Thread(target=finish, name=f"tenplex-checkpoint-{step}")
    finisher.start()
    return Saved(step=step, path=step_dir, finisher=finisher, outcome=outcome)


@functools.cache
def _handlers():
    """orbax's type handlers, but for jax.Array one that copies each shard off its first replica
    whole (the same files): orbax's default cuts replicated shards into slices across the
    replicas, a device ``slice`` each, which every new layout compiles anew."""
    from orbax.checkpoint import type_handlers

    default = type_handlers.get_type_handler(jax.Array)
    array = type_handlers.ArrayHandler(
        array_metadata_store=getattr(default, "_array_metadata_store", None),
        use_replica_parallel=False,
    )
    others = [t for t in type_handlers.supported_types() if t is not jax.Array]
    return type_handlers.create_type_handler_registry(
        *[(t, type_handlers.get_type_handler(t)) for t in others], (jax.Array, array)
    )


def saved_steps(directory) -> list[int]:
    """Every step orbax finished writing under ``directory`` (checked or not), ascending."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    steps = ocp.path.step.checkpoint_steps(directory)
    return sorted(s for s in steps if ocp.path.step.is_checkpoint_finalized(directory / str(s)))


def latest_checkpoint(directory) -> int | None:
    """The newest finished, intact step under a directory of checkpoints.

    Every file of a step written by ``save_checkpoint`` is read and its checksum compared with
    the step's file list; an unfinished or damaged step is passed over for an earlier intact one.
    A step written by plain orbax has no list and counts as intact once orbax finished it.

    Args:
      directory: the directory of steps (a missing directory has none).

    Returns:
      The step number, or ``None`` when there is no intact step.
    """
    directory = pathlib.Path(directory)
    for step in reversed(saved_steps(directory)):
        step_dir = directory / str(step)
        if not (step_dir / RECORD).is_dir():
            return step  # written by plain orbax: nothing recorded to check it against
        try:
            _check_files(step_dir, step, leaves=None)
        except CheckpointError:
            continue
        return step
    return None


def restore_checkpoint(
    directory, target: PTC, *, step: int | None = None, prefix: str = "", verify: bool = True
):
    """Read a checkpoint onto ``target``'s layout: any config, devices or process count.

    orbax reads each leaf straight into the target's ``NamedSharding``. Leaves are matched by
    tree path; checkpoint leaves the target lacks are not read. The files read are checked
    against the step's file list while orbax reads them, and nothing is returned from a damaged
    step. Example::

        new = tj.PTC.of(abstract_state, rules, tj.ParallelConfig(data=3), jax.devices()[:3])
        restored = tj.restore_checkpoint("ckpt", new)       # the latest intact step
        state = restored.state
        dataset.restore(restored.data_state)

    Args:
      directory: a directory of steps (written by ``save_checkpoint`` or an orbax
        ``CheckpointManager``), or one plain orbax PyTree checkpoint.
      target: the PTC to lay the state out as; every one of its leaves must be in the
        checkpoint with the same shape and dtype.
      step: the step to read (default: the latest intact one, as :func:`latest_checkpoint`
        finds it); not with a single PyTree checkpoint.
      prefix: prepended to the target's paths to find them in the checkpoint (``"model/"``
        restores a checkpoint of ``nnx.state(model)`` into that part of a larger state).
      verify: check the files' checksums; ``False`` checks sizes only (for a step
        ``latest_checkpoint`` has just checked).

    Returns:
      A :class:`tenplex_jax.typing.Restored`: the state, its step, data state and source PTC.

    Raises:
      CheckpointError: the checkpoint is missing, unfinished or damaged (naming the step, leaf
        and file), or lacks a target leaf or holds it with another shape or dtype; nothing is
        restored.
      LayoutError: the target names devices this process does not have.
    """
    item, step_dir = _locate(pathlib.Path(directory).absolute(), step)
    step, record, checked = _opened(step_dir, verify)
    stored = _orbax(lambda: _stored_leaves(item), item, step)
    keys, targets = _targets(target, stored, prefix, item)
    restored = _read(item, step_dir, step, keys, targets, checked)
    state = jax.tree_util.tree_unflatten(target.treedef, [_get(restored, k) for k in keys])
    data = None if record is None else record.get("data_state")
    return Restored(
        state=state,
        step=step if record is None else record["step"],
        data_state=None if data is None else DataState.from_dict(data),
        source=None if record is None else record["ptc"],
        path=item,
    )


def _opened(step_dir: pathlib.Path | None, verify: bool) -> tuple[int | None, dict | None, bool]:
    """(the step, its tenplex record or None, whether its files are checked as they are read),
    once the step's metadata and record match its file list (with ``verify``)."""
    step = _plain_step(step_dir)
    checked = verify and step_dir is not None and (step_dir / RECORD).is_dir()
    if checked:  # the metadata and the record, before either is read
        _check_files(step_dir, step, leaves=set())
    record = _read_record(step_dir / RECORD) if step_dir is not None else None
    if record is not None and record["format"] == FORMATS[0]:
        checked = False  # written before the file lists: read unchecked
    return step, record, checked


def _targets(target: PTC, stored: dict, prefix: str, item) -> tuple[list[str], list]:
    """(the checkpoint's key of every target leaf, its ``ShapeDtypeStruct`` with the target's
    sharding); ``CheckpointError`` unless every target leaf is stored with its shape and dtype."""
    mesh = target.mesh()
    keys, targets, found = [], [], []
    for leaf in target.leaves:
        key = _lookup(stored, prefix, leaf.path)
        if key is None:
            continue
        shape, dtype = stored[key]
        found.append(tree.Leaf(leaf.path, None if shape is None else tuple(shape), dtype))
        keys.append(key)
        sharding = NamedSharding(mesh, leaf.spec)
        targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
    diff = tree.difference(target.leaves, found, ("the target", "the checkpoint"), subset=True)
    if diff:
        raise CheckpointError(_mismatch_message(diff, target, found, stored, prefix, item))
    return keys, targets


def _read(item, step_dir, step, keys: list[str], targets: list, checked: bool) -> dict:
    """orbax's restore of ``keys`` into ``targets``; when ``checked``, the leaves' files are
    checked (their sizes first, their bytes while orbax reads them)."""
    nested = _nested(keys, targets)

    def restore():
        restore_args = ocp.checkpoint_utils.construct_restore_args(nested)
        args = ocp.args.PyTreeRestore(item=nested, restore_args=restore_args, partial_restore=True)
        return ocp.PyTreeCheckpointer().restore(item, args=args)

    read = lambda: _orbax(restore, item, step)
    if not checked:
        return read()
    leaves = {_orbax_name(key): key for key in keys}
    _check_files(step_dir, step, leaves=leaves, contents=False)
    return _while_checked(read, lambda: _check_files(step_dir, step, leaves=leaves))


# -- the file list of a step ----------------------------------------------------------------------


def _write_file_list(step_dir: pathlib.Path) -> None:
    """List every file of a finished step with its size and checksum, atomically, last."""
    names = sorted(
        str(p.relative_to(step_dir))
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != FILES and not p.name.startswith(f".{FILES}")
    )
    sums = checksums.of_files(step_dir, names)
    body = {"files": {name: {"bytes": s[0], "checksum": s[1]} for name, s in sums.items() if s}}
    body["checksum"] = checksums.of(json.dumps(body["files"], sort_keys=True).encode())
    tmp = step_dir / f".{FILES}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / FILES)
    fd = os.open(step_dir, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename survives a crash of the machine
    finally:
        os.close(fd)


def _check_files(
    step_dir: pathlib.Path, step, *, leaves: dict[str, str] | set | None, contents: bool = True
) -> None:
    """``CheckpointError`` unless the files a restore of ``leaves`` reads (orbax's name -> the
    leaf's path; ``None``: every leaf, an empty set: none) match the step's file list; the
    metadata and record files are always checked. ``contents=False`` compares sizes only (a
    stat per file: what makes a reader fail outright, a missing or truncated file)."""
    where_ = f"checkpoint step {step} in {step_dir.parent}"
    try:
        body = json.loads((step_dir / FILES).read_text())
        files = body["files"]
        if checksums.of(json.dumps(files, sort_keys=True).encode()) != body["checksum"]:
            raise ValueError("its own checksum does not match")
        listed = {name: (int(f["bytes"]), str(f["checksum"])) for name, f in files.items()}
    except FileNotFoundError:
        raise CheckpointError(
            f"{where_} is unfinished or damaged: it has no file list ({FILES}, written after "
            f"every file of the step); nothing restored"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{where_} is damaged: its file list {FILES} cannot be read ({error}); nothing restored"
        ) from None
    leaf_dirs = {
        name.split("/")[1]
        for name in listed
        if name.startswith(f"{STATE}/") and name.endswith("/.zarray") and name.count("/") == 2
    }
    wanted = []
    for name in listed:
        parts = name.split("/")
        leaf = parts[1] if parts[0] == STATE and len(parts) > 2 and parts[1] in leaf_dirs else None
        if leaf is None or leaves is None or leaf in leaves:
            wanted.append((name, leaf))
    names = [name for name, _ in wanted]
    found = checksums.of_files(step_dir, names) if contents else _sizes(step_dir, names, listed)
    damaged = []
    for name, leaf in wanted:
        got, (nbytes, checksum) = found[name], listed[name]
        if got is None:
            why = "is missing"
        elif got[0] != nbytes:
            why = f"has {got[0]} bytes where {nbytes} were written"
        elif got[1] != checksum:
            why = f"has checksum {got[1]} where {checksum} was written"
        else:
            continue
        shown = "" if leaf is None else f"leaf {_leaf_name(leaf, leaves)!r}: "
        damaged.append(f"{shown}file {name} {why}")
    if damaged:
        more = f"; and {len(damaged) - 4} more" if len(damaged) > 4 else ""
        raise CheckpointError(
            f"{where_} is damaged, nothing restored: " + "; ".join(damaged[:4]) + more
        )


def _sizes(root: pathlib.Path, names, listed) -> dict:
    """``checksums.of_files``'s answer from a stat per file: the size found, the listed checksum."""
    out = {}
    for name in names:
        try:
            out[name] = (os.stat(root / name).st_size, listed[name][1])
        except FileNotFoundError:
            out[name] = None
    return out


def _while_checked(read, check):
    """``read()`` while ``check()`` runs on a thread (both read the same files, mostly from the
    page cache, and crc32 releases the GIL); the check's ``CheckpointError`` wins over whatever
    ``read`` returned or raised, so damaged bytes never reach the caller."""
    failed: list[CheckpointError] = []

    def run():
        try:
            check()
        except CheckpointError as error:
            failed.append(error)

    checker = threading.Thread(target=run, name="tenplex-checkpoint-check")
    checker.start()
    try:
        result = read()
    except BaseException as error:
        checker.join()
        if failed:
            raise failed[0] from error
        raise
    checker.join()
    if failed:
        del result  # the restored arrays hold damaged bytes
        raise failed[0]
    return result


def _leaf_name(orbax_name: str, leaves) -> str:
    if isinstance(leaves, dict):
        return leaves.get(orbax_name, orbax_name)
    return orbax_name.replace(".", "/")


def _orbax_name(key: str) -> str:
    """The directory orbax stores a leaf in (its nested keys joined by ".")."""
    return key.replace("/", ".")


def _orbax(read, item, step):
    """Run an orbax read; anything it raises on a checkpoint it cannot read is a CheckpointError."""
    try:
        return read()
    except CheckpointError:
        raise
    except Exception as error:  # orbax and tensorstore raise anything on bad files
        raise CheckpointError(
            f"checkpoint {item} (step {step}) cannot be read: {type(error).__name__}: {error}"
        ) from error


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
    """The tenplex record of a step, its fields checked (a wrong type is a damaged record)."""
    if not path.is_dir():
        return None
    record = _orbax(lambda: ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path), path, "?")
    problem = None
    if not isinstance(record, dict) or record.get("format") not in FORMATS:
        problem = f"the format is not one of {FORMATS}"
    elif type(record.get("step")) is not int or record["step"] < 0:
        problem = f"step {record.get('step')!r} is not an integer >= 0"
    elif not isinstance(record.get("ptc"), dict):
        problem = "it holds no PTC record"
    elif record.get("data_state") is not None:
        try:
            DataState.from_dict(record["data_state"])
        except DataError as error:
            problem = str(error)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a valid tenplex_jax checkpoint record: {problem}: {str(record)[:200]}"
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


def _mismatch_message(diff: str, target: PTC, found: list, stored: dict, prefix: str, item):
    """Every target leaf the checkpoint lacks or holds in another shape or dtype, and for a
    missing one, the checkpoint's paths that end as it does (a ``prefix=`` would map them)."""
    have = {leaf.path for leaf in found}
    missing = next((leaf for leaf in target.leaves if leaf.path not in have), None)
    end = None if missing is None else missing.path.split("/")[-1]
    near = [k for k in stored if end is not None and k.endswith(end)][:3]
    hint = f"; the checkpoint has similar paths {near} — pass prefix= to map them" if near else ""
    return (
        f"every target leaf must be in the checkpoint with the target's shape and dtype: {item} "
        f"(prefix {prefix!r}; {len(stored)} leaves, e.g. {list(stored)[:4]}) does not fit the "
        f"target on {target.config.describe()} over {list(target.device_ids)}: {diff}{hint}"
    )


def _plain_step(step_dir: pathlib.Path | None) -> int | None:
    if step_dir is None:
        return None
    try:
        return int(step_dir.name)
    except ValueError:
        return None
