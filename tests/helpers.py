"""Shared builders for the tests: a real NNX GPT + optax AdamW train state, the matrix of layout
changes every kind of state is resharded through, shard-by-shard checks, tensor store servers,
and the launched example job's events and uninterrupted reference run. The one module test files
share code through: no test file imports another."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import pathlib
import signal
import socket

import jax
import numpy as np
import optax
from flax import nnx

import tenplex_jax as tj
from tenplex_jax import ParallelConfig
from tenplex_jax._src.multihost.store import wire
from tenplex_jax.multihost import store
from tenplex_jax_benchmarks import reshard_methods
from tenplex_jax_models import (
    GPT,
    LOGICAL_RULES,
    GPTConfig,
    build_state,
    corpus_samples,
    stdlib_corpus,
    train_step,
)

RULES = LOGICAL_RULES
C = ParallelConfig
# (name, source config, source devices, target config, target devices[, failed devices]): the
# core changes the executor's benchmark times (benchmarks/reshard_methods.py), then more
MATRIX = [
    *reshard_methods.MATRIX,
    ("mixed with pipe", C(pipe=2, data=2, tensor=2), range(8), C(fsdp=4, tensor=2), range(8)),
    ("grow 2->8 reversed", C(fsdp=2), range(2), C(data=2, fsdp=2, tensor=2), range(7, -1, -1)),
    # failures: every box comes from a surviving replica, the failed device is never read
    ("fail dp 8->7", C(data=8), range(8), C(data=7), range(7), (7,)),
    (
        "fail dp2,fsdp4 -> tp2",
        C(data=2, fsdp=4),
        range(8),
        C(data=3, tensor=2),
        [0, 2, 3, 4, 5, 6],
        (1, 7),
    ),
    (
        "fail pipe2,dp2 -> pipe2",
        C(pipe=2, data=2, tensor=2),
        range(8),
        C(pipe=2, tensor=2),
        [0, 1, 6, 7],
        (2, 3),
    ),
]


@functools.cache
@contextlib.contextmanager
def reaped(proc):
    """Inside: ``proc``, a launcher a test started; on the way out, killed if it still runs
    (its own teardown reaps its children)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def tiny_step():
    """The elastic tests' user step for the tiny GPT: plain Flax NNX, no tenplex_jax inside but
    the batch's own gradient."""
    return train_step(build_state("tiny", 3e-3, abstract=True)[0])


def tiny_init():
    """The tiny GPT's AdamW train state, as a job's ``init`` (``tiny_step``'s state)."""
    return build_state("tiny", 3e-3)[1]


@functools.cache
def tiny_samples():
    """100 samples of 32 tokens for the tiny GPT: the elastic tests' dataset."""
    return corpus_samples(stdlib_corpus(2**20), seq_len=32, num_samples=100)


def train_state(cfg: GPTConfig | None = None, seed: int = 0, lr: float = 1e-2):
    """(model, optimizer) built on one device, not yet laid out."""
    with nnx.use_eager_sharding(False):
        model = GPT(cfg or GPTConfig.tiny(), rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    return model, optimizer


def abstract_state(cfg: GPTConfig | None = None):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: nnx.state(train_state(cfg)))


def host_copy(state) -> list[np.ndarray]:
    """Every leaf as a numpy array (PRNG keys as their key data), for exact comparisons."""
    out = []
    for leaf in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def assert_shards_equal(state, expected: list[np.ndarray], ptc) -> None:
    """Each addressable shard equals the expected global array at its index, on the PTC's
    devices."""
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(expected) == len(ptc.leaves)
    for array, want, layout in zip(leaves, expected, ptc.leaves):
        assert array.shape == want.shape[: array.ndim], layout.path
        assert {d.id for d in array.sharding.device_set} == set(ptc.device_ids), layout.path
        assert array.sharding.spec == layout.spec, layout.path
        for shard in array.addressable_shards:
            data = shard.data
            if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(data)
            np.testing.assert_array_equal(
                np.asarray(data), want[shard.index], err_msg=f"{layout.path} on {shard.device}"
            )


