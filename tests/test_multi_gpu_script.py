"""scripts/multi_gpu.py, the harness that takes every multi-GPU figure in one command.

The script is run whole in its `--tiny` mode (every part: verify-loss, the scaling runs, the
sharded run; a tiny model, 2 gloo processes, about a minute on 2 cores), and the figures it reports
are recomputed here from the files its runs wrote. What those runs must compute is checked
elsewhere (tests/training/test_distributed*.py; tests/gpu/test_multi_gpu.py on GPUs): the harness
judges only its commands' exit codes.
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


def test_tiny_mode_takes_every_figure_on_two_gloo_processes(tmp_path: Path):
    """verify-loss at 2 processes, train at 1 and 2 processes, and the 8B recipe's full fine-tuning
    sharded (on a tiny model), as on the GPUs: every command recorded with its exit code, the
    verify-loss cases as it printed them, the medians and the efficiency those of the runs'
    metrics.jsonl."""
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
    assert verify["processes"] == 2 and verify["exit_code"] == 0 and "log_tail" not in verify
    assert "--nproc 2" in verify["command"] and verify["command"].startswith("ligertune verify-loss ")
    printed = json.loads((work / "verify-2.out").read_text(encoding="utf-8"))
    assert verify["cases"] == printed["cases"] and any(c["name"].startswith("2 processes") for c in printed["cases"])
    assert "| 2 | token | packed, 1 micro-batch each |" in result.stdout

    skip = report["scaling"]["median_after"]
    rates = {}
    for run in report["scaling"]["runs"]:
        n = run["processes"]
        records = train_records(work / f"scaling-{n}" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4] and run["steps"] == 4 and run["exit_code"] == 0
        rates[n] = statistics.median(r["tokens_per_s"] for r in records[skip:])
        assert run["tokens_per_s"] == pytest.approx(rates[n], rel=1e-12)
        assert run["mfu"] is None and run["peak_mem_gib"] is None  # CUDA figures: n/a on a CPU
        assert not (work / f"scaling-{n}" / "final").exists()  # models removed, metrics kept
        assert "optim.master_weights=true" in run["command"]  # float32 weights stepped at every N
    assert sorted(rates) == [1, 2]
    assert report["scaling"]["runs"][1]["efficiency"] == pytest.approx(rates[2] / (2 * rates[1]), rel=1e-12)

    fsdp = report["fsdp"]
    resolved = yaml.safe_load((work / "fsdp" / "recipe.yaml").read_text(encoding="utf-8"))
    assert resolved["lora"] is None and resolved["distributed"]["strategy"] == "fsdp"  # LoRA recipe, full FT
    assert fsdp["run"]["exit_code"] == 0 and fsdp["run"]["steps"] == 4 and fsdp["run"]["processes"] == 2
    assert fsdp["params"] > 0 and fsdp["training_state_gib"] == 16 * fsdp["params"] / 2**30
    assert not (work / "fsdp" / "final").exists()
    assert "Summary (tiny, 2 processes" in result.stdout and "every command exited 0 (4)" in result.stdout


def test_a_command_that_fails_is_reported_with_its_log(tmp_path: Path):
    script = load_script()
    commands = script.Commands(tmp_path)
    outcome = commands.run(["train", "no-such-recipe.yaml"], "missing")
    assert outcome.exit_code == 2 and commands.failed() == [outcome]
    record = outcome.to_json()
    assert record["exit_code"] == 2 and "no-such-recipe.yaml" in record["log_tail"]
    assert (tmp_path / "missing.log").exists()
    assert script.exited({**record, "steps": 0}) == " [exit 2, 0 steps]"
    assert script.exited({"exit_code": 0, "steps": 4}) == ""


def test_figures_read_from_what_the_commands_printed():
    script = load_script()
    assert script.scaling_efficiency(300.0, 4, 100.0) == 0.75
    assert script.scaling_efficiency(None, 2, 100.0) is None
    text = 'a notice {not json}\n{\n  "pass": true,\n  "cases": []\n}\nW1231 a warning\n'
    assert script.json_document(text) == {"pass": True, "cases": []}
    assert script.json_document("no report") is None
    wrapped = "ligertune model LlamaForCausalLM\n8030.26M params (8030.26M trainable), torch.bfloat16, cuda\n"
    assert script.parameter_count(wrapped) == 8_030_260_000
    assert script.parameter_count("train 4/4") is None


def test_overrides_given_with_set_reach_every_command(tmp_path: Path, monkeypatch):
    script = load_script()
    args = script.parse_args(["--tiny", "--set", "distributed.reshard_after_forward=false", "--set", "a.b=1"])
    assert args.set == ["distributed.reshard_after_forward=false", "a.b=1"]
    ran = []
    monkeypatch.setattr(script.Commands, "run", lambda self, argv, name: ran.append(argv) or script.Outcome(
        name=name, command=" ".join(argv), exit_code=1, seconds=0.0, stdout="", log_tail="failed"))
    monkeypatch.setattr(script, "probe", lambda: {"gpus": [], "environment": {}})
    script.main(["--tiny", "--parts", "scaling", "--set", "distributed.reshard_after_forward=false",
                 "--work-dir", str(tmp_path)])
    assert ran and all("distributed.reshard_after_forward=false" in argv for argv in ran)


def test_repeats_run_the_counts_in_turn_and_average_the_one_process_rate(tmp_path: Path, monkeypatch):
    script = load_script()
    names = []
    monkeypatch.setattr(script.Commands, "run", lambda self, argv, name: names.append(name) or script.Outcome(
        name=name, command=" ".join(argv), exit_code=0, seconds=0.0, stdout="", log_tail=""))
    rates = {"scaling-1-1": 100.0, "scaling-2-1": 180.0, "scaling-1-2": 110.0, "scaling-2-2": 168.0}
    monkeypatch.setattr(script, "training_records", lambda run_dir: [
        {"tokens_per_s": rates[run_dir.name], "peak_mem_gib": 0.0}] * 5)
    plan = script.Plan(cuda=False, gpus=2, steps=5, repeats=2, fsdp_steps=4, skip=1, common=())
    part = script.scaling_part(plan, script.Commands(tmp_path))
    assert names == ["scaling-1-1", "scaling-2-1", "scaling-1-2", "scaling-2-2"]
    assert [r["efficiency"] for r in part["runs"] if r["processes"] == 2] == pytest.approx([180 / 210, 168 / 210])
    assert part["runs"][0]["step_spread"] == 0.0
    assert script.scaling_summary(part["runs"]) == ("1: 105 tokens/s, 2: 174 tokens/s "
                                                    "(efficiency 0.829, 0.800-0.857 over 2 runs)")
    with pytest.raises(SystemExit):
        script.parse_args(["--repeats", "0"])
