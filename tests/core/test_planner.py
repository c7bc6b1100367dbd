"""The planner: optimal on its cost model, within memory, proportional stages, clear refusals."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pathlib
import random

import pytest

import tenplex_jax as tj
from tenplex_jax._src.planner.search import _configs, _divisors
from tenplex_jax_models import GPTConfig, profile

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 2**30
C = tj.ParallelConfig


def _type(name, tflops, memory_gib=80.0, usd=1.0, link_gbps=100.0):
    return tj.planner.DeviceType(name, int(memory_gib * GIB), tflops * 1e12, link_gbps * 1e9, usd)


def _model(flops=(1e12,) * 8, param_bytes=50e6, act_bytes=200e6, out_bytes=4e6):
    layers = tuple(
        tj.planner.LayerProfile(f, int(param_bytes), int(act_bytes), int(out_bytes)) for f in flops
    )
    outside = tj.planner.LayerProfile(1e11, int(param_bytes), int(act_bytes), 0)
    return tj.planner.ModelProfile("m", layers, outside, (("tensor", "heads", 4),))


def _compositions(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _brute_force(cluster, model, batch, max_microbatches=64):
    """The best fitting step time over every config, microbatch count and stage split."""
    best = math.inf
    for config in _configs(cluster.num_devices):
        if config.pipe > model.num_layers:
            continue
        if any(size % getattr(config, axis) for axis, _, size in model.divides):
            continue
        replicas = config.data * config.fsdp
        if batch < replicas:
            continue
        micros = [1] if config.pipe == 1 else _divisors(-(-batch // replicas))
        for micro in (m for m in micros if m <= max_microbatches):
            for layers in _compositions(model.num_layers, config.pipe):
                c = tj.planner.estimate(
                    cluster, model, batch, config, micro, tj.pipelining.Stages(layers)
                )
                if c.fits:
                    best = min(best, c.step_time)
    return best


def _random_cluster(rng: random.Random) -> tj.planner.Cluster:
    types = tuple(
        _type(f"t{i}", rng.choice([10, 25, 40, 100]), rng.choice([3, 8, 16, 40]), link_gbps=50)
        for i in range(2)
    )
    n = rng.choice([2, 3, 4, 6, 8])
    kinds = tuple(rng.randrange(2) for _ in range(n))
    per_node = rng.choice([2, 4, 8])
    nodes = tuple(i // per_node for i in range(n))
    return tj.planner.Cluster("random", types, kinds, nodes, 5e9)


@pytest.mark.parametrize("seed", range(12))
def test_planner_is_optimal_against_brute_force_on_random_small_clusters(seed):
    rng = random.Random(seed)
    cluster = _random_cluster(rng)
    layers = rng.choice([3, 4, 5, 6])
    # layers of unequal cost, so the stage split is a real optimisation
    model = _model(flops=tuple(rng.choice([0.5e12, 1e12, 2e12]) for _ in range(layers)))
    batch = rng.choice([8, 12, 16, 24])
    want = _brute_force(cluster, model, batch)
    if math.isinf(want):
        with pytest.raises(tj.errors.PlanError, match="no parallel config"):
            tj.planner.choose(cluster, model, batch)
        return
    choice = tj.planner.choose(cluster, model, batch)
    assert choice.best.step_time == pytest.approx(want, rel=1e-9)
    assert choice.best.fits
    # the reported candidate is what estimate() says about it
    again = tj.planner.estimate(
        cluster,
        model,
        batch,
        choice.best.config,
        choice.best.microbatches,
        choice.best.stages,
    )
    assert again.step_time == pytest.approx(choice.best.step_time, rel=1e-12)


def test_every_candidate_fits_memory_and_a_tighter_limit_changes_the_choice():
    model = _model()
    roomy = tj.planner.Cluster.uniform(8, _type("big", 100, memory_gib=80))
    choice = tj.planner.choose(roomy, model, 64)
    assert all(c.fits for c in choice.top)
    assert choice.best.config.pipe == 1  # with room to spare, no pipeline bubble is worth paying
    # just below the chosen layout's peak: it no longer fits, and the planner finds one that does
    limit = max(choice.best.memory) - 1
    tight = tj.planner.Cluster.uniform(8, dataclasses.replace(roomy.types[0], memory=limit))
    second = tj.planner.choose(tight, model, 64)
    assert second.best.label() != choice.best.label()
    assert max(second.best.memory) <= limit
    assert any("peak memory" in rule for rule, _, _ in second.rejected)
    assert "peak memory" in str(second)


@pytest.mark.parametrize("speeds, layers, want", [((3, 1), 8, (6, 2)), ((2, 1), 9, (6, 3))])
def test_heterogeneous_stages_get_layers_in_proportion_to_speed(speeds, layers, want):
    types = tuple(_type(f"s{s}", 10 * s) for s in speeds)
    cluster = tj.planner.Cluster("het", types, (1, 0), (0, 1), 1e9)  # slow device listed first
    model = _model(flops=(1e12,) * layers, out_bytes=1e3)
    choice = tj.planner.choose(cluster, model, 16, configs=[C(pipe=2)])
    assert choice.best.stages.layers == want
    fast = cluster.kinds.index(0)
    assert choice.best.devices[0] == fast  # the fast device runs stage 0, which has more layers


def test_cost_objective_rents_the_devices_with_most_samples_per_dollar():
    cheap = _type("cheap", 50, usd=1.0)  # 50 TFLOP/s per $
    dear = _type("dear", 100, usd=4.0)  # 25 TFLOP/s per $
    cluster = tj.planner.Cluster(
        "mix", (dear, cheap), (0,) * 4 + (1,) * 4, (0,) * 4 + (1,) * 4, 10e9
    )
    model = _model()
    fastest = tj.planner.choose(cluster, model, 64)
    assert len(fastest.best.devices) == 8  # the time objective uses every device it was given
    frugal = tj.planner.choose(
        cluster, model, 64, objective="cost", min_throughput=0.35 * fastest.best.throughput
    )
    assert frugal.best.samples_per_usd > fastest.best.samples_per_usd
    assert {cluster.kinds[d] for d in frugal.best.devices} == {1}
    assert frugal.best.throughput >= 0.35 * fastest.best.throughput
    # the time objective may also leave devices idle when asked: never slower than all of them
    subset = tj.planner.choose(cluster, model, 64, subsets=True)
    assert subset.best.step_time <= fastest.best.step_time
    with pytest.raises(tj.errors.PlanError, match="usd_per_hour"):
        free = dataclasses.replace(
            cluster, types=(dataclasses.replace(dear, usd_per_hour=0), cheap)
        )
        tj.planner.choose(free, model, 64, objective="cost")


def test_no_config_fits_memory_is_a_clear_error():
    cluster = tj.planner.Cluster.uniform(4, _type("tiny", 100, memory_gib=0.1))
    with pytest.raises(tj.errors.PlanError, match=r"peak memory must fit .*GiB > 0.10 GiB"):
        tj.planner.choose(cluster, _model(), 64)


def test_more_stages_than_layers_is_refused():
    cluster = tj.planner.Cluster.uniform(4, _type("d", 100))
    with pytest.raises(
        tj.errors.PlanError, match=r"at most one pipeline stage per layer.*4 stages for 2"
    ):
        tj.planner.choose(cluster, _model(flops=(1e12, 1e12)), 8, configs=[C(pipe=4)])
    with pytest.raises(tj.errors.LayoutError, match="2 layers do not split evenly into 4"):
        tj.pipelining.Stages.even(2, 4)
    with pytest.raises(tj.errors.LayoutError, match="at least one layer"):
        tj.pipelining.Stages((2, 0))


def test_unknown_device_type_and_bad_fields_in_a_cluster_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        '[types.a]\nmemory_gib = 8\ntflops = 1\nlink_gbps = 1\n[[nodes]]\ntype = "b"\ncount = 2\n'
    )
    with pytest.raises(tj.errors.PlanError, match=r"node 0 has unknown device type 'b'.*\['a'\]"):
        tj.planner.Cluster.load(path)
    path.write_text(
        '[types.a]\nmemory_gib = 8\ntflop = 1\nlink_gbps = 1\n[[nodes]]\ntype = "a"\ncount = 2\n'
    )
    with pytest.raises(tj.errors.PlanError, match="unknown fields"):
        tj.planner.Cluster.load(path)
    with pytest.raises(tj.errors.PlanError, match="cannot read"):
        tj.planner.Cluster.load(tmp_path / "missing.toml")


@pytest.mark.parametrize("name", ["8xh100", "hetpipe", "cpu8", "cloud-mix"])
def test_mesh_presets_load(name):
    cluster = tj.planner.Cluster.load(ROOT / "meshes" / f"{name}.toml")
    assert cluster.num_devices >= 8
    if name == "cloud-mix":
        assert all(t.usd_per_hour > 0 for t in cluster.types)


def test_hetpipe_preset_pipelines_with_more_layers_on_the_fast_gpus():
    cluster = tj.planner.Cluster.load(ROOT / "meshes" / "hetpipe.toml")
    choice = tj.planner.choose(cluster, profile(GPTConfig.gpt100m()), 32)
    best = choice.best
    assert best.config.pipe > 1
    fast = [s for s, lim in zip(best.stages.layers, best.memory_limit) if lim > 6 * GIB]
    slow = [s for s, lim in zip(best.stages.layers, best.memory_limit) if lim <= 6 * GIB]
    assert min(fast) > max(slow)


def test_gpt_profile_matches_the_model():
    cfg = GPTConfig.small()
    prof = profile(cfg)
    d, f, t = cfg.d_model, cfg.d_ff, cfg.seq_len
    per_layer_params = 4 * d * d + 2 * d * f + f + 3 * d
    assert prof.layers[0].param_bytes == 4 * per_layer_params
    assert prof.num_layers == cfg.n_layers
    # forward matmul FLOPs per sample: 2 per weight and token, plus attention scores and values
    matmuls = 2 * t * (4 * d * d + 2 * d * f) + 4 * t * t * d
    assert matmuls <= prof.layers[0].flops <= 1.2 * matmuls
    assert prof.layers[0].out_bytes == 4 * t * d
    assert prof.layers[0].act_bytes > prof.layers[0].out_bytes