def minimum_bytes(src, dst, failed=()) -> int:
    """The fewest bytes any plan from ``src`` to ``dst`` must copy between devices: every target
    box less what its own device already holds of it (a failed device holds nothing)."""
    total = 0
    for s, d in zip(src.leaves, dst.leaves):
        held = {dev: box for dev, box in src.boxes(s).items() if dev not in failed}
        for dev, box in dst.boxes(d).items():
            own = held.get(dev)
            overlap = 0
            if own is not None:
                overlap = math.prod(
                    max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(own, box)
                )
            total += (math.prod(hi - lo for lo, hi in box) - overlap) * d.itemsize
    return total


def poison(state, devices) -> None:
    """Overwrite every buffer on ``devices`` with 0xFF bytes (NaN): a read of one would show."""
    for leaf in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            continue  # a key's buffer is not plain memory; keys are replicated and kept anyway
        for shard in leaf.addressable_shards:
            if shard.device.id in devices and shard.data.nbytes:
                raw = (ctypes.c_ubyte * shard.data.nbytes).from_address(
                    shard.data.unsafe_buffer_pointer()
                )
                np.frombuffer(raw, np.uint8)[:] = 0xFF


# -- a Flax Linen model with logical boxes --------------------------------------------------------


def linen_state(seed: int = 0, layers: int = 2):
    """``{"params", "opt_state"}`` of a small Linen language model and AdamW after one update.

    Weights carry ``nn.with_logical_partitioning`` boxes, its stacked layers (``nn.scan``) add the
    ``layers`` name, and one scale carries an ``nn.Partitioned`` box naming the mesh axis
    ``fsdp``; optax keeps the boxes on the moments. Names follow ``RULES``."""
    import flax.linen as nn

    normal = nn.initializers.normal(0.02)
    boxed = nn.with_logical_partitioning

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            up = nn.Dense(
                64,
                kernel_init=boxed(normal, ("embed", "mlp")),
                bias_init=boxed(nn.initializers.zeros, ("mlp",)),
            )
            down = nn.Dense(
                32,
                kernel_init=boxed(normal, ("mlp", "embed")),
                bias_init=boxed(nn.initializers.zeros, ("embed",)),
            )
            return x + down(nn.gelu(up(x))), None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(256, 32, embedding_init=boxed(normal, ("vocab", "embed")))
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = stack()(embed(tokens), None)
            scale = self.param(
                "scale", nn.with_partitioning(nn.initializers.ones, ("fsdp",)), (32,)
            )
            return embed.attend(x * scale)

    model = LM()
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    params = model.init(jax.random.key(seed), tokens)["params"]
    tx = optax.adamw(1e-2)
    grads = jax.grad(lambda p: model.apply({"params": p}, tokens).mean())(params)
    opt_state = tx.init(params)
    _, opt_state = tx.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state}


# -- the simulator's small cluster and state ---------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository
GB = 1e9


