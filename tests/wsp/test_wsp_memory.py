"""Hydrozoa's memory and data path: XLA's numbers for a VW's program, a VW over its devices' memory
refused, a monitor of each VW's peak, the planner's search of the batch size under the devices'
memory, and the data-prefetch thread (which changes nothing a VW trains)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.wsp.batches import search_minibatch
from tenplex_jax._src.wsp.memory import MemoryMonitor, MemoryUse
from tenplex_jax.errors import PlanError, WSPError
from tenplex_jax.planner import Cluster, DeviceType, LayerProfile, ModelProfile
from tenplex_jax.wsp import ParameterServer, plan_workers, weights_of
from tenplex_jax_models import wsp as job_parts

GIB = 2**30


def test_memory_use_is_xlas_buffer_assignment_of_the_compiled_program():
    x, w = jnp.ones((64, 512), jnp.float32), jnp.ones((512, 256), jnp.float32)
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w).sum()).lower(x, w).compile()
    use = MemoryUse.of(compiled)
    assert use.arguments == (64 * 512 + 512 * 256) * 4 and use.outputs == 4
    assert use.peak >= use.arguments + use.outputs - use.aliased
    assert MemoryUse.of(object()) is None  # an executable without an analysis: unknown


@pytest.mark.parametrize("devices", [2, 4])  # data parallel: the step; pipelined: the wave
def test_a_vw_over_its_memory_limit_is_refused_naming_vw_stage_batch_bytes_and_limit(devices):
    parts = job_parts.job(devices)  # 4 devices: two stages, each wave one program
    ids = list(range(devices))
    with pytest.raises(WSPError) as refused:
        job_parts.virtual_worker(
            parts, "vw7", ids, ["127.0.0.1:1"], parts["init"](), minibatches=2, memory_limit=100_000
        )
    message = str(refused.value)
    assert refused.value.reason == "memory"
    stages = f"stages 0..{parts['config'].pipe - 1}"
    for said in ("'vw7'", stages, "minibatch 8", "over the limit of 100,000 bytes"):
        assert said in message, message
    needed = int(message.split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 100_000  # the bytes it named are over the limit it named
    with pytest.raises(WSPError, match="memory_limit is bytes >= 1 or None, got 0"):
        tj.wsp.WorkerOptions(memory_limit=0)


def test_the_monitor_reports_the_peak_of_its_devices_and_raises_over_the_limit():
    device = jax.devices()[7]
    program = MemoryUse(arguments=0, outputs=0, temporaries=1000, aliased=0, code=0, peak=1000)
    monitor = MemoryMonitor("vw3", [device], program, limit=64 * 2**20, batch=8)
    before = monitor.observe()
    block = jax.device_put(np.ones(2**20, np.float32), device)  # 4 MiB on the VW's device
    during = monitor.observe()
    assert during - before >= block.nbytes and monitor.peak >= during
    del block
    assert monitor.observe() < during and monitor.peak >= during  # the peak stays
    monitor.limit = during - 1
    big = jax.device_put(np.ones(2**20, np.float32), device)
    with pytest.raises(WSPError, match=r"'vw3' .* at minibatch 8 needs [\d,]+ bytes") as over:
        monitor.observe()
    assert over.value.reason == "memory" and f"limit of {during - 1:,} bytes" in str(over.value)
    del big
    with pytest.raises(WSPError, match="over the limit of 10 bytes"):
        MemoryMonitor("vw4", [device], program, limit=10)  # refused before it trains


def _cluster(memory_gib: float) -> tuple[Cluster, ModelProfile]:
    small = DeviceType("small", memory=int(memory_gib * GIB), flops=10e12, link_bandwidth=10e9)
    layer = LayerProfile(flops=2e9, param_bytes=20_000_000, act_bytes=8_000_000, out_bytes=10**6)
    profile = ModelProfile("toy", (layer,) * 8, LayerProfile(1e8, 10**7, 10**5, 0))
    return Cluster.uniform(4, small, per_node=2), profile


@pytest.mark.parametrize("memory_gib", [1.0, 2.0, 8.0])
def test_the_batch_search_keeps_the_fastest_size_that_fits_and_names_each_refusal(memory_gib):
    cluster, profile = _cluster(memory_gib)
    sizes = (2, 8, 32, 128, 512)
    found = search_minibatch(cluster, profile, sizes)
    fits = {}
    for b in sizes:  # brute force: each size planned on its own
        try:
            fits[b] = plan_workers(cluster, profile, b).throughput
        except PlanError:
            fits[b] = None
    assert found.minibatch == max((b for b in sizes if fits[b]), key=lambda b: fits[b])
    assert [t.minibatch for t in found.tries] == list(sizes)
    for t in found.tries:
        assert (t.refused == "") == (fits[t.minibatch] is not None)
        if t.refused:  # the VW, its stage, the batch, the bytes needed and the limit
            needed = int(t.refused.split(" needs ")[1].split(" bytes")[0].replace(",", ""))
            limit = int(t.refused.split("limit of ")[1].split(" bytes")[0].replace(",", ""))
            assert needed > limit == int(memory_gib * GIB)
            assert f"at minibatch {t.minibatch} VW " in t.refused and " stage " in t.refused
        else:
            assert t.throughput == pytest.approx(fits[t.minibatch])
    assert any(t.refused for t in found.tries) == (memory_gib < 8.0)
    assert "chosen" in str(found)


def test_the_batch_search_refuses_bad_sizes_and_a_cluster_too_small_for_any():
    cluster, profile = _cluster(1.0)
    with pytest.raises(PlanError, match=r"ints >= 1, got \[0, 4\]"):
        search_minibatch(cluster, profile, [0, 4])
    tiny, _ = _cluster(0.01)
    with pytest.raises(
        PlanError, match="no minibatch size fits the devices' memory: 8: a VW's stages"
    ):
        search_minibatch(tiny, profile, [8])


def _train(addresses, parts, state, total: int, prefetch: bool):
    """One VW of ``Nm = 2`` on devices 0 and 1 training ``total`` minibatches: its records, its
    weights, the ledger, its prefetcher's counts."""
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(state), total=total)
        vw = job_parts.virtual_worker(
            parts, "vw1", [0, 1], addresses, state, minibatches=2, prefetch=prefetch
        )
        records = vw.run()
        counts = None if vw.prefetcher is None else (vw.prefetcher.hits, vw.prefetcher.misses)
        peak = vw.memory.peak
        return records, ps.pull(ps.ledger()), ps.history(), counts, peak


