"""`ligertune bench kernels -k lion` on the CPU at tiny sizes: rows, bytes, errors, peers, roofline."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from ligertune.bench import kernels as bench_kernels
from ligertune.bench.kernels import KernelBenchConfig, run_kernel_bench, spec_memory_gbps
from ligertune.bench.problems import lion_shapes
from ligertune.bench.shapes import parse_shape
from ligertune.cli.bench import app
from ligertune.errors import UserError

SHAPE = "lion:2x24x40x53x2"
DIMS = {"L": 2, "H": 24, "I": 40, "V": 53, "E": 2}


def parameter_count(layers: int, hidden: int, width: int, vocab: int, embeddings: int) -> int:
    """Counted by hand: embeddings, and per layer q, o [H, H], k, v [H/4, H], gate, up, down, 2 norms."""
    per_layer = 2 * hidden * hidden + 2 * (hidden // 4) * hidden + 3 * width * hidden + 2 * hidden
    return embeddings * vocab * hidden + layers * per_layer + hidden


def run_lion(tmp_path, *args: str) -> dict:
    path = tmp_path / "lion.json"
    result = CliRunner().invoke(app, ["kernels", "-k", "lion", "--shapes", SHAPE, "--repeats", "2", "--warmup", "1",
                                      "--json", str(path), *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(path.read_text())
    data["output"] = result.output
    return data


def test_lion_shapes_are_a_llama_decoder():
    from transformers import LlamaConfig, LlamaForCausalLM

    for embeddings in (1, 2):
        config = LlamaConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, vocab_size=53, tie_word_embeddings=embeddings == 1)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        ours = lion_shapes({**DIMS, "E": embeddings})
        assert sorted(ours) == sorted(tuple(p.shape) for p in model.parameters())
    # The two GPU problems: Llama-3.2-1B (146 tensors) and Llama-3.1-8B (291), as published.
    one_b = lion_shapes(dict(zip("LHIVE", (16, 2048, 8192, 128256, 1))))
    eight_b = lion_shapes(dict(zip("LHIVE", (32, 4096, 14336, 128256, 2))))
    assert (len(one_b), sum(torch.Size(s).numel() for s in one_b)) == (146, 1_235_814_400)
    assert (len(eight_b), sum(torch.Size(s).numel() for s in eight_b)) == (291, 8_030_261_248)


def test_lion_rows_time_one_step_and_rate_it_in_bytes(tmp_path, no_peers):
    data = run_lion(tmp_path)
    rows = {row["impl"]: row for row in data["rows"]}
    assert list(rows) == ["ligertune (reference), m fp32", "torch foreach, m fp32", "lion-pytorch, m fp32",
                          "lion-pytorch foreach, m fp32", "lion-pytorch triton, m fp32"]
    n = parameter_count(2, 24, 40, 53, 2)
    for name in ("ligertune (reference), m fp32", "torch foreach, m fp32"):
        row = rows[name]
        assert row["status"] == "ok" and row["dims"] == DIMS
        # float32 p, g, m: 12 bytes read and 8 written per parameter.
        assert row["gbps"] == pytest.approx(20 * n / (row["median_ms"] * 1e-3) / 1e9)
        assert set(row["errors"]) == {"param", "momentum"}
        assert all(0 <= e < 1e-6 for e in row["errors"].values()), row
        assert row["of_peak_bandwidth"] is None and row["of_copy_bandwidth"] is None
    assert rows["ligertune (reference), m fp32"]["vs_ligertune"] == 1.0
    assert rows["torch foreach, m fp32"]["vs_ligertune"] == pytest.approx(
        rows["torch foreach, m fp32"]["median_ms"] / rows["ligertune (reference), m fp32"]["median_ms"])
    for name in ("lion-pytorch, m fp32", "lion-pytorch foreach, m fp32", "lion-pytorch triton, m fp32"):
        assert rows[name]["status"] == "not installed"
    assert "Lion optimizer step, in place" in data["output"]


def test_16_bit_parameters_add_a_ligertune_row_with_their_momentum(tmp_path, no_peers):
    data = run_lion(tmp_path, "--dtype", "bfloat16", "--peak-gbps", "50")
    rows = {row["impl"]: row for row in data["rows"] if row["status"] == "ok"}
    assert list(rows) == ["ligertune (reference), m fp32", "torch foreach, m fp32", "ligertune (reference), m bf16"]
    n = parameter_count(2, 24, 40, 53, 2)
    for name, per_parameter in (("ligertune (reference), m fp32", 14), ("ligertune (reference), m bf16", 10)):
        row = rows[name]
        assert row["gbps"] == pytest.approx(per_parameter * n / (row["median_ms"] * 1e-3) / 1e9)
        assert row["vs_ligertune"] == 1.0  # each the baseline of its momentum dtype
        assert row["of_peak_bandwidth"] == pytest.approx(row["gbps"] / 50)
        assert 0 < max(row["errors"].values()) < 1e-2  # bf16 storage, rounded once
    assert data["peak_gbps"] == 50 and data["copy_gbps"] is None
    assert "memory roofline: % peak of the data sheet's 50 GB/s" in data["output"]


class _FakeLion(torch.optim.Optimizer):
    """lion-pytorch's `Lion` as it is written (state created as zeros when empty, a per-tensor update)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, use_triton=False):
        assert not use_triton
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, (b1, b2) = group["lr"], group["weight_decay"], group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_(m.clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_(), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_lion_pytorch_rows_step_the_problems_tensors_with_its_state_seeded(tmp_path, monkeypatch):
    """With a stand-in for lion-pytorch (its API, its update), the peer rows run on the CPU and match
    the formula: their parameters share the problem's memory and their momentum is the problem's."""
    package, foreach = types.ModuleType("lion_pytorch"), types.ModuleType("lion_pytorch.foreach")
    package.Lion, foreach.Lion, package.foreach = _FakeLion, _FakeLion, foreach
    for name in ("liger_kernel", "cut_cross_entropy"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lion_pytorch", package)
    monkeypatch.setitem(sys.modules, "lion_pytorch.foreach", foreach)
    rows = {row["impl"]: row for row in run_lion(tmp_path)["rows"]}
    for name in ("lion-pytorch, m fp32", "lion-pytorch foreach, m fp32"):
        assert rows[name]["status"] == "ok", rows[name]
        # A step on copies, or from a zero momentum, would be off by about lr / |p| = 5e-3.
        assert max(rows[name]["errors"].values()) < 1e-6, rows[name]
        assert rows[name]["vs_ligertune"] == pytest.approx(
            rows[name]["median_ms"] / rows["ligertune (reference), m fp32"]["median_ms"])
    assert rows["lion-pytorch triton, m fp32"]["status"] == "skipped"
    assert rows["lion-pytorch triton, m fp32"]["detail"] == "needs CUDA"


def test_inputs_that_do_not_fit_are_one_failed_row(monkeypatch, no_peers):
    def too_big(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    monkeypatch.setitem(bench_kernels.PROBLEMS, "lion", too_big)
    report = run_kernel_bench(KernelBenchConfig(kernels=("lion", "swiglu"), shapes={"swiglu": [(5, 7)]},
                                                repeats=1, warmup=0))
    lion = [row for row in report.rows if row.kernel == "lion"]
    assert [(row.impl, row.status, row.detail) for row in lion] == [
        ("(inputs)", "failed", "out of memory drawing the inputs")]
    assert any(row.kernel == "swiglu" and row.status == "ok" for row in report.rows)


@pytest.mark.parametrize(
    "name, want",
    [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H200", 4800.0),
     ("NVIDIA GH200 480GB", 4000.0), ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-SXM4-40GB", 1555.0),
     ("Some Accelerator", None)],
)
def test_data_sheet_bandwidth_by_device_name(name, want):
    assert spec_memory_gbps(name) == want


def test_lion_shape_option():
    assert parse_shape("lion:16x2048x8192x128256x1") == ("lion", (16, 2048, 8192, 128256, 1))
    with pytest.raises(UserError, match="E, the embedding matrices"):
        parse_shape("lion:2x8x8x8x3")
    with pytest.raises(UserError, match="LxHxIxVxE"):
        parse_shape("lion:2x8x8x8")


def test_lion_is_run_only_when_named():
    assert "lion" not in KernelBenchConfig().kernels
