"""scripts/multi_gpu.py, the multi-GPU measurements in one command.

The script is run whole in its `--tiny` mode (every part: verify-loss, the scaling runs, the
sharded run with its checkpoint and resume; a tiny model, 2 gloo processes, about 2 minutes on 2
cores), and the figures it reports are recomputed here from the files its runs wrote. Its
comparison of a resumed run is checked on records with known differences.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "multi_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("multi_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def train_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if "loss" in r]


def test_tiny_mode_runs_every_part_on_two_gloo_processes(tmp_path: Path):
    """verify-loss at 2 processes, train at 1 and 2 processes, and a sharded run saved and resumed,
    as on the GPUs: every check passes, the medians and the efficiency are those of the runs'
    metrics.jsonl, and the resumed run continues the straight one bitwise (CPU, float32)."""
    report_path, work_root = tmp_path / "report.json", tmp_path / "work"
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--json", str(report_path),
                             "--work-dir", str(work_root)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(report_path.read_text(encoding="utf-8"))
    work = Path(report["work_dir"])
    assert work.parent == work_root.resolve()
    assert report["env_vars"] == {"NCCL_NVLS_ENABLE": "0"} and report["exit_code"] == 0
    assert report["environment"]["gpus"] == [] and report["environment"]["environment"]["torch"]

    (verify,) = report["verify"]["runs"]
    assert verify["processes"] == 2 and verify["exit_code"] == 0 and verify["pass"]
    assert "--nproc 2" in verify["command"] and verify["command"].startswith("ligertune verify-loss ")
    sharded = [c for c in verify["cases"] if c["name"].startswith("2 processes") and c["kind"] == "ligertune"]
    assert {c["mode"] for c in sharded} == {"token", "sequence"} and all(c["pass"] for c in sharded)
    naive = [c for c in verify["cases"] if c["name"] == "2 processes, mean per process"]
    assert naive and not naive[0]["pass"]  # what the check would miss without the step-level normalizer

    skip = report["scaling"]["median_after"]
    rates = {}
    for run in report["scaling"]["runs"]:
        n = run["processes"]
        records = train_records(work / f"scaling-{n}" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        rates[n] = statistics.median(r["tokens_per_s"] for r in records[skip:])
        assert run["tokens_per_s"] == pytest.approx(rates[n], rel=1e-12)
        assert run["mfu"] is None and run["peak_mem_gib"] is None  # CUDA figures: n/a on a CPU
        assert not (work / f"scaling-{n}" / "final").exists()  # models removed, metrics kept
    assert sorted(rates) == [1, 2]
    assert report["scaling"]["runs"][1]["efficiency"] == pytest.approx(rates[2] / (2 * rates[1]), rel=1e-12)

    fsdp = report["fsdp"]
    resolved = yaml.safe_load((work / "fsdp" / "recipe.yaml").read_text(encoding="utf-8"))
    assert resolved["lora"] is None and resolved["distributed"]["strategy"] == "fsdp"  # LoRA recipe, full FT
    assert fsdp["run"]["complete"] and fsdp["params"] > 0
    resume = fsdp["resume"]
    assert resume["recipe"] == "recipes/bench/llama-3.1-8b-lora.yaml" and resume["command"].endswith(" --resume")
    straight = {r["step"]: r for r in train_records(work / "fsdp-straight-metrics.jsonl")}
    resumed = [r for r in train_records(work / "fsdp" / "metrics.jsonl") if r["step"] > 2]
    assert [r["step"] for r in resumed] == resume["steps"] == [3, 4]
    for record in resumed:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert record[key] == straight[record["step"]][key], key
    assert resume["tolerances"] == {"loss": 0.0, "grad_norm": 0.0} and resume["pass"]
    assert "Summary (tiny, 2 processes" in result.stdout and "every check passed" in result.stdout


def records(steps, loss=2.0, lr=1e-3, tokens=100, grad_norm=1.0) -> list[dict]:
    return [{"step": s, "loss": loss + s, "lr": lr * s, "tokens": tokens + s, "grad_norm": grad_norm + s}
            for s in steps]


STRAIGHT = records(range(1, 7))  # steps 1..6, a checkpoint after step 4


@pytest.mark.parametrize("tail, at, passes", [
    pytest.param(records([5, 6]), 4, True, id="the-same"),
    pytest.param([{**r, "loss": r["loss"] * (1 + 2e-3)} for r in records([5, 6])], 4, True, id="loss-within-1e-2"),
    pytest.param([{**r, "loss": r["loss"] * (1 + 2e-2)} for r in records([5, 6])], 4, False, id="loss-beyond-1e-2"),
    pytest.param([{**r, "grad_norm": r["grad_norm"] * 1.2} for r in records([5, 6])], 4, False, id="grad-norm"),
    pytest.param(records([5, 6], lr=1.1e-3), 4, False, id="schedule-restarted"),
    pytest.param(records([5, 6], tokens=101), 4, False, id="data-moved"),
    pytest.param(records([5]), 4, False, id="a-step-missing"),
    pytest.param(records([1, 2, 3, 4, 5, 6]), 4, False, id="started-over-after-the-kept-records"),
    pytest.param(records([5, 6]), None, False, id="no-resume-said"),
    pytest.param(records([5, 6]), 2, False, id="resumed-elsewhere"),
    pytest.param([{**r, "loss": None} for r in records([5, 6])], 4, False, id="non-finite-loss"),
])
def test_a_resumed_run_must_continue_the_straight_one(tail: list[dict], at: int | None, passes: bool):
    script = load_script()
    result = script.compare_resumed(STRAIGHT, STRAIGHT[:4] + tail, resumed_from=at, save_at=4, steps=6,
                                    tolerances=(1e-2, 5e-2))
    assert result["pass"] is passes


def test_the_step_a_run_says_it_resumed_at():
    script = load_script()
    wrapped = "optimizer: adamw\nresumed from /runs/a very long/checkpoints/step-000006 at \nstep 6 (epoch 0, pack 8)\n"
    assert script.resumed_at(wrapped) == 6
    assert script.resumed_at("train 4/4") is None


def test_efficiency_and_the_verify_report_among_other_output():
    script = load_script()
    assert script.scaling_efficiency(300.0, 4, 100.0) == 0.75
    assert script.scaling_efficiency(None, 2, 100.0) is None
    text = 'a notice {not json}\n{\n  "pass": true,\n  "cases": []\n}\nW1231 a warning\n'
    assert script.json_document(text) == {"pass": True, "cases": []}
    assert script.json_document("no report") is None
