"""What a process remembers of the steps it lowered, so that it can load one again untraced.

A launched process that survives a change runs the user's script again from the top in its next
generation: a new ``train_step(graphdef)``, a new ``jax.jit``, and JAX's own caches, which key
on the function object, miss. Tracing and lowering a step is most of what such a process still
pays before its first step once the executable is on disk (the tiny GPT: 0.26 s tracing and
0.15 s lowering, against 0.08 s to load the executable). So each lowering is remembered here,
process-wide, under the program's *fingerprint* and its abstract inputs: the digest of the
program's text (the executable cache's key part that tracing decides) and the tree of its
outputs. A later lowering of the same program on the same layout, in this process, is then a
load from the executable cache with nothing traced.

The fingerprint is the semantics of ``jax.jit``'s own cache, stretched only as far as is safe:
the step function's code object by identity (a script run again compiles new code objects, so
a function it defines itself never matches its earlier self; one imported from a module does),
and what it closes over and its defaults, walked: functions again by code and closure (an optax
transformation is a tuple of closures over its hyperparameters), tuples, lists, mappings and
dataclasses (flax's ``GraphDef``) by their parts, NumPy arrays by their bytes, other objects by
their value hash, or by identity where they have none. An array on devices, a cycle or an
unhashable object leaves the program unknown: traced every time. Like ``jax.jit``, a program
reads a mutated global, or a mutated object known by identity, as it was when traced.

Across processes code has no identity but the one its user gives: a program named with
``job.jit(step, program=name)`` is known by that name instead (:func:`named`), and its key
(:func:`stable`) also finds the entry another process stored in the executable cache, so that a
new process (a replacement, a restarted job) loads its steps with nothing traced or lowered.
The name is the user's promise that the code is the same: a new name for new code.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What a program lowered to: its text's digest, its outputs' tree and how its trace took
    its gradients (a ``bitwise.Seen``: whether its changes are bitwise, known untraced); and,
    for a program lowered ahead on its layout's ``AbstractMesh`` (before the layout's devices
    existed: a planned growth), the ``Lowered`` itself, which compiles for the devices once
    they do, untraced (the text is the one a lowering on the devices gives: checked on jax 0.10
    and 0.12)."""

    digest: bytes
    out_tree: Any
    seen: Any = None
    lowered: Any = None


class _Same:
    """A key part equal only to the same object (a code object, kept alive with the key)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.value is self.value


_remembered: dict[tuple, Lowering] = {}  # oldest first
_lock = threading.Lock()
LIMIT = 256  # programs x layouts remembered; the oldest is forgotten first


def named(name: str) -> tuple:
    """The fingerprint of a program its user named: the name stands for the code."""
    return ("named", str(name))


def stable(key: tuple) -> bytes | None:
    """The digest of a named program's key (its name, layout and abstract inputs), which
    another process computes alike; None for a program known by the identity of its code or
    of an object in its inputs' trees (this process's only)."""
    if key[0][:1] != ("named",):
        return None
    text = repr(key)
    if " at 0x" in text:  # an object's default repr: its address
        return None
    return hashlib.sha256(text.encode()).digest()


def fingerprint(fn: Callable) -> tuple | None:
    """``fn``'s identity as a program across new function objects, or None (never remembered):
    not a plain Python function, or something it closes over that has no safe identity."""
    if not isinstance(fn, types.FunctionType):
        return None
    try:
        key = _canonical(fn, set())
        hash(key)
    except _Unknown:
        return None
    return key


class _Unknown(Exception):
    """A value with no safe identity across re-runs (an array on devices, an empty cell)."""


_VALUES = (type(None), bool, int, float, complex, str, bytes, type, enum.Enum)
_DEPTH = 64


def _canonical(value, seen: set[int]):
    """A hashable stand-in for ``value`` that is equal for values a trace cannot tell apart:
    functions by code object (identity) and what they close over, containers and dataclasses by
    their parts, host arrays by their bytes, other objects by their own hash if they have a value
    hash, else by identity."""
    if isinstance(value, _VALUES):
        # typed (1, 1.0 and True trace to other programs), floats by repr (0.0 and -0.0 too)
        return (type(value), repr(value) if isinstance(value, (float, complex)) else value)
    if id(value) in seen or len(seen) > _DEPTH:
        raise _Unknown  # a cycle, or too deep to be worth it
    seen = seen | {id(value)}
    if isinstance(value, types.FunctionType):
        try:
            cells = tuple(c.cell_contents for c in value.__closure__ or ())
        except ValueError:
            raise _Unknown from None
        parts = (cells, value.__defaults__, value.__kwdefaults__)
        return ("function", _Same(value.__code__), _canonical(parts, seen))
    if isinstance(value, functools.partial):
        parts = (value.func, value.args, value.keywords)
        return ("partial", _canonical(parts, seen))
    if isinstance(value, types.MethodType):
        return ("method", _canonical((value.__func__, value.__self__), seen))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_canonical(x, seen) for x in value))
    if isinstance(value, Mapping):
        items = tuple((_canonical(k, seen), _canonical(v, seen)) for k, v in value.items())
        return (type(value), items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), tuple(_canonical(getattr(value, f.name), seen) for f in fields))
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return ("ndarray", value.shape, value.dtype.str, digest)
    if isinstance(value, jax.Array):
        raise _Unknown  # on devices: not read here
    if type(value).__hash__ is None:
        raise _Unknown
    if type(value).__hash__ is object.__hash__:
        return ("same", _Same(value))
    return ("value", type(value), value)


def signature(tree) -> tuple:
    """The abstract inputs' part of a key: the tree and each leaf's shape, dtype and spec (not
    the mesh's devices: those are the executable cache key's, checked at every load)."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = tuple(
        (tuple(x.shape), str(x.dtype), getattr(getattr(x, "sharding", None), "spec", None))
        for x in leaves
    )
    return (treedef, specs)


def recall(key: tuple) -> Lowering | None:
    with _lock:
        return _remembered.get(key)


def remember(key: tuple, lowering: Lowering) -> None:
    with _lock:
        _remembered.pop(key, None)
        _remembered[key] = lowering
        while len(_remembered) > LIMIT:  # a key holds what the program closes over
            del _remembered[next(iter(_remembered))]


def forget() -> None:
    """Forget every program (a test's clean slate)."""
    with _lock:
        _remembered.clear()
