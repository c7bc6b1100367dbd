"""PTC: layouts from logical axes, boxes that match JAX's own shardings, clear errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
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
    axes = data.draw(st.permutations(tj.ptc.MESH_AXES))
    spec = []
    for i, _ in enumerate(dims):
        spec.append(data.draw(st.sampled_from([None, axes[i], (axes[i], axes[-1])])))
    if len({a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}) < sum(
        len((e,) if isinstance(e, str) else e) for e in spec if e
    ):
        return  # a mesh axis used twice is not a valid spec
    leaf = tj.ptc.LeafLayout("x", tuple(d * 8 for d in dims), np.float32, P(*spec))
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


def test_bad_input_errors_name_leaf_shape_spec_and_mesh():
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("embed", "nope"))}
        twice = {"w": nnx.Param(np.zeros((4, 8), np.float32), out_sharding=("embed", "embed"))}
    # as in flax, a logical name without a rule leaves its dim replicated
    ptc = tj.PTC.of(state, (("embed", "fsdp"),), tj.ParallelConfig(fsdp=2), range(2))
    assert ptc.leaf("w").spec == P("fsdp", None)
    with pytest.raises(
        tj.errors.LayoutError, match=r"refuse the names \('embed', 'embed'\).*leaf 'w'.*shape=\(4, 8\)"
    ):
        tj.PTC.of(twice, (("embed", "fsdp"),), tj.ParallelConfig(fsdp=2), range(2))
    with pytest.raises(
        tj.errors.LayoutError, match=r"rule \('embed', 'model'\).*mesh axes \['model'\] that do not exist.*mesh axes are"
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
    with pytest.raises(tj.errors.LayoutError, match="axis=size"):
        tj.ParallelConfig.parse("model=2")


def test_parse_and_str_round_trip():
    config = tj.ParallelConfig.parse("data=2, tensor=4")
    assert config == tj.ParallelConfig(data=2, tensor=4) and config.num_devices == 8
    assert tj.ParallelConfig.parse(str(config)) == config


# -- a PTC describes the state as it is; relayout gives another layout of it -------------------


def test_a_placed_state_must_be_laid_out_as_its_ptc_says():
    model, optimizer = train_state()
    state = nnx.state((model, optimizer))
    ptc = tj.PTC.of(state, RULES, tj.ParallelConfig(data=2, tensor=4), jax.devices())
    placed = tj.place(state, ptc)
    assert tj.PTC.of(placed, RULES, ptc.config, jax.devices()) == ptc  # what is on the devices
    # the same spec on another mesh is another layout: the leaf, both specs and meshes are named
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"placed as P\('pipe', 'tensor'\) on mesh \{.*'tensor': 4\}.*the rules give "
        r"P\('pipe', 'tensor'\) on \{.*tensor: 1\}.*ptc\.relayout.*leaf '0/b1' \(shape=\(2, 64\)",
    ):
        tj.PTC.of(placed, RULES, tj.ParallelConfig(data=8), jax.devices())
    with pytest.raises(tj.errors.LayoutError, match=r"over devices \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        tj.PTC.of(placed, RULES, ptc.config, jax.devices()[::-1])  # another allocation
    assert tj.PTC.of(state, RULES, tj.ParallelConfig(data=8), jax.devices())  # unplaced: any


def test_the_same_boxes_written_another_way_are_the_layout_on_the_devices():
    with nnx.use_eager_sharding(False):
        state = {"w": nnx.Param(np.zeros((8, 4), np.float32), out_sharding=("embed", None))}
    ptc = tj.PTC.of(state, (("embed", ("fsdp", "tensor")),), tj.ParallelConfig(fsdp=4), range(4))
    assert ptc.leaf("w").spec == P(("fsdp", "tensor"), None)  # tensor has size 1
    mesh = ptc.mesh()
    state["w"].set_value(jax.device_put(state["w"].get_value(), NamedSharding(mesh, P("fsdp"))))
    assert tj.PTC.of(state, (("embed", ("fsdp", "tensor")),), ptc.config, range(4)) == ptc


def test_relayout_equals_a_ptc_of_the_abstract_state_and_keeps_the_rules():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=4), range(8))
    for config, devices in [(tj.ParallelConfig(fsdp=4), range(4, 8)), (CONFIGS[3], range(8))]:
        new = ptc.relayout(config, devices)
        assert new == tj.PTC.of(abstract_state(), RULES, config, devices)
        assert new.rules == ptc.rules
    wider = ptc.relayout(tj.ParallelConfig(tensor=3), range(3), allow_replicate=True)
    assert wider.leaf("0/w1").replicated == ((2, "tensor"),)
    with pytest.raises(tj.errors.LayoutError, match="does not divide"):
        ptc.relayout(tj.ParallelConfig(tensor=3), range(3))


def test_the_json_record_round_trips_and_refuses_another_state():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(fsdp=2, tensor=2), range(4),
                    hosts=[0, 0, 1, 1])  # fmt: skip
    import json

    back = tj.PTC.from_json(json.loads(json.dumps(ptc.to_json())), ptc)
    assert back == ptc and back.hosts == (0, 0, 1, 1) and back.rules == ptc.rules
    assert [leaf.logical for leaf in back.leaves] == [leaf.logical for leaf in ptc.leaves]
    assert back.relayout(tj.ParallelConfig(data=2), [5, 6]) == ptc.relayout(
        tj.ParallelConfig(data=2), [5, 6]
    )
    record = ptc.to_json()
    record["rules"] = None
    with pytest.raises(tj.errors.LayoutError, match="pass rules="):
        tj.PTC.from_json(record, ptc).relayout(tj.ParallelConfig(data=2), [5, 6])
    record["leaves"][3]["shape"][0] += 1
    with pytest.raises(tj.errors.PlanError, match=r"recorded leaf '0/\w+' float32"):
        tj.PTC.from_json(record, ptc)
