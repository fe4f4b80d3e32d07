"""`ligertune bench kernels` end to end on the CPU, through the typer app, at tiny odd shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ligertune.bench import kernels as bench_kernels
from ligertune.bench.problems import DIVERGENCE_FLOOR, Impl, divergence_problem, swiglu_problem
from ligertune.bench.shapes import FLOP_RATED, parse_shape
from ligertune.cli.bench import app
from ligertune.errors import UserError

TINY = ["--shapes", "flce:37x24x301", "--shapes", "divergence:37x24x301", "--shapes", "kl:37x24x301",
        "--shapes", "rms_norm:19x40", "--shapes", "rope:2x9x4x2x8", "--shapes", "swiglu:19x33",
        "--shapes", "geglu:19x33"]
KERNELS = ("flce", "divergence", "kl", "rms_norm", "rope", "swiglu", "geglu")
ROW_KEYS = {"kernel", "shape", "dims", "impl", "status", "detail", "median_ms", "min_ms", "max_ms", "repeats",
            "extra_peak_mib", "tflops", "gbps", "of_peak_bandwidth", "of_copy_bandwidth", "vs_ligertune", "errors"}
REPORT_KEYS = {"device", "device_type", "kernel_path", "dtype", "reference_dtype", "repeats", "warmup",
               "note", "versions", "date", "rows", "peak_gbps", "copy_gbps"}


def _invoke(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One CPU run of every kernel at tiny shapes, peers made absent, read back from its JSON."""
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    saved = {name: sys.modules.get(name, False) for name in ("liger_kernel", "cut_cross_entropy", "lion_pytorch")}
    for name in saved:
        sys.modules[name] = None
    try:
        result = _invoke(["kernels", *TINY, "--repeats", "2", "--warmup", "0", "--json", str(path)])
    finally:
        for name, module in saved.items():
            if module is False:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return result.output, json.loads(path.read_text())


def test_json_holds_every_number_with_its_context(report):
    _, data = report
    assert set(data) == REPORT_KEYS
    assert data["device_type"] == "cpu" and data["kernel_path"] == "reference"
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["ligertune"]
    assert {"liger-kernel", "cut-cross-entropy", "lion-pytorch", "triton", "transformers"} <= set(data["versions"])
    assert data["peak_gbps"] is None and data["copy_gbps"] is None  # a CPU: no roofline
    assert data["date"][:2] == "20"
    assert all(set(row) == ROW_KEYS for row in data["rows"])
    assert {row["kernel"] for row in data["rows"]} == set(KERNELS)
    shapes = {(row["kernel"], row["shape"]) for row in data["rows"]}
    assert shapes == {("flce", "N37-H24-V301"), ("divergence", "N37-H24-V301"), ("kl", "N37-H24-V301"),
                      ("rms_norm", "T19-H40"), ("rope", "B2-L9-Hq4-Hk2-D8"), ("swiglu", "T19-I33"),
                      ("geglu", "T19-I33")}


def test_measured_rows_carry_time_rate_speedup_and_small_errors(report):
    _, data = report
    measured = [row for row in data["rows"] if row["status"] == "ok"]
    # ligertune (3 rows for the loss, 2 for each divergence, 1 for each other kernel), eager for
    # each, and the three GEMM floors.
    assert len(measured) == 3 + 2 + 2 + 4 + 7 + 3
    for row in measured:
        assert row["median_ms"] > 0 and row["repeats"] == 2
        assert (row["tflops"] if row["kernel"] in FLOP_RATED else row["gbps"]) > 0
        if row["impl"].startswith("ligertune ("):
            assert row["vs_ligertune"] == 1.0
        if "floor" not in row["impl"]:
            # float32 against the float64 reference
            assert row["errors"] and all(0.0 <= e < 1e-5 for e in row["errors"].values()), row
    for kernel in FLOP_RATED:
        ours = (kernel, "ligertune (reference)")
        errors = next(r["errors"] for r in measured if (r["kernel"], r["impl"]) == ours)
        assert set(errors) == {"loss", "grad_hidden", "grad_weight"}
    floors = {r["kernel"]: r["impl"] for r in measured if "floor" in r["impl"]}
    assert floors == {"flce": "3 GEMMs (floor)", "divergence": "4 GEMMs (floor)", "kl": "4 GEMMs (floor)"}
    rope_errors = next(r["errors"] for r in measured if r["kernel"] == "rope")
    assert set(rope_errors) == {"q", "k", "grad_q", "grad_k"}


def test_absent_peers_and_compile_off_are_reported_not_raised(report):
    output, data = report
    by_impl = {(row["kernel"], row["impl"]): row for row in data["rows"]}
    for kernel in KERNELS:
        assert by_impl[(kernel, "liger")]["status"] == "not installed"
        assert by_impl[(kernel, "torch.compile")]["status"] == "skipped"
        assert by_impl[(kernel, "liger")]["median_ms"] is None
    assert by_impl[("flce", "cce")]["status"] == "not installed"
    assert by_impl[("flce", "cce exact")]["status"] == "not installed"
    assert "liger: not installed" in output
    assert "ligertune runs its pure-torch reference path" in output  # the CPU line above the tables


