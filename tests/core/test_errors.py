"""Errors: one base class, kinds that keep their standard bases, messages that name what differs
between two trees and show a mesh with its axis types."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax._src import tree
from tenplex_jax._src.mesh import show_mesh

ERRORS = [c for _, c in inspect.getmembers(tj.errors, inspect.isclass) if issubclass(c, Exception)]


def test_every_error_kind_is_a_tenplex_error_and_keeps_its_standard_base():
    assert {c.__name__ for c in ERRORS} >= {
        "TenplexError",
        "LayoutError",
        "LeafNotFoundError",
        "DataError",
        "CheckpointError",
        "PlanError",
        "LostShardsError",
        "StoreError",
        "WSPError",
        "LaunchError",
    }
    assert all(issubclass(c, tj.errors.TenplexError) for c in ERRORS)
    for kind in (tj.errors.LayoutError, tj.errors.DataError, tj.errors.PlanError):
        assert issubclass(kind, ValueError)
    for kind in (tj.errors.StoreError, tj.errors.WSPError, tj.errors.LaunchError):
        assert issubclass(kind, RuntimeError)
    assert issubclass(tj.errors.LeafNotFoundError, KeyError)


def test_errors_the_library_raises_are_caught_as_tenplex_errors():
    ptc = tj.PTC.of({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}, (), tj.ParallelConfig(), [0])
    caught = []
    for raise_it in (
        lambda: tj.ParallelConfig.parse("data=two"),
        lambda: ptc.leaf("v"),
        lambda: tj.reshard({"w": jnp.zeros((8, 4))}, tj.make_plan(ptc, ptc), method="copy"),
        lambda: tj.restore_checkpoint("/nonexistent/tenplex", ptc),
    ):
        with pytest.raises(tj.errors.TenplexError) as error:
            raise_it()
        caught.append(type(error.value).__name__)
    assert caught == ["LayoutError", "LeafNotFoundError", "PlanError", "CheckpointError"]
    # the lookup error is also a KeyError whose message reads as written, and it names the path
    with pytest.raises(KeyError, match=r"^no leaf 'v' in this PTC; leaves: \['w'\]") as error:
        ptc.leaf("v")
    assert error.value.path == "v"


def test_a_shape_mismatch_names_the_path_and_both_shapes():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices())
    shard = lambda spec: NamedSharding(mesh, P(*spec))
    state = {
        "a": jax.device_put(jnp.zeros((8, 4)), shard(("data",))),
        "b": jax.device_put(jnp.zeros((8, 8)), shard((None, "tensor"))),
    }
    ptc = tj.PTC.from_shardings(state)
    grown = dict(state, b=jax.device_put(jnp.zeros((8, 16)), shard((None, "tensor"))))
    with pytest.raises(tj.errors.PlanError) as error:
        tj.reshard(grown, tj.make_plan(ptc, ptc))
    assert (
        "1 leaf is in both with another shape or dtype: 'b' is float32[8, 16] spec=P(None, "
        "'tensor') in the state, float32[8, 8] spec=P(None, 'tensor') in the PTC"
    ) in str(error.value)
    # a missing leaf and an extra one are named with their shapes, not only counted
    with pytest.raises(tj.errors.PlanError) as error:
        tj.place({"a": np.zeros((8, 4), np.float32), "c": np.zeros(3, np.float32)}, ptc)
    message = str(error.value)
    assert "(2 leaves vs 2;" in message, message
    assert "1 leaf is in the state, not in the PTC: 'c' float32[3]" in message, message
    assert "1 leaf is in the PTC, not in the state: 'b' float32[8, 8] spec=P(None, 'tensor')" in (
        message
    )


def test_the_difference_of_two_trees_names_missing_extra_changed_and_reordered_leaves():
    leaf = lambda path, shape=(2,), dtype="float32", spec=None: tree.Leaf(path, shape, dtype, spec)
    a = [leaf("x"), leaf("y", (4, 2)), leaf("z")]
    assert tree.difference(a, list(a), ("A", "B")) == ""
    assert tree.difference(a, [leaf("x"), leaf("y", (2, 4), spec=P("d"))], ("A", "B")) == (
        "1 leaf is in A, not in B: 'z' float32[2]; 1 leaf is in both with another shape or dtype: "
        "'y' is float32[4, 2] in A, float32[2, 4] spec=P('d',) in B"
    )
    assert tree.difference(a, a + [leaf(f"w{i}") for i in range(5)], ("A", "B"), show=2) == (
        "5 leaves are in B, not in A: 'w0' float32[2], 'w1' float32[2], and 3 more"
    )
    assert tree.difference(a, [a[1], a[0], a[2]], ("A", "B")) == (
        "the same paths in another order (or repeated): leaf 0 is 'x' in A, 'y' in B"
    )
    assert tree.difference(a, [leaf("x", dtype=np.dtype("int32"))], ("A", "B"), subset=True) == (
        "2 leaves are in A, not in B: 'y' float32[4, 2], 'z' float32[2]; 1 leaf is in both with "
        "another shape or dtype: 'x' is float32[2] in A, int32[2] in B"
    )
    # a dtype known only by name (a record's) is the same dtype; an unknown one is not compared
    assert tree.difference([leaf("x", dtype=np.dtype("float32"))], [leaf("x")], ("A", "B")) == ""
    assert tree.difference([leaf("x", dtype=None)], [leaf("x")], ("A", "B")) == ""


def test_a_mesh_in_a_message_shows_its_axis_types():
    explicit = jax.make_mesh(
        (2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()
    )
    assert show_mesh(explicit) == "Mesh('data': 2, 'tensor': 4; Explicit) over devices 0..7"
    assert show_mesh(explicit.abstract_mesh) == "AbstractMesh('data': 2, 'tensor': 4; Explicit)"
    mixed = tj.ParallelConfig.of(explicit, axis_types=(AxisType.Explicit, AxisType.Auto))
    assert show_mesh(mixed) == "Mesh('data': 2 Explicit, 'tensor': 4 Auto)"
    # an indivisible dim on the Explicit mesh: the error shows the mesh and its axis types
    state = {
        "w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 4), jnp.float32), ("rows", None))
    }
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"dim 0 of size 6 .*: leaf 'w' \(shape=\(6, 4\), spec=P\('tensor', None\), "
        r"mesh=Mesh\('data': 2, 'tensor': 4; Explicit\)\)$",
    ):
        tj.PTC.of(state, (("rows", "tensor"),), explicit)
    # and a batch laid out for another mesh
    with pytest.raises(
        tj.errors.DataError, match=r"the mesh Mesh\('data': 2, 'tensor': 4; Explicit\) has 2 over"
    ):
        tj.data.batch_value_and_grad(
            lambda m, b: b, tj.data.BatchLayout(8, ranks=4), explicit, batch_axes=("data",)
        )
