"""The default training corpus: the Python standard library's source, as bytes.

The standard library is real, varied text that every machine running the
project already has, so training needs neither network access nor a dataset
download. Files are read in sorted relative-path order, so the corpus is
identical on any machine with the same Python version.

Batches are a pure function of (corpus, step, global batch size, sequence
length, seed). They never depend on the device count or mesh layout, which is
what lets a job resume after resharding and see exactly the batches it would
have seen without the change.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig

import numpy as np

# Directory names whose contents are excluded: installed third-party packages
# and the test suites, whose fixtures are unlike ordinary code.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def _stdlib_files() -> list[pathlib.Path]:
    """The stdlib ``.py`` files to read, sorted by their path under the stdlib root.

    Excluded directories are pruned during the walk rather than filtered
    afterwards, since ``site-packages`` can dwarf the standard library itself.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _EXCLUDED_DIRS]
        directory = pathlib.Path(dirpath)
        for name in filenames:
            path = directory / name
            if name.endswith(".py") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


@functools.cache
def stdlib_corpus(max_bytes: int = 8 * 2**20) -> np.ndarray:
    """Return up to ``max_bytes`` of stdlib source as a read-only uint8 array.

    Cached per ``max_bytes`` because reading the tree takes a noticeable
    fraction of a second and callers ask for it repeatedly; the array is made
    read-only so that no caller can corrupt the shared copy.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_files():
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    if total == 0:
        raise ValueError(f"no .py files found under {sysconfig.get_paths()['stdlib']!r}")
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).copy()
    corpus.flags.writeable = False
    return corpus


def batch_at(
    corpus: np.ndarray,
    step: int,
    global_batch: int,
    seq_len: int,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Return the global batch for optimizer step ``step``.

    The batch holds ``global_batch`` random windows of ``seq_len + 1`` bytes;
    ``inputs`` are each window's first ``seq_len`` bytes and ``targets`` its
    last ``seq_len``. Offsets come from ``np.random.default_rng((seed, step))``
    so any step's batch can be regenerated directly, without replaying earlier
    steps, after a restart or a change of parallel configuration.
    """
    if corpus.ndim != 1:
        raise ValueError(f"corpus must be 1-D, got shape {corpus.shape}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if step < 0 or seed < 0:
        raise ValueError(f"step and seed must be >= 0, got step={step}, seed={seed}")
    if corpus.shape[0] < seq_len + 1:
        raise ValueError(
            f"corpus has {corpus.shape[0]} bytes, fewer than seq_len + 1 = {seq_len + 1}"
        )
    rng = np.random.default_rng((seed, step))
    offsets = rng.integers(0, corpus.shape[0] - seq_len, size=global_batch)
    windows = corpus[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(windows[:, :-1]),
        "targets": np.ascontiguousarray(windows[:, 1:]),
    }


def corpus_samples(
    corpus: np.ndarray, seq_len: int, num_samples: int | None = None
) -> dict[str, np.ndarray]:
    """The corpus cut into fixed samples: consecutive, non-overlapping windows of ``seq_len + 1``.

    Returns ``{"inputs": int32[N, seq_len], "targets": int32[N, seq_len]}`` for the first
    ``num_samples`` windows (all that fit by default): a dataset with a fixed number of samples,
    for a dataset PTC to permute and serve exactly once per epoch.
    """
    if corpus.ndim != 1:
        raise ValueError(f"corpus must be 1-D, got shape {corpus.shape}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    fit = corpus.shape[0] // (seq_len + 1)
    n = fit if num_samples is None else num_samples
    if not 1 <= n <= fit:
        raise ValueError(
            f"the corpus of {corpus.shape[0]} bytes holds 1 to {fit} windows of {seq_len + 1}, "
            f"asked for {num_samples}"
        )
    windows = corpus[: n * (seq_len + 1)].reshape(n, seq_len + 1).astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(windows[:, :-1]),
        "targets": np.ascontiguousarray(windows[:, 1:]),
    }