def test_prefetching_trains_the_same_minibatches_and_weights_bit_for_bit(stores):
    parts = job_parts.job(2)
    state, total = parts["init"](), 12
    runs = []
    for prefetch in (False, True):
        addresses = [stores.start(f"{prefetch}{i}").address for i in range(2)]
        runs.append(_train(addresses, parts, state, total, prefetch))
    (plain, w_plain, _, none, _), (pre, w_pre, led_pre, counts, peak) = runs
    assert none is None and counts[0] >= total - 4  # all but the first waves' came placed
    assert sorted(led_pre.trained()) == list(range(total))  # each minibatch once
    assert [r.minibatches for r in pre] == [r.minibatches for r in plain]
    layout = tj.data.BatchLayout(8, ranks=2)
    for record in pre:  # the data order: each wave trained its minibatches' samples
        expect = [parts["dataset"].samples(k, layout)[0] for k in record.minibatches]
        assert list(record.samples) == [int(s) for rows in expect for s in rows if s >= 0]
    for path in w_plain:
        np.testing.assert_array_equal(w_pre[path], w_plain[path])
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(weights_of(state)))
    assert peak >= state_bytes // 2  # per device: at least its half of the replicated weights


def test_a_vw_process_takes_the_memory_limit_and_prefetch_from_its_command_line(stores, tmp_path):
    import subprocess
    import sys

    addresses = [stores.start(f"s{i}").address for i in range(2)]
    parts = job_parts.job(2)
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=6)
        command = [sys.executable, "-m", "tenplex_jax.wsp", "--job", "tenplex_jax_models.wsp:job"]
        command += ["--devices", "2", "--stores", ",".join(addresses), "--minibatches", "2"]
        runs = {}
        for name, more in (("vw1", ["--memory-limit", "1000"]), ("vw2", ["--prefetch"])):
            proc = subprocess.Popen(
                [*command, "--name", name, *more], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            try:
                out, _ = proc.communicate(timeout=300)
            finally:
                if proc.poll() is None:  # reaped by PID, whatever happened
                    proc.kill()
                    proc.wait()
            runs[name] = (proc.returncode, out.decode())
        ledger = ps.history()
    code, out = runs["vw1"]
    assert code != 0 and "'vw1'" in out and "over the limit of 1,000 bytes" in out, out
    code, out = runs["vw2"]
    assert code == 0 and "memory: peak " in out, out
    assert sorted(ledger.trained()) == list(range(6)) and set(ledger.starts) == {"vw2"}
