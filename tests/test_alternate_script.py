"""scripts/alternate.py, the harness that times settings of one recipe against each other, alternated:
run whole on a tiny recipe on the CPU (each run a `bench step` process), and its verdict on spreads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tiny_recipe import write_recipe

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "alternate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("alternate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    recipe = write_recipe(tmp_path, model={"dtype": "float32"})
    return subprocess.run([sys.executable, str(SCRIPT), str(recipe), "--steps", "1", *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)


def test_the_variants_take_turns_each_in_its_own_process(tmp_path: Path):
    report = tmp_path / "runs.json"
    result = run_script(tmp_path, "--rounds", "2", "--json", str(report),
                        "--variant", "checkpointed=--set train.gradient_checkpointing=true",
                        "--variant", "kept=--set train.gradient_checkpointing=false",
                        "--checkout", f"kept={ROOT}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(report.read_text())["runs"]
    assert [(r["round"], r["variant"]) for r in runs] == [
        (1, "checkpointed"), (1, "kept"), (2, "checkpointed"), (2, "kept")]
    assert all(r["exit_code"] == 0 and r["ms"] > 0 and r["tokens_per_s"] > 0 for r in runs)
    assert "gradient_checkpointing=true" in runs[0]["command"] and "=false" in runs[1]["command"]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[1] for row in rows] == ["checkpointed", "kept"] * 2
    assert "- checkpointed: " in result.stdout and "round by round" in result.stdout.split("- kept: ")[1]


def test_a_run_that_fails_says_why_and_the_exit_code_is_1(tmp_path: Path):
    result = run_script(tmp_path, "--rounds", "1", "--variant", "bad=--set train.micro_batch_size=0")
    assert result.returncode == 1
    assert "| 1 | bad | failed |" in result.stdout and "micro_batch_size" in result.stdout
    assert "- bad: no run trained" in result.stdout


def test_a_difference_counts_only_beyond_both_spreads():
    script = load_script()

    def runs(name: str, ms: list[float]) -> list[dict]:
        return [{"variant": name, "ms": t, "tokens_per_s": 1e6 / t} for t in ms]

    faster = script.summary(runs("a", [100.0, 101.0]) + runs("b", [90.0, 90.5]), ["a", "b"])
    assert "beyond the spread: 1.0%" in faster[1] and "1.111x, 1.116x" in faster[1]
    close = script.summary(runs("a", [100.0, 101.0]) + runs("b", [100.5, 99.5]), ["a", "b"])
    assert "within the spread" in close[1]  # one round each way
    noisy = script.summary(runs("a", [100.0, 100.1]) + runs("b", [95.0, 99.0]), ["a", "b"])
    assert "within the spread: 4.2%" in noisy[1]  # b's own runs differ by more than it gains