def sim_cluster(nodes: int = 2, per_node: int = 2, **extra) -> tj.planner.Cluster:
    """``nodes`` x ``per_node`` devices with round numbers: links 10 GB/s, NICs 1 GB/s per device,
    host links 2 GB/s, on-device copies 100 GB/s, storage 0.5 GB/s per node; ``extra`` replaces
    :class:`tenplex_jax.planner.Cluster` fields."""
    t = tj.planner.DeviceType(
        "gpu",
        memory=80 * 2**30,
        flops=1e14,
        link_bandwidth=10 * GB,
        host_bandwidth=2 * GB,
        memory_bandwidth=100 * GB,
    )
    n = nodes * per_node
    fields = {"storage_bandwidth": 0.5 * GB} | extra
    return tj.planner.Cluster(
        "test", (t,), (0,) * n, tuple(i // per_node for i in range(n)), 1 * GB, **fields
    )


def sim_ptc(config, devices, cluster, names=("embed", None)) -> tj.PTC:
    """One abstract float32 [8, 4] leaf laid out as ``config`` over cluster device ids (one host
    per node), split along the dim ``names`` calls ``"embed"`` (the rule: embed -> fsdp)."""
    with nnx.use_eager_sharding(False):
        leaf = nnx.Param(jax.ShapeDtypeStruct((8, 4), np.float32), out_sharding=names)
    hosts = [cluster.nodes[d] for d in devices]
    return tj.PTC.of(nnx.State({"w": leaf}), (("embed", "fsdp"),), config, devices, hosts=hosts)


# -- tensor store servers ------------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """The process's peak resident set size so far (bytes), from the kernel (VmHWM)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


class Stores:
    """Starts store servers; the fixture kills and reaps every one by PID."""

    def __init__(self, root: pathlib.Path):
        self.root, self.procs = root, []

    def start(self, name: str = "s0", **kwargs) -> store.StoreProcess:
        proc = store.StoreProcess.start(self.root / name, **kwargs)
        self.procs.append(proc)
        return proc

    def reap(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # a stopped (SIGSTOP) one dies too
            proc.popen.wait(timeout=30)


def raw_socket(address: str, hello: bool = True, token: str | None = None) -> socket.socket:
    """A connection to a store that speaks the wire protocol by hand: its hello sent and answered
    (none with ``hello=False``), as a hostile or a lost client would."""
    sock = socket.create_connection(store.parse_address(address), timeout=30)
    if hello:
        wire.send_frame(sock, {"op": "hello", "token": token})
        assert recv_frame(sock)[0]["ok"]
    return sock


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    """One frame from a store: its header and its body (fails if the store closed the socket)."""
    prefix = wire.recv_prefix(sock)
    assert prefix is not None, "the store closed the connection"
    header = wire.recv_header(sock, prefix[0], wire.MAX_RESPONSE_HEADER_BYTES)
    return header, bytes(wire.recv_exact(sock, prefix[1]))


# -- the launched example job (examples/elastic_gpt.py), as the launch and Ray tests run it --------

LAUNCH_BATCH, LAUNCH_GRAD_UNITS, LAUNCH_SAMPLES = 24, 8, 100


def events(run: pathlib.Path) -> list[dict]:
    """The launcher's events (``RUN_DIR/events.jsonl``) so far."""
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_run(steps: int):
    """``steps`` of the launched example's job in this one process on 8 devices, never
    interrupted: (final state on the host, the samples of every step, the abstract state)."""
    from tenplex_jax_models import build_state, corpus_samples, stdlib_corpus, train_step

    graphdef, abstract, cfg = build_state("tiny", 3e-3, 0, abstract=True)
    dataset = tj.DatasetPTC(
        corpus_samples(stdlib_corpus(2**20), cfg.seq_len, LAUNCH_SAMPLES), LAUNCH_BATCH
    )
    samples = []
    options = tj.elastic.JobOptions(compile_ahead=False)
    with tj.ElasticJob(
        LOGICAL_RULES, dataset, grad_units=LAUNCH_GRAD_UNITS, options=options
    ) as job:
        state = job.start(lambda: build_state("tiny", 3e-3, 0)[1])
        step = job.jit(train_step(graphdef))
        while job.step < steps:
            state, batch = job.next(state)
            samples.append(job.samples[job.samples >= 0])
            state, _ = step(state, batch)
    return host_copy(state), samples, abstract


# two nodes (meshes/hetpipe.toml's shape, two devices each): 2 fast devices, and 2 too small to
# hold a data-parallel replica of gpt100m
TWO_BY_TWO = """name = "two-by-two"
network_gbps = 7
[types.fast]
memory_gib = 24
tflops = 16
link_gbps = 12
[types.slow]
memory_gib = 6
tflops = 6.5
link_gbps = 12
[[nodes]]
type = "fast"
count = 2
[[nodes]]
type = "slow"
count = 2
"""
