"""PTC: layouts from logical axes, boxes that match JAX's own shardings, clear errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from flax.linen import logical_to_mesh_axes
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax._src.mesh import MESH_AXES
from tenplex_jax_models import GPTConfig
from tests.helpers import RULES, abstract_state, train_state

CONFIGS = [
    tj.ParallelConfig(data=8),
    tj.ParallelConfig(fsdp=4, tensor=2),
    tj.ParallelConfig(data=2, fsdp=2, tensor=2),
    tj.ParallelConfig(data=2, tensor=2, pipe=2),
]


def test_specs_follow_logical_axes_and_optimizer_mirrors_params():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(fsdp=2, tensor=4), range(8))
    assert ptc.leaf("0/w1").logical == ("layers", "embed", "mlp")
    assert ptc.leaf("0/w1").spec == P("pipe", "fsdp", "tensor")
    assert ptc.leaf("0/tok_embed").spec == P("tensor", "fsdp")
    for moment in ("mu", "nu"):
        for leaf in ptc.leaves:
            if leaf.path.startswith("0/"):
                mirror = ptc.leaf(f"1/opt_state/0/{moment}/{leaf.path[2:]}")
                assert (mirror.spec, mirror.shape) == (leaf.spec, leaf.shape)


def test_scalars_and_rng_state_are_replicated():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=4), range(8))
    scalars = [leaf for leaf in ptc.leaves if leaf.shape == ()]
    assert {leaf.path for leaf in scalars} >= {"1/step", "1/opt_state/0/count"}
    assert all(leaf.spec == P() for leaf in scalars)
    model, optimizer = train_state()
    rngs = nnx.Rngs(0, dropout=1)
    live = tj.PTC.of((model, optimizer, rngs), RULES, tj.ParallelConfig(data=8), jax.devices())
    keys = [leaf for leaf in live.leaves if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)]
    assert keys and all(leaf.spec == P() and leaf.itemsize == 8 for leaf in keys)


def test_live_and_abstract_states_give_the_same_ptc():
    live = tj.PTC.of(train_state(), RULES, CONFIGS[2], jax.devices())
    abstract = tj.PTC.of(abstract_state(), RULES, CONFIGS[2], range(8))
    assert live == abstract
    assert live.nbytes == sum(
        np.asarray(x).nbytes for x in jax.tree.leaves(nnx.state(train_state()))
    )


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_boxes_equal_named_sharding_indices(config):
    devices = jax.devices()[::-1]  # a non-trivial allocation
    ptc = tj.PTC.of(abstract_state(), RULES, config, devices)
    mesh = ptc.mesh()
    for leaf in ptc.leaves:
        want = NamedSharding(mesh, leaf.spec).devices_indices_map(leaf.shape)
        want = {
            d.id: tuple(s.indices(n)[:2] for s, n in zip(idx, leaf.shape))
            for d, idx in want.items()
        }
        assert ptc.boxes(leaf) == want, leaf.path


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.sampled_from([(1, 1, 1, 1), (2, 1, 2, 2), (1, 4, 2, 1), (8, 1, 1, 1), (1, 2, 4, 1)]),
    dims=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=3),
    data=st.data(),
)
def test_boxes_property(sizes, dims, data):
    config = tj.ParallelConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2], pipe=sizes[3])
    axes = data.draw(st.permutations(MESH_AXES))
    spec = []
    for i, _ in enumerate(dims):
        spec.append(data.draw(st.sampled_from([None, axes[i], (axes[i], axes[-1])])))
    if len({a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}) < sum(
        len((e,) if isinstance(e, str) else e) for e in spec if e
    ):
        return  # a mesh axis used twice is not a valid spec
    leaf = tj.typing.LeafLayout("x", tuple(d * 8 for d in dims), np.float32, P(*spec))
    ptc = tj.PTC(config, tuple(range(config.num_devices)), (0,) * config.num_devices, (leaf,), None)
    mesh = config.make_mesh(jax.devices()[: config.num_devices])
    want = NamedSharding(mesh, leaf.spec).devices_indices_map(leaf.shape)
    want = {
        d.id: tuple(s.indices(n)[:2] for s, n in zip(idx, leaf.shape)) for d, idx in want.items()
    }
    assert ptc.boxes(leaf) == want


def test_first_unused_rule_wins_like_flax():
    rules = (("a", "tensor"), ("b", "tensor"), ("b", "fsdp"))
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("a", "b"))}
    ptc = tj.PTC.of(state, rules, tj.ParallelConfig(fsdp=2, tensor=2), range(4))
    assert ptc.leaf("w").spec == P("tensor", "fsdp")


def test_indivisible_dim_is_refused_with_leaf_dim_axis_and_sizes():
    with pytest.raises(tj.errors.LayoutError) as err:
        tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=3), range(6))
    msg = str(err.value)
    for part in (
        "does not divide",
        "'tensor'",
        "total size 3",
        "allow_replicate",
        "leaf '0/",
        "mesh=",
    ):
        assert part in msg, msg


def test_indivisible_dim_is_replicated_when_allowed():
    ptc = tj.PTC.of(
        abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=3), range(6), allow_replicate=True
    )
    heads = ptc.leaf("0/wq")  # (layers, embed, heads=4, kv): 4 heads do not split 3 ways
    assert heads.spec == P("pipe", "fsdp", None, None) and heads.replicated == ((2, "tensor"),)
    w1 = ptc.leaf("0/w1")  # d_ff=64: indivisible by 3 too
    assert w1.replicated == ((2, "tensor"),)
    assert ptc.leaf("0/tok_embed").spec == P(None, "fsdp")  # vocab 256 % 3 != 0


def test_rule_order_not_dim_order_decides_like_flax():
    # "mlp" has the first rule, so it takes tensor; "embed" then finds tensor used and replicates
    rules = (("mlp", "tensor"), ("embed", "tensor"))
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("embed", "mlp"))}
    ptc = tj.PTC.of(state, rules, tj.ParallelConfig(tensor=2), range(2))
    assert ptc.leaf("w").spec == P(None, "tensor") == logical_to_mesh_axes(("embed", "mlp"), rules)
    assert ptc.boxes(ptc.leaf("w")) == {0: ((0, 4), (0, 4)), 1: ((0, 4), (4, 8))}


def test_logical_axis_without_rule_is_replicated_like_flax():
    """flax (t5x, MaxText) replicates a dim whose logical name no rule maps; so does a PTC (the
    old PTC refused it)."""
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("embed", "nope"))}
    ptc = tj.PTC.of(state, (("embed", "fsdp"),), tj.ParallelConfig(fsdp=2), range(2))
    assert ptc.leaf("w").spec == P("fsdp", None)
    assert logical_to_mesh_axes(("embed", "nope"), (("embed", "fsdp"),)) == P("fsdp", None)
    assert ptc.leaf("w").logical == ("embed", "nope")


def test_bad_input_errors_name_leaf_shape_spec_and_mesh():
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("embed", "nope"))}
        bad = {"v": nnx.Param(np.zeros((4, 8, 2), np.float32), out_sharding=("embed", "nope"))}
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"logical axes \('embed', 'nope'\) name 2 dims but the leaf has 3: "
        r"leaf 'v' \(shape=\(4, 8, 2\), spec=\('embed', 'nope'\), mesh=Mesh\('pipe': 1, 'data': 1, "
        r"'fsdp': 2, 'tensor': 1; Auto\)\)$",
    ):
        tj.PTC.of(bad, (("embed", "fsdp"),), tj.ParallelConfig(fsdp=2), range(2))
    with pytest.raises(
        tj.errors.LayoutError, match=r"mesh axes \['model'\] that do not exist.*mesh axes are"
    ):
        tj.PTC.of(state, (("embed", "model"), ("nope", None)), tj.ParallelConfig(), range(1))
    with pytest.raises(tj.errors.LayoutError, match="at least one device"):
        tj.PTC.of(state, (("embed", None), ("nope", None)), tj.ParallelConfig(), [])
    with pytest.raises(tj.errors.LayoutError, match="needs 4 devices, got 2"):
        tj.PTC.of(state, (("embed", None), ("nope", None)), tj.ParallelConfig(data=4), range(2))
    with pytest.raises(tj.errors.LayoutError, match="distinct"):
        tj.PTC.of(state, (("embed", None), ("nope", None)), tj.ParallelConfig(data=2), [1, 1])
    with pytest.raises(tj.errors.LayoutError, match="integers >= 1"):
        tj.ParallelConfig(data=0)
    for text in ("model", "data=two", "data=2,data=4", ""):
        with pytest.raises(tj.errors.LayoutError, match="axis=size"):
            tj.ParallelConfig.parse(text)


def test_parse_and_str_round_trip():
    config = tj.ParallelConfig.parse("data=2, tensor=4")
    assert config == tj.ParallelConfig(data=2, tensor=4) and config.num_devices == 8
    assert tj.ParallelConfig.parse(str(config)) == config


# -- a PTC of a placed state describes the layout it has ------------------------------------------

PLACED = tj.ParallelConfig(data=2, tensor=4)
OTHER = tj.ParallelConfig(fsdp=2, tensor=4)


@pytest.fixture(scope="module")
def placed():
    """(state laid out as PLACED on all 8 devices, its PTC)."""
    ptc = tj.PTC.of(abstract_state(), RULES, PLACED, jax.devices())
    return tj.place(train_state(), ptc), ptc


def test_ptc_of_a_placed_state_under_another_layout_names_the_leaf_and_both_specs(placed):
    state, ptc = placed
    other = tj.PTC.of(abstract_state(), RULES, OTHER, jax.devices())
    first = next(b for a, b in zip(ptc.leaves, other.leaves) if ptc.boxes(a) != other.boxes(b))
    with pytest.raises(tj.errors.LayoutError) as err:
        tj.PTC.of(state, RULES, OTHER, jax.devices())
    msg = str(err.value)
    for part in (
        f"placed as {ptc.leaf(first.path).spec} on Mesh('pipe': 1, 'data': 2, 'fsdp': 1, "
        "'tensor': 4; Auto) over devices",
        f"the rules give {first.spec} on Mesh('pipe': 1, 'data': 1, 'fsdp': 2, 'tensor': 4; Auto)",
        f"leaf '{first.path}' (shape={first.shape}",
        "ptc.relayout(config, devices)",
    ):
        assert part in msg, msg
    # the same config over the devices in another order is another allocation: refused too
    with pytest.raises(tj.errors.LayoutError, match="must describe the layout it has"):
        tj.PTC.of(state, RULES, PLACED, jax.devices()[::-1])


def test_ptc_of_a_placed_state_in_its_own_layout_is_that_layout(placed):
    state, ptc = placed
    assert tj.PTC.of(state, RULES, PLACED, jax.devices()) == ptc
    assert tj.PTC.of(state, RULES, PLACED, [d.id for d in jax.devices()]) == ptc


def test_ptc_of_a_placed_state_accepts_an_equivalent_spelling():
    # placed with specs naming size-1 axes: P('pipe', 'fsdp', 'tensor') on pipe=fsdp=tensor=1 ...
    spelled = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=8), jax.devices())
    state = tj.place(train_state(), spelled)
    assert spelled.leaf("0/w1").spec == P("pipe", "fsdp", "tensor")
    # ... is the replicated layout that rules mapping nothing give: the same boxes on each device
    ptc = tj.PTC.of(state, (("embed", None),), tj.ParallelConfig(data=8), jax.devices())
    assert ptc.leaf("0/w1").spec == P(None, None, None)
    # and a user's own mesh with other axis names holding the same boxes is accepted as well
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    w = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(mesh, P("x", "y")))
    with nnx.use_eager_sharding(False):
        own = {"w": nnx.Param(w, out_sharding=("embed", "mlp"))}
    rules = (("embed", "data"), ("mlp", "tensor"))
    assert tj.PTC.of(own, rules, tj.ParallelConfig(data=2, tensor=4), jax.devices()).leaf(
        "w"
    ).spec == P("data", "tensor")
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"placed as P\('x', 'y'\) on Mesh\('x': 2, 'y': 4; Auto\) over devices",
    ):
        tj.PTC.of(own, rules[:1], tj.ParallelConfig(data=2, tensor=4), jax.devices())


def test_relayout_of_a_placed_state_gives_the_new_layout_and_a_plan_to_it(placed):
    _, ptc = placed
    new = ptc.relayout(OTHER, jax.devices()[::-1])
    assert new == tj.PTC.of(abstract_state(), RULES, OTHER, jax.devices()[::-1])
    assert new.rules == ptc.rules and new.allow_replicate is False
    moved, _ = tj.reshard(tj.place(train_state(), ptc), tj.make_plan(ptc, new))
    assert tj.PTC.of(moved, RULES, OTHER, jax.devices()[::-1]) == new
    # other rules for the same state: every leaf replicated
    flat = ptc.relayout(OTHER, jax.devices(), rules=())
    assert all(entry is None for leaf in flat.leaves for entry in leaf.spec)


def test_unplaced_and_abstract_states_take_any_layout(placed):
    _, ptc = placed
    assert tj.PTC.of(train_state(), RULES, OTHER, jax.devices()) == ptc.relayout(
        OTHER, jax.devices()
    )
    # an abstract state whose values carry PLACED's shardings describes no bytes: it is the
    # starting point of any new layout
    sharded = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_state(),
        ptc.shardings(),
    )
    assert jax.tree.leaves(sharded)[0].sharding.mesh.shape["data"] == 2
    assert tj.PTC.of(sharded, RULES, OTHER, range(8)) == ptc.relayout(OTHER, range(8))


# -- one JSON encoding
# ------------------------------------------------------------------------------


def test_json_round_trip_keeps_specs_logical_names_replicated_dims_rules_and_keys():
    model, optimizer = train_state()
    state = (model, optimizer, nnx.Rngs(0, dropout=1))
    config = tj.ParallelConfig(data=2, tensor=3)
    ptc = tj.PTC.of(state, RULES, config, range(6), hosts=[0, 0, 0, 1, 1, 1], allow_replicate=True)
    assert any(leaf.replicated for leaf in ptc.leaves)  # tensor=3 does not divide 4 heads
    assert any(jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in ptc.leaves)
    record = json.loads(json.dumps(ptc.to_json()))
    back = tj.PTC.from_json(record, like=ptc)
    assert back == ptc  # config, devices, hosts and every leaf (path, shape, dtype, spec, ...)
    assert [leaf.logical for leaf in back.leaves] == [leaf.logical for leaf in ptc.leaves]
    assert [leaf.replicated for leaf in back.leaves] == [leaf.replicated for leaf in ptc.leaves]
    assert back.rules == ptc.rules and back.allow_replicate
    assert back.treedef == ptc.treedef
    # read back, it lays the state out anew as the original would, indivisible dims included
    for target in (tj.ParallelConfig(fsdp=2, tensor=2), tj.ParallelConfig(tensor=3)):
        assert back.relayout(target, range(4, 4 + target.num_devices)) == ptc.relayout(
            target, range(4, 4 + target.num_devices)
        )


def test_json_of_another_state_is_refused_naming_the_leaf():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2), range(2))
    model, _ = train_state()
    model_only = tj.PTC.of(nnx.state(model), RULES, tj.ParallelConfig(data=2), range(2))
    with pytest.raises(
        tj.errors.PlanError,
        match=r"leaves are in the record, not in the state asked for: '0/\w+' .* leaves are in "
        r"the state asked for, not in the record: '\w+'",
    ):
        tj.PTC.from_json(ptc.to_json(), like=model_only)
    bigger = tj.PTC.of(
        abstract_state(dataclasses.replace(GPTConfig.tiny(), d_model=64)),
        RULES,
        ptc.config,
        range(2),
    )
    first = next(a for a, b in zip(ptc.leaves, bigger.leaves) if a.shape != b.shape)
    with pytest.raises(
        tj.errors.PlanError,
        match=rf"in both with another shape or dtype: '{first.path}' is float32\[.* in the "
        rf"record, float32\[",
    ):
        tj.PTC.from_json(ptc.to_json(), like=bigger)


def test_relayout_of_a_record_without_rules_asks_for_them():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2), range(2))
    record = ptc.to_json()
    record["rules"] = None  # as an older record, or one written by hand
    back = tj.PTC.from_json(record, like=ptc)
    with pytest.raises(tj.errors.LayoutError, match=r"knows no logical-axis rules.*pass rules="):
        back.relayout(tj.ParallelConfig(tensor=2), range(2))
    assert back.relayout(tj.ParallelConfig(tensor=2), range(2), rules=RULES) == ptc.relayout(
        tj.ParallelConfig(tensor=2), range(2)
    )


# -- bring your own mesh
# ----------------------------------------------------------------------------


def test_a_config_is_any_mesh_as_it_is():
    mesh = jax.make_mesh((2, 4), ("replica", "model"))  # Explicit axes by default in this jax
    config = tj.ParallelConfig.of(mesh)
    assert config.names == ("replica", "model") and config.sizes == (2, 4)
    assert config.axis_types == (AxisType.Explicit,) * 2
    assert config.make_mesh(list(mesh.devices.flat)) == mesh
    assert tj.ParallelConfig.of(mesh.abstract_mesh) == config
    auto = tj.ParallelConfig.of({"replica": 2, "model": 4})
    assert auto != config and auto.axis_types == (AxisType.Auto,) * 2
    assert tj.ParallelConfig.of(auto, axis_types=AxisType.Explicit) == config
    # the default axes as a mesh are the default config; absent default axes have size 1
    default = tj.ParallelConfig(data=2, tensor=4)
    assert tj.ParallelConfig.of(default.make_mesh(jax.devices())) == default
    assert (config.data, config.tensor, config.size("model")) == (1, 1, 4)
    # str shows the axes larger than 1 (and the types), describe every axis; JSON keeps all
    assert str(config) == "replica=2,model=4 [Explicit]" and str(default) == "data=2,tensor=4"
    assert config.describe() == "Mesh('replica': 2, 'model': 4; Explicit)"
    assert default.describe() == "Mesh('pipe': 1, 'data': 2, 'fsdp': 1, 'tensor': 4; Auto)"
    mixed = tj.ParallelConfig.of(mesh, axis_types=(AxisType.Explicit, AxisType.Auto))
    assert mixed.describe() == "Mesh('replica': 2 Explicit, 'model': 4 Auto)"
    assert repr(default) == "ParallelConfig(data=2, fsdp=1, tensor=4, pipe=1)"
    assert tj.ParallelConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert tj.ParallelConfig.parse("data=2,expert=4") == tj.ParallelConfig.of(
        {"data": 2, "expert": 4}
    )
    assert tj.ParallelConfig.parse("tensor=4,data=2") == default  # default names: default order
    with pytest.raises(tj.errors.LayoutError, match=r"integers >= 1, got x=0 in mesh \{'x': 0\}"):
        tj.ParallelConfig.of({"x": 0})
    with pytest.raises(tj.errors.LayoutError, match="non-empty strings"):
        tj.ParallelConfig.of({"": 2})
    with pytest.raises(tj.errors.LayoutError, match="Mesh, an AbstractMesh or a"):
        tj.ParallelConfig.of([("x", 2)])


def test_ptc_of_a_users_mesh_takes_its_devices_and_abstract_meshes_take_ids():
    mesh = jax.make_mesh((2, 2), ("batch", "model"), devices=jax.devices()[4:])
    rules = (("embed", "batch"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"))
    ptc = tj.PTC.of(abstract_state(), rules, mesh)
    assert ptc.device_ids == (4, 5, 6, 7) and ptc.mesh() == mesh
    assert ptc.leaf("0/w1").spec == P(None, "batch", "model")
    assert tj.PTC.of(abstract_state(), rules, mesh.abstract_mesh, range(4, 8)) == ptc
    assert ptc.relayout(mesh) == ptc
    with pytest.raises(tj.errors.LayoutError, match="a Mesh brings its own devices"):
        tj.PTC.of(abstract_state(), rules, mesh, range(4))
    with pytest.raises(tj.errors.LayoutError, match="needs its devices"):
        tj.PTC.of(abstract_state(), rules, mesh.abstract_mesh)


def test_ptc_from_shardings_reads_each_leafs_own_sharding():
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    state = {
        "w": jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("x", "y"))),
        "b": jax.device_put(np.ones((16,), np.float32), NamedSharding(mesh, P(("x", "y")))),
        "step": jax.device_put(np.int32(0), NamedSharding(mesh, P())),
    }
    ptc = tj.PTC.from_shardings(state)
    assert ptc.config == tj.ParallelConfig.of(mesh) and ptc.device_ids == tuple(range(8))
    assert [(leaf.path, leaf.spec) for leaf in ptc.leaves] == [
        ("b", P(("x", "y"))),
        ("step", P()),
        ("w", P("x", "y")),
    ]
    assert ptc.rules is None and all(leaf.logical is None for leaf in ptc.leaves)
    # the same from an abstract tree and one sharding for every leaf, or a prefix tree
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    one = NamedSharding(mesh, P())
    assert all(e is None for leaf in tj.PTC.from_shardings(abstract, one).leaves for e in leaf.spec)
    prefix = {"b": one, "step": one, "w": NamedSharding(mesh, P("x"))}
    assert tj.PTC.from_shardings(abstract, prefix).leaf("w").spec == P("x", None)
    # an abstract mesh names no devices: give their ids
    on_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh.abstract_mesh, s.spec)
        ),
        abstract,
        {k: v.sharding for k, v in state.items()},
    )
    with pytest.raises(tj.errors.LayoutError, match="needs its devices"):
        tj.PTC.from_shardings(on_abstract)
    assert tj.PTC.from_shardings(on_abstract, devices=range(8)) == ptc
    with pytest.raises(tj.errors.LayoutError, match="knows no logical-axis rules"):
        ptc.relayout(tj.ParallelConfig(data=8), range(8))


def test_ptc_from_shardings_refuses_leaves_off_the_mesh_or_on_two_meshes():
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    placed = jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P("x")))
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"needs a NamedSharding at every leaf, but leaf 'step' \(shape=\(\)\) has "
        r"SingleDeviceSharding.*jax.device_put\(x, NamedSharding\(mesh, P\(\)\)\)",
    ):
        tj.PTC.from_shardings({"w": placed, "step": jax.numpy.zeros((), np.int32)})
    other = jax.make_mesh((8,), ("z",))
    moved = jax.device_put(np.ones((8,), np.float32), NamedSharding(other, P("z")))
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"one mesh, but leaf 'a' is on Mesh\('x': 2, 'y': 4; Explicit\) over devices 0..7 "
        r"and leaf 'b' \(shape=\(8,\), spec=P\('z',\)\) on Mesh\('z': 8; Explicit\)",
    ):
        tj.PTC.from_shardings({"a": placed, "b": moved})
    with pytest.raises(tj.errors.LayoutError, match="tree shaped like the state or a prefix"):
        tj.PTC.from_shardings({"a": placed}, {"a": NamedSharding(mesh, P()), "c": None})


def test_a_linen_partitioned_box_names_mesh_axes_that_must_exist():
    import flax.linen as nn

    state = {"w": nn.Partitioned(jax.ShapeDtypeStruct((8, 4), np.float32), ("fsdp", None))}
    ptc = tj.PTC.of(state, (), tj.ParallelConfig(fsdp=2), range(2))
    assert ptc.leaf("w").spec == P("fsdp", None) and ptc.leaf("w").direct
    assert tj.PTC.from_json(ptc.to_json(), like=ptc).leaf("w").direct
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"nn.Partitioned names one mesh axis.*whose axes \['fsdp'\] the mesh lacks: "
        r"leaf 'w' \(shape=\(8, 4\)",
    ):
        tj.PTC.of(state, (), jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]))
