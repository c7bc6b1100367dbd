"""Tests for the ``tenplex-jax`` command line: its commands' table and the ones packages add, plan
output, bad input, and both demo schedules end to end.

``plan`` runs in-process (it touches no device, so the shared 8-device backend is fine); the demo
runs in a subprocess because it configures JAX's platform and device count before JAX starts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

from tenplex_jax._src import cli
from tenplex_jax._src.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
# children import this worktree's tenplex_jax, not another installed copy
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def test_help_lists_the_commands_in_order_without_importing_jax() -> None:
    code = (
        "import sys; from tenplex_jax._src.cli import COMMANDS, main\n"
        "assert all(main([c, '--help']) == 0 for c in COMMANDS)\n"
        "assert main(['--help']) == 0 and 'jax' not in sys.modules, sorted(sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listed = done.stdout[done.stdout.rindex("commands:") :]
    places = [listed.find(f"\n    {name} ") for name in cli.COMMANDS]
    assert -1 not in places and places == sorted(places), listed


def test_a_package_adds_a_command_through_the_entry_point_group(monkeypatch, capsys) -> None:
    """An entry point in ``tenplex_jax.commands`` names an ``add_parser``: here ``plan``'s, taken
    out of the library's table; a package whose entry point does not load costs a warning."""
    from importlib import metadata

    points = [
        metadata.EntryPoint("plan", "tenplex_jax._src.cli.plan:add_parser", cli.GROUP),
        metadata.EntryPoint("broken", "no_such_package.cli:add_parser", cli.GROUP),
    ]
    monkeypatch.setattr(
        metadata, "entry_points", lambda group: points if group == cli.GROUP else []
    )
    monkeypatch.setattr(cli, "COMMANDS", tuple(c for c in cli.COMMANDS if c != "plan"))
    assert main(["plan", "--model", "tiny", "--from", "data=2", "--to", "data=1"]) == 0
    captured = capsys.readouterr()
    assert "totals: moved" in captured.out
    assert "warning: command broken (no_such_package.cli:add_parser)" in captured.err


def test_each_command_has_only_its_own_flags(capsys) -> None:
    """The demo's old modes are commands of their own: ``demo`` takes no trace, ``replay`` no
    schedule or step count (the trace gives them)."""
    for argv in (
        ["demo", "--trace", "meshes/philly.toml"],
        ["demo", "--wsp"],
        ["replay", "meshes/philly.toml", "--steps", "4"],
        ["replay", "meshes/philly.toml", "--schedule", "2:4"],
        ["replay"],
    ):
        assert main(argv) == 2, argv
        assert "usage: tenplex-jax" in capsys.readouterr().err


def _total(out: str) -> re.Match:
    """The plan summary's total line: leaves, MiB, kept MiB, moved MiB."""
    match = re.search(r"^\s+total\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", out, re.MULTILINE)
    assert match, out
    return match


def test_plan_prints_summary_with_total(capsys) -> None:
    argv = ["plan", "--model", "tiny", "--from", "data=8", "--to", "data=2,tensor=2"]
    assert main([*argv, "--to-devices", "2-5"]) == 0
    out = capsys.readouterr().out
    assert "data=8 on devices 0..7 -> data=2,tensor=2 on devices 2..5" in out
    total = _total(out)
    assert int(total[1]) > 0 and float(total[2]) > 0
    assert "totals: moved" in out


def test_identical_plan_moves_nothing(capsys) -> None:
    argv = ["plan", "--model", "tiny", "--from", "fsdp=2,tensor=2", "--to", "fsdp=2,tensor=2"]
    assert main([*argv, "--leaves"]) == 0
    out = capsys.readouterr().out
    assert float(_total(out)[4]) == 0.0
    assert "moved 0.000 MiB" in out
    assert "PTC fsdp=2,tensor=2 on devices [0, 1, 2, 3]" in out  # --leaves prints the target PTC