def test_bench_without_subcommand_runs_kernels(monkeypatch):
    import ligertune.cli.bench as cli

    called = []
    monkeypatch.setattr(cli, "kernels", lambda: called.append(True))
    result = CliRunner().invoke(cli.app, [])
    assert result.exit_code == 0, result.output
    assert called == [True]


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(app, ["kernels", *TINY, "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert "--plot needs matplotlib" in result.output
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--shapes", "flce:3x4"], "takes NxHxV", id="too-few-dims"),
        pytest.param(["--shapes", "gelu:3x4"], "KERNEL one of", id="unknown-kernel-in-shape"),
        pytest.param(["--kernels", "flce,gelu"], "unknown gelu", id="unknown-kernel"),
        pytest.param(["--device", "tpu"], "--device: must be", id="bad-device"),
        pytest.param(["--dtype", "int8"], "--dtype: must be", id="bad-dtype"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    result = CliRunner().invoke(app, ["kernels", *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    "text, want",
    [
        pytest.param("flce:8192x4096x128256", ("flce", (8192, 4096, 128256)), id="flce"),
        pytest.param("divergence:8192x4096x128256", ("divergence", (8192, 4096, 128256)), id="divergence"),
        pytest.param("rms-norm:7,13", ("rms_norm", (7, 13)), id="dash-and-comma"),
        pytest.param("rope:1x3x6x2x4", ("rope", (1, 3, 6, 2, 4)), id="rope"),
    ],
)
def test_parse_shape(text, want):
    assert parse_shape(text) == want


@pytest.mark.parametrize("text", ["rope:1x3x6x2x5", "rope:1x3x6x4x4", "swiglu:0x3", "swiglu:ax3", "flce"],
                         ids=["odd-D", "Hq-not-multiple", "zero", "letters", "no-colon"])
def test_parse_shape_rejects(text):
    with pytest.raises(UserError):
        parse_shape(text)


def test_a_row_that_writes_into_its_inputs_does_not_spoil_the_next():
    """A peer that modifies its inputs in place (as some fused ops do) must not change what later
    rows run on, nor their comparison with the reference."""
    problem = swiglu_problem({"T": 11, "I": 23}, torch.device("cpu"), torch.float32, seed=3)
    honest = problem.impls[1]

    def vandal(x):
        x["gate"].data.mul_(3.0)  # corrupts its own copy of the input on every call
        x["up"].data.add_(1.0)
        return honest.run(x)

    problem.impls = [Impl("ligertune (reference)", honest.run), Impl("vandal", vandal),
                     Impl("honest", honest.run)]
    rows = bench_kernels._run_problem(problem, "T11-I23", {}, torch.device("cpu"), torch.float64, repeats=2,
                                      warmup=1, use_compile=False, flush_l2=False, log=lambda _: None)
    errors = {row.impl: max(row.errors.values()) for row in rows}
    assert errors["vandal"] > 0.1
    assert errors["honest"] < 1e-6
    assert errors["ligertune (reference)"] < 1e-6


def test_divergence_problem_floor_runs_the_teacher_product_too():
    """The divergence problem's floor: the four products of a linear distillation loss, the teacher's
    logits among them, over as many rows as are supervised (an ignored row needs no logits); its
    eager row computes the reference's quantity (the JSD at beta 0.5, averaged over the supervised
    rows, which is what Liger's row computes)."""
    problem = divergence_problem({"N": 23, "H": 16, "V": 101}, torch.device("cpu"), torch.float64, seed=2)
    assert [impl.name for impl in problem.impls][-2:] == ["liger", DIVERGENCE_FLOOR]
    assert problem.flops == 8.0 * 23 * 16 * 101
    x = problem.inputs
    n = int((x["targets"] != -100).sum())
    assert 0 < n < 23
    floor = problem.impls[-1].run
    floor(x)
    assert floor.buffers["grad_h"].shape == (n, 16) and floor.buffers["dlogits"].shape == (n, 101)
    teacher_logits = x["teacher_hidden"][:n] @ x["teacher_weight"].T
    torch.testing.assert_close(floor.buffers["teacher_logits"], teacher_logits)
    torch.testing.assert_close(floor.buffers["logits"], x["hidden"].detach()[:n] @ x["weight"].detach().T)
    eager = next(impl for impl in problem.impls if impl.name == "torch eager")
    (want,) = problem.reference(x, "plain")
    (got,) = eager.run(x)
    assert (x["targets"] == -100).any() and want.item() > 0.0
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=0.0)


def test_triton_interpreter_path_on_cpu(tmp_path):
    """LIGERTUNE_KERNELS=triton with TRITON_INTERPRET=1 runs the Triton kernels on the CPU (in a fresh
    process: the interpreter must be chosen before triton is imported)."""
    out = tmp_path / "k.json"
    env = {**os.environ, "LIGERTUNE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    code = "from ligertune.cli.bench import app; app()"
    args = ["kernels", "-k", "swiglu,rms_norm", "--shapes", "swiglu:5x33", "--shapes", "rms_norm:5x40",
            "--repeats", "1", "--warmup", "0", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["kernel_path"] == "triton"
    assert "Triton interpreter" in data["note"]
    ours = [row for row in data["rows"] if row["impl"] == "ligertune (triton)"]
    assert len(ours) == 2
    assert all(row["status"] == "ok" and max(row["errors"].values()) < 1e-5 for row in ours)