def test_bad_input_exits_2_with_the_reason(capsys) -> None:
    # tensor=3 divides none of the tiny model's tensor-sharded dims (vocab 256, mlp 64, heads 4).
    assert main(["plan", "--model", "tiny", "--from", "data=3", "--to", "tensor=3"]) == 2
    err = capsys.readouterr().err
    assert "does not divide" in err and "tensor" in err and "Traceback" not in err
    assert (
        main(
            ["plan", "--model", "tiny", "--from", "data=3", "--to", "tensor=3", "--allow-replicate"]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["plan", "--from", "data=two", "--to", "data=2"]) == 2
    assert "axis=size" in capsys.readouterr().err
    # a mesh of the user's own axes: the reference model's rules name axes it lacks
    assert main(["plan", "--from", "model=2", "--to", "data=2"]) == 2
    err = capsys.readouterr().err
    assert "that do not exist; mesh axes are ('model',)" in err and "leaf 'model/" in err
    assert main(["plan", "--from", "data=8", "--from-devices", "0-3", "--to", "data=4"]) == 2
    assert "needs 8 devices, got 4" in capsys.readouterr().err


def _demo(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``tenplex-jax demo ARGS --out tmp_path`` in a fresh process; (process, summary)."""
    cmd = [sys.executable, "-m", "tenplex_jax", "demo", *args, "--out", str(tmp_path)]
    done = subprocess.run(
        cmd, check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done, json.loads((tmp_path / "summary.json").read_text())


def test_the_default_demo_changes_data_expert_tensor_and_pipe_bitwise(tmp_path) -> None:
    """The default schedule's layouts on the MoE GPT, shortened: every dimension changes, every
    sample is trained once, and the state and losses are the fixed run's, bit for bit."""
    schedule = "0:data=2,expert=4; 2:expert=2,tensor=2; 4:pipe=2,data=3; 6:data=2,expert=4"
    done, summary = _demo(
        tmp_path,
        "--model",
        "moe-tiny",
        "--steps",
        "8",
        "--batch",
        "16",
        "--samples",
        "50",
        "--schedule",
        schedule,
    )
    assert summary["mode"] == "bitwise" and summary["schedule"] == schedule
    assert summary["initial"]["config"] == "data=2,expert=4"
    assert [(r["from_config"], r["to_config"], r["to"]) for r in summary["resizes"]] == [
        ("data=2,expert=4", "expert=2,tensor=2", 4),
        ("expert=2,tensor=2", "pipe=2,data=3", 6),
        ("pipe=2,data=3", "data=2,expert=4", 8),
    ]
    assert all(r["bytes_moved"] > 0 for r in summary["resizes"])
    assert summary["exactly_once"] is True and summary["samples_seen"] == 128
    assert summary["params_vs_fixed_run"] == "bitwise" and summary["not_bitwise"] is None
    assert summary["losses"] == summary["fixed_run_losses"]
    assert [r["bitwise"] for r in summary["resizes"]] == [True, True, True]
    assert "state vs a run without resizes: bitwise, losses bitwise" in done.stdout


def test_the_parallel_compute_demo_end_to_end(tmp_path) -> None:
    """``--no-bitwise`` through device counts the planner lays out (data and FSDP sizes): still
    bitwise equal to the fixed run, each sample once per epoch; run again with the first run's
    executable cache, it compiles and traces nothing and gives the bits."""
    args = ["--no-bitwise", "--model", "tiny", "--steps", "8", "--schedule", "2:4,4:6,6:8"]
    args += ["--batch", "16", "--samples", "50", "--executable-cache", str(tmp_path / "cache")]
    first = tmp_path / "first"
    done, summary = _demo(first, *args)
    assert summary["compiles"] > 0 and summary["mode"] == "parallel compute"
    assert "JobOptions.bitwise is off" in summary["not_bitwise"]
    assert [r["bitwise"] for r in summary["resizes"]] == [True] * 3  # data and FSDP sizes only
    _, rerun = _demo(tmp_path / "again", *args)
    assert rerun["compiles"] == 0 and rerun["loads"] > 0
    assert summary["traced"] > 0 and rerun["traced"] == 0  # a named step: nothing traced again
    assert rerun["losses"] == summary["losses"] and rerun["params_vs_fixed_run"] == "bitwise"
    assert [(r["from"], r["to"]) for r in summary["resizes"]] == [(8, 4), (4, 6), (6, 8)]
    assert [r["step"] for r in summary["resizes"]] == [2, 4, 6]
    for record in summary["resizes"]:
        assert record["bytes_moved"] + record["bytes_kept"] > 0
        assert len(record["to_devices"]) == record["to"]
    assert len(summary["losses"]) == summary["steps"] == 8
    assert math.isfinite(summary["final_loss"])
    assert (first / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step" in done.stdout and "->" in done.stdout  # the resize table
    # 8 steps of 16 over 50 samples: two full epochs and 28 samples, each seen once per epoch
    assert summary["exactly_once"] is True
    assert summary["samples_seen"] == summary["samples_expected"] == 128
    assert summary["params_vs_fixed_run"] == "bitwise"
    assert summary["data_state"]["consumed"] == 128
    assert len(summary["fixed_run_losses"]) == 8


def test_demo_rejects_a_batch_the_grad_units_do_not_divide(tmp_path, capsys) -> None:
    argv = ["demo", "--model", "tiny", "--batch", "12", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "8 gradient units must divide the global batch 12" in err
    assert not (tmp_path / "summary.json").exists()


def test_plan_with_a_cluster_prints_the_planner_table(capsys) -> None:
    argv = ["plan", "--cluster", str(ROOT / "meshes" / "hetpipe.toml"), "--devices", "8"]
    assert main([*argv, "--model", "gpt100m", "--batch", "32", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "planner: hetpipe" in out and "step ms" in out and "peak GiB" in out
    chosen = re.search(
        r"chosen: (\S+) with (\d+) microbatches, layers per stage \(([\d, ]+)\)", out
    )
    assert chosen, out
    layers = [int(n) for n in chosen[3].split(",")]
    assert sum(layers) == 16 and layers[0] > layers[-1]  # the fast GPUs come first, with more
    assert main([*argv[:3], "--devices", "99"]) == 2
    assert "cannot take 99" in capsys.readouterr().err
    assert main(["plan", "--cluster", "missing.toml"]) == 2
    assert "cannot read cluster description" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny"]) == 2
    assert "--from and --to, or --cluster" in capsys.readouterr().err


def test_the_demo_keeps_its_compiled_steps_in_its_output_folder_unless_told_otherwise():
    from tenplex_jax._src.cli.demo import executable_cache

    assert executable_cache(None, "out/demo") == pathlib.Path("out/demo/executables")
    assert executable_cache("none", "out/demo") is None
    assert executable_cache("cache", "out/demo") == pathlib.Path("cache")
