"""Every multi-GPU figure for docs/PERF.md in one command: rank invariance, scaling, an 8B model sharded.

    python3 scripts/multi_gpu.py --json multi_gpu.json     # a machine with 2 or more GPUs (NCCL)
    python3 scripts/multi_gpu.py --tiny --json tiny.json   # the same parts on a tiny model: 2 gloo processes on a CPU

Three parts (`--parts`, all by default), each made of `ligertune` commands run as a user runs them
(recorded with their figures), every process with NVLink multicast off (`NCCL_NVLS_ENABLE=0`):

1. verify: `ligertune verify-loss recipes/bench/llama-3.2-1b.yaml --nproc N --json` for N = 2 and
   the number of GPUs (when it divides the 8 sampled conversations). verify-loss runs each
   conversation alone as the reference, then ligertune's paths in one process (packed, unpacked,
   accumulated over micro-batches) and with the step dealt out to N processes sharded as `train
   --nproc N` shards them; the rank-invariance figures are its N-process cases. Its own verdict
   (exit code and `pass`) is the check.
2. scaling: `ligertune train recipes/bench/llama-3.2-1b.yaml --nproc N` (Llama-3.2-1B shapes, full
   fine-tuning, 4 x 4096 tokens per device per micro-batch, gradient checkpointing) for N = 1, 2,
   4, ... up to the number of GPUs, `--steps` steps each, a metrics record every step, no
   evaluation, no checkpoint. `train.max_steps` fixes the number of steps: the pack stream runs on
   into further epochs of the bundled data. A run's rate is the median `tokens_per_s` of its steps
   after the first `skip`; the trainer sums the real tokens of every process over the step's wall
   clock, so the rate is the whole job's and scaling efficiency = rate(N) / (N rate(1)). One
   process steps the recipe's bf16 weights in place (`optim.master_weights: false`); N processes
   shard float32 weights with FSDP2 and compute in bf16, so the efficiency counts that change of
   precision as well as the communication.
3. fsdp: Llama-3.1-8B shapes trained in full (the LoRA bench recipe with `--set lora=null`) with
   AdamW, FSDP2 over every GPU: 16 bytes a parameter (float32 weights, gradients, two moments),
   128 GB, more than one GPU holds. One run of K steps with a checkpoint after step S gives
   tokens/s, MFU and peak memory (rank 0's; FSDP shards evenly); `--resume` then continues from
   that checkpoint to step K, and its records of steps S+1..K must match the straight run's: the
   same steps, supervised tokens and learning rates, and the same loss and gradient norm: bitwise
   on the CPU in float32, as docs/checkpoints.md promises; on a GPU within verify-loss's tolerances
   for the dtype, since GPU kernels need not repeat bit for bit from one run to the next. The
   checkpoint and a final model take 16 bytes a parameter on disk (`--work-dir`'s); where they do
   not fit, the 8B runs without a checkpoint and the save and resume are checked on the 1B recipe,
   sharded the same way over every GPU.

`--tiny` runs the same commands with a tiny Llama (float32) on the first conversations of the
quick-start data, 2 processes and a few steps. MFU and peak device memory need CUDA: n/a on a CPU.

Prints one Markdown table per part and a summary; `--json FILE` holds the commands, the figures,
the devices and the versions, written again after each part (a run cut short keeps what it
measured). Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = Path("recipes/bench/llama-3.2-1b.yaml")  # relative to ROOT, as a user types them
LARGE = Path("recipes/bench/llama-3.1-8b-lora.yaml")
QUICKSTART_TRAIN = ROOT / "recipes" / "quickstart" / "train.jsonl"
PARTS = ("verify", "scaling", "fsdp")
SAMPLES = 8  # verify-loss's default step: 8 conversations
# A metrics record every step, no evaluation (the bench recipes hold no held-out data; said anyway).
MEASURE = ("train.log_every=1", "train.eval_every=null", "train.eval_at_start=false")
# The 8B bench recipe's shapes and batch (2 x 4096 a device), every weight trained, at the 1B
# recipe's full fine-tuning learning rate; FSDP2 (also the default) said outright.
FULL_FINE_TUNING = ("lora=null", "optim.lr=2e-5", "distributed.strategy=fsdp")
TINY_MODEL = ("{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
              "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512}")
TINY_CONVERSATIONS = 64
# First steps of a run left out of its medians: kernel compilation, the allocator's growth.
SKIP, TINY_SKIP = 3, 1
# Bytes a parameter of full fine-tuning with AdamW: float32 weights and gradients, two float32 moments.
TRAINING_BYTES = 16
# On disk, part 3 at its fullest: a checkpoint (float32 model, 4 bytes a parameter; AdamW's moments,
# 8) beside one final model (4); the straight run's final model is removed before the resumed run
# writes its own.
DISK_BYTES = 16

# What the device probe prints, run in a process of its own so that this one never opens CUDA
# (a context here would hold GPU 0's memory through every run).
PROBE = """
import json, torch
from ligertune.cli.env import environment
info = {"environment": environment(), "gpus": [], "nccl": None}
if torch.cuda.is_available():
    version = torch.cuda.nccl.version()
    info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        info["gpus"].append({"name": props.name, "memory_gib": props.total_memory / 2**30})
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Plan:
    """What the parts run: process counts, steps, and the overrides every command gets."""

    tiny: bool
    cuda: bool
    gpus: int  # processes of part 3, and the most of parts 1 and 2
    steps: int  # each scaling run
    skip: int  # first steps left out of the medians
    fsdp_steps: int  # K: the straight run of part 3
    save_at: int  # S: its checkpoint, which the resumed run continues from
    common: tuple[str, ...]  # every command's overrides (the tiny model and data)

    def verify_processes(self) -> list[int]:
        return sorted({n for n in (2, self.gpus) if SAMPLES % n == 0})

    def scaling_processes(self) -> list[int]:
        return [n for n in (1, 2, 4, 8, 16) if n <= self.gpus]


@dataclass
class Outcome:
    """One `ligertune` command as it ran."""

    command: str
    exit_code: int
    seconds: float
    stdout: str
    log_tail: str  # the end of its stdout and stderr, kept when it failed

    def to_json(self) -> dict:
        record = {"command": self.command, "exit_code": self.exit_code, "seconds": round(self.seconds, 1)}
        if self.exit_code:
            record["log_tail"] = self.log_tail
        return record


def ligertune(args: list[str], name: str, work: Path) -> Outcome:
    """Run `ligertune ARGS` from the repository root (this interpreter's ligertune), its stdout in
    `work/NAME.out` and its stderr in `work/NAME.log`."""
    out, err = work / f"{name}.out", work / f"{name}.log"
    command = shlex.join(["ligertune", *args])
    print(f"$ {command}", flush=True)
    began = time.perf_counter()
    with out.open("w", encoding="utf-8") as stdout, err.open("w", encoding="utf-8") as stderr:
        code = subprocess.run([sys.executable, "-m", "ligertune", *args], cwd=ROOT, stdout=stdout,
                              stderr=stderr, check=False).returncode
    seconds = time.perf_counter() - began
    text = out.read_text(encoding="utf-8", errors="replace")
    tail = "\n".join(f"{text}\n{err.read_text(encoding='utf-8', errors='replace')}".splitlines()[-40:])
    print(f"  exit {code} after {seconds:.0f} s", flush=True)
    if code:
        print(tail, flush=True)
    return Outcome(command, code, seconds, text, tail)


def sets(overrides: tuple[str, ...] | list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


# --------------------------------------------------------------------------------------------------
# reading what the runs wrote


def training_records(run_dir: Path) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (not evaluations or checkpoints)."""
    from ligertune.training.checkpoint import read_metrics

    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if "loss" in r] if path.exists() else []


def rates(records: list[dict], skip: int, *, cuda: bool) -> dict:
    """The median tokens/s (every process's tokens) and MFU of the steps after the first `skip`,
    and the peak device memory (rank 0's, the most of any record: it only grows; CUDA only, since
    on a CPU the trainer reports the process's resident memory)."""
    window = records[skip:]
    mfu = [r["mfu"] for r in window if r.get("mfu") is not None]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in window) if window else None,
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_mem_gib": max(r["peak_mem_gib"] for r in records) if cuda and records else None,
    }


def scaling_efficiency(rate: float | None, processes: int, rate_of_one: float | None) -> float | None:
    """rate(N) / (N rate(1)): 1 when N processes go N times as fast as one."""
    if rate is None or not rate_of_one:
        return None
    return rate / (processes * rate_of_one)


def json_document(text: str) -> dict | None:
    """The JSON object that `verify-loss --json` prints (rank 0's stdout), whatever else surrounds it."""
    for start in re.finditer(r"^\{", text, re.MULTILINE):
        try:
            value, _ = json.JSONDecoder().raw_decode(text, start.start())
        except ValueError:
            continue
        if isinstance(value, dict) and "cases" in value:
            return value
    return None


def relative_difference(a: float | None, b: float | None) -> float:
    """|a - b| / |b| (0 when equal, infinite when either is missing: a non-finite value is null)."""
    if a is None or b is None:
        return math.inf
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else math.inf


def resumed_at(stdout: str) -> int | None:
    """The step a run says it resumed at: `resumed from CHECKPOINT at step S (...)`, however the
    console wrapped the line."""
    match = re.search(r"resumed from .*? at step (\d+)", " ".join(stdout.split()))
    return int(match.group(1)) if match else None


def compare_resumed(straight: list[dict], resumed: list[dict], *, resumed_from: int | None, save_at: int,
                    steps: int, tolerances: tuple[float, float]) -> dict:
    """A run resumed at step S against the same run straight to step K.

    `resumed`: the training records of the run's metrics.jsonl once resumed, which reads as one
    run (the records after S that the straight run wrote are dropped): steps 1..K. The run must say
    it resumed at S (`resumed_from`); its records of steps S+1..K must have the straight run's
    supervised tokens (the data position) and learning rates (the schedule) exactly, and its loss
    and gradient norm within `tolerances` (relative).
    """
    by_step = {r["step"]: r for r in straight}
    after = [r for r in resumed if r["step"] > save_at]
    pairs = [(by_step[r["step"]], r) for r in after if r["step"] in by_step]
    loss = max((relative_difference(b["loss"], a["loss"]) for a, b in pairs), default=math.inf)
    grad = max((relative_difference(b["grad_norm"], a["grad_norm"]) for a, b in pairs), default=math.inf)
    result = {
        "resumed_at": resumed_from,
        "steps": [r["step"] for r in after],
        "expected_steps": list(range(save_at + 1, steps + 1)),
        "tokens_equal": all(a["tokens"] == b["tokens"] for a, b in pairs),
        "lr_equal": all(a["lr"] == b["lr"] for a, b in pairs),
        "max_loss_rel_diff": loss,
        "max_grad_norm_rel_diff": grad,
        "tolerances": {"loss": tolerances[0], "grad_norm": tolerances[1]},
    }
    result["pass"] = (resumed_from == save_at and [r["step"] for r in resumed] == list(range(1, steps + 1))
                      and [a["step"] for a, _ in pairs] == result["expected_steps"]
                      and result["tokens_equal"] and result["lr_equal"]
                      and loss <= tolerances[0] and grad <= tolerances[1])
    return result


def drop_models(run_dir: Path) -> None:
    """Remove a run's checkpoints and final model (the 8B's are 100 GB and more): its figures are
    in metrics.jsonl."""
    for name in ("checkpoints", "final"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the parts


def verify_part(plan: Plan, work: Path) -> dict:
    import torch

    from ligertune.devices import resolve_dtype
    from ligertune.recipe import load_recipe
    from ligertune.verify import TOLERANCES

    dtype = resolve_dtype(load_recipe(ROOT / SMALL, list(plan.common)).model.dtype, "cuda" if plan.cuda else "cpu")
    loss_tol, grad_tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    runs, rows = [], []
    for n in plan.verify_processes():
        outcome = ligertune(["verify-loss", str(SMALL), "--nproc", str(n), "--samples", str(SAMPLES), "--json",
                             *sets(plan.common)], f"verify-{n}", work)
        report = json_document(outcome.stdout)
        cases = report["cases"] if report else []
        ours = [c for c in cases if c["kind"] == "ligertune"]
        passed = outcome.exit_code == 0 and report is not None and report["pass"] is True and bool(ours)
        runs.append({"processes": n, **outcome.to_json(), "pass": passed, "cases": cases})
        for case in cases:
            if case["name"].startswith(f"{n} processes"):
                result = ("PASS" if case["pass"] else "FAIL") if case["kind"] == "ligertune" else (
                    "differs (naive)" if not case["pass"] else "equal (naive)")
                rows.append([str(n), case["mode"], case["name"].removeprefix(f"{n} processes, "),
                             f"{case['loss_reference']:.5f}", f"{case['loss_candidate']:.5f}",
                             f"{case['abs_diff']:.1e}", f"{case['grad_rel_err']:.1e}", result])
        print(f"  {sum(c['pass'] for c in ours)} of {len(ours)} ligertune cases pass "
              f"(1 process and {n}); verdict: {'PASS' if passed else 'FAIL'}")
    part = {"dtype": str(dtype).removeprefix("torch."), "tolerances": {"loss": loss_tol, "gradient": grad_tol},
            "runs": runs, "pass": all(r["pass"] for r in runs)}
    print(f"\nRank invariance (verify-loss, {part['dtype']}; tolerances: loss {loss_tol:g}, "
          f"gradient {grad_tol:g} relative)\n")
    print(table(["processes", "mode", "case", "reference", "candidate", "abs diff", "grad rel err", "result"], rows))
    return part


def scaling_part(plan: Plan, work: Path) -> dict:
    runs = []
    for n in plan.scaling_processes():
        run_dir = work / f"scaling-{n}"
        outcome = ligertune(train_args(SMALL, n, run_dir, plan.steps, [*plan.common, *MEASURE, "train.save_every=null"]),
                            f"scaling-{n}", work)
        records = training_records(run_dir)
        drop_models(run_dir)
        complete = outcome.exit_code == 0 and [r["step"] for r in records] == list(range(1, plan.steps + 1))
        runs.append({"processes": n, **outcome.to_json(), "steps": len(records), "complete": complete,
                     **rates(records, plan.skip, cuda=plan.cuda)})
    one = next((r["tokens_per_s"] for r in runs if r["processes"] == 1), None)
    rows = []
    for r in runs:
        r["tokens_per_s_per_process"] = r["tokens_per_s"] / r["processes"] if r["tokens_per_s"] else None
        r["efficiency"] = scaling_efficiency(r["tokens_per_s"], r["processes"], one)
        rows.append([str(r["processes"]), str(r["steps"]), fmt(r["tokens_per_s"], ",.0f"),
                     fmt(r["tokens_per_s_per_process"], ",.0f"), fmt(r["efficiency"], ".3f"), percent(r["mfu"]),
                     fmt(r["peak_mem_gib"], ".2f"), f"{r['seconds']:.0f}"])
    part = {"recipe": str(SMALL), "steps": plan.steps, "median_after": plan.skip, "runs": runs,
            "pass": all(r["complete"] for r in runs)}
    print(f"\nScaling ({SMALL}, {plan.steps} steps; medians of the steps after the first {plan.skip}; "
          "tokens/s of all processes; efficiency = rate(N) / (N rate(1)))\n")
    print(table(["processes", "steps", "tokens/s", "tokens/s per process", "efficiency", "MFU", "peak GiB",
                 "run s"], rows))
    return part


def fsdp_part(plan: Plan, work: Path, device_memory_gib: float | None) -> dict:
    from ligertune.recipe import load_recipe

    recipe = load_recipe(ROOT / LARGE, [*plan.common, *FULL_FINE_TUNING])
    params = parameter_count(recipe)
    need, free = DISK_BYTES * params * 1.05, shutil.disk_usage(work).free
    room = free >= need
    run_dir = work / "fsdp"
    # Without room for the checkpoint, the 8B is measured without one.
    overrides = [*plan.common, *FULL_FINE_TUNING, *MEASURE,
                 f"train.save_every={plan.save_at}" if room else "train.save_every=null"]
    args = train_args(LARGE, plan.gpus, run_dir, plan.fsdp_steps, overrides)
    straight = ligertune(args, "fsdp", work)
    records = training_records(run_dir)
    run = {**straight.to_json(), "steps": len(records),
           "complete": straight.exit_code == 0 and len(records) == plan.fsdp_steps,
           **rates(records, plan.skip, cuda=plan.cuda)}
    run["tokens_per_s_per_process"] = run["tokens_per_s"] / plan.gpus if run["tokens_per_s"] else None
    if room and run["complete"]:
        resume = {"recipe": str(LARGE), **check_resume(plan, work, args, run_dir, records, recipe)}
    elif room:
        resume = {"recipe": str(LARGE), "pass": False, "not_run": "the straight run did not complete"}
    else:  # save and resume the 1B recipe instead, sharded the same way over every GPU
        print(f"  {free / 2**30:.3g} GiB free in {work}, the 8B's checkpoint and final model need "
              f"{need / 2**30:.3g} GiB: the resume is checked on {SMALL} under FSDP instead")
        small_dir = work / "fsdp-small"
        small_args = train_args(SMALL, plan.gpus, small_dir, plan.fsdp_steps,
                                [*plan.common, "distributed.strategy=fsdp", *MEASURE, f"train.save_every={plan.save_at}"])
        first = ligertune(small_args, "fsdp-small", work)
        small_records = training_records(small_dir)
        resume = {"recipe": str(SMALL), "instead_of": f"{LARGE}: {need / 2**30:.3g} GiB of disk needed, "
                  f"{free / 2**30:.3g} GiB free", "straight": first.to_json()}
        if first.exit_code == 0 and len(small_records) == plan.fsdp_steps:
            small = load_recipe(ROOT / SMALL, list(plan.common))
            resume.update(check_resume(plan, work, small_args, small_dir, small_records, small))
        else:
            resume.update({"pass": False, "not_run": "the straight run did not complete"})
        drop_models(small_dir)
    drop_models(run_dir)
    part = {"recipe": str(LARGE), "overrides": list(FULL_FINE_TUNING), "processes": plan.gpus, "params": params,
            "training_state_gib": TRAINING_BYTES * params / 2**30, "device_memory_gib": device_memory_gib,
            "run": run, "resume": resume, "pass": run["complete"] and resume["pass"]}
    print(f"\nA model that does not fit on one GPU ({LARGE} with {' '.join(FULL_FINE_TUNING)}; "
          f"{params:,} parameters; {plan.fsdp_steps} steps, medians after the first {plan.skip})\n")
    print(table(["processes", "16 B/param", "one device holds", "tokens/s", "tokens/s per process", "MFU",
                 "peak GiB per GPU", "run s"],
                [[str(plan.gpus), f"{part['training_state_gib']:.3g} GiB", fmt(device_memory_gib, ".1f", " GiB"),
                  fmt(run["tokens_per_s"], ",.0f"), fmt(run["tokens_per_s_per_process"], ",.0f"),
                  percent(run["mfu"]), fmt(run["peak_mem_gib"], ".2f"), f"{run['seconds']:.0f}"]]))
    print(f"\nResume of {resume['recipe']} from the checkpoint of step {plan.save_at}: "
          + (resume["not_run"] if "not_run" in resume else
             f"resumed at step {resume['resumed_at']}, then steps {resume['steps']} (expected "
             f"{resume['expected_steps']}), tokens equal: {resume['tokens_equal']}, "
             f"learning rates equal: {resume['lr_equal']}, loss differs by {resume['max_loss_rel_diff']:.1e} "
             f"and gradient norm by {resume['max_grad_norm_rel_diff']:.1e} relative (tolerances "
             f"{resume['tolerances']['loss']:g}, {resume['tolerances']['grad_norm']:g})")
          + f": {'PASS' if resume['pass'] else 'FAIL'}")
    return part


def train_args(recipe: Path, processes: int, run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    return ["train", str(recipe), "--nproc", str(processes), "-o", str(run_dir), "--max-steps", str(steps),
            *sets(overrides)]


def check_resume(plan: Plan, work: Path, args: list[str], run_dir: Path, straight: list[dict], recipe) -> dict:
    """Continue the finished run in `run_dir` (started with `args`) from its checkpoint after step S
    with `args --resume`, and compare its steps with the straight run's `straight` records."""
    # The resumed run drops the records after step S from metrics.jsonl: keep the straight run's.
    shutil.copy(run_dir / "metrics.jsonl", work / f"{run_dir.name}-straight-metrics.jsonl")
    shutil.rmtree(run_dir / "final", ignore_errors=True)  # room for the resumed run's
    resumed = ligertune([*args, "--resume"], f"{run_dir.name}-resumed", work)
    result = {**resumed.to_json(), "from_step": plan.save_at,
              **compare_resumed(straight, training_records(run_dir), resumed_from=resumed_at(resumed.stdout),
                                save_at=plan.save_at, steps=plan.fsdp_steps,
                                tolerances=resume_tolerances(plan, recipe))}
    result["pass"] = result["pass"] and resumed.exit_code == 0
    return result


def parameter_count(recipe) -> int:
    """The recipe's model's parameters, counted on the meta device (no memory, no weights drawn)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ligertune.models import load_tokenizer
    from ligertune.models.loading import build_config

    config = build_config(recipe.model.config, vocab_size=len(load_tokenizer(recipe.model)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def resume_tolerances(plan: Plan, recipe) -> tuple[float, float]:
    """(loss, gradient norm) relative tolerances of the resumed steps: none on the CPU in float32,
    where docs/checkpoints.md promises a bitwise continuation; elsewhere verify-loss's for the dtype."""
    import torch

    from ligertune.devices import resolve_dtype
    from ligertune.verify import TOLERANCES

    dtype = resolve_dtype(recipe.model.dtype, "cuda" if plan.cuda else "cpu")
    if not plan.cuda and dtype == torch.float32:
        return 0.0, 0.0
    return TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])


# --------------------------------------------------------------------------------------------------
# printing


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, as docs/PERF.md holds them."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def percent(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, ".1f", "%")


def summary(report: dict) -> list[str]:
    lines = []
    if "verify" in report:
        part = report["verify"]
        lines.append(f"verify   {'PASS' if part['pass'] else 'FAIL'}  verify-loss at "
                     + ", ".join(f"{r['processes']} processes: exit {r['exit_code']}" for r in part["runs"]))
    if "scaling" in report:
        part = report["scaling"]
        lines.append(f"scaling  {'PASS' if part['pass'] else 'FAIL'}  "
                     + ", ".join(f"{r['processes']}: {fmt(r['tokens_per_s'], ',.0f')} tokens/s"
                                 + ("" if r["processes"] == 1 else f" (efficiency {fmt(r['efficiency'], '.3f')})")
                                 + ("" if r["complete"] else f" [exit {r['exit_code']}, {r['steps']} steps]")
                                 for r in part["runs"]))
    if "fsdp" in report:
        part, run = report["fsdp"], report["fsdp"]["run"]
        lines.append(f"fsdp     {'PASS' if run['complete'] else 'FAIL'}  {part['processes']} processes"
                     + ("" if run["complete"] else f" [exit {run['exit_code']}, {run['steps']} steps]") + ": "
                     f"{fmt(run['tokens_per_s'], ',.0f')} tokens/s, MFU {percent(run['mfu'])}, "
                     f"peak {fmt(run['peak_mem_gib'], '.2f', ' GiB')} per GPU")
        resume = part["resume"]
        lines.append(f"resume   {'PASS' if resume['pass'] else 'FAIL'}  "
                     + (resume["not_run"] if "not_run" in resume else
                        f"steps {resume['expected_steps'][0]}-{resume['expected_steps'][-1]} continued, "
                        f"loss within {resume['max_loss_rel_diff']:.1e}"))
    return lines


# --------------------------------------------------------------------------------------------------
# main


def probe() -> dict:
    """Versions and devices, from a process of its own (see PROBE)."""
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the device probe failed:\n{done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    info["git_commit"] = commit.stdout.strip() if commit.returncode == 0 else None
    return info


def tiny_overrides(work: Path) -> tuple[str, ...]:
    """The tiny model (float32) on the quick-start data's first conversations, in `work`."""
    data = work / "tiny-train.jsonl"
    with QUICKSTART_TRAIN.open(encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(TINY_CONVERSATIONS), source)), encoding="utf-8")
    # One thread a process: N processes on N cores, each its own (threads of two processes
    # contending for the same cores slow a tiny step many times over).
    return (f"model.config={TINY_MODEL}", "model.dtype=float32", f"data.path={json.dumps(str(data))}",
            "data.max_seq_len=256", "data.cache_dir=null", "train.num_threads=1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="Write the commands, figures, devices and versions here.")
    parser.add_argument("--tiny", action="store_true", help="A tiny model, 2 processes, a few steps (a CPU).")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated, of: {', '.join(PARTS)}.")
    parser.add_argument("--gpus", type=int, help="Processes of part 3 and the most of parts 1 and 2 "
                        "(default: every GPU; 2 with --tiny).")
    parser.add_argument("--steps", type=int, help="Steps of each scaling run (default 30; 4 with --tiny).")
    parser.add_argument("--work-dir", type=Path, help="Keep the runs' logs and metrics in a new folder here "
                        "(default: a temporary folder, removed); part 3 needs 16 bytes a parameter free on its disk.")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part {unknown[0]!r}; expected some of {', '.join(PARTS)}" if unknown
                     else "--parts: name at least one part")
    args.parts = [p for p in PARTS if p in parts]
    if args.gpus is not None and args.gpus < 2:
        parser.error(f"--gpus: at least 2 processes, got {args.gpus}")
    skip = TINY_SKIP if args.tiny else SKIP
    if args.steps is not None and args.steps <= skip:
        parser.error(f"--steps: more than the {skip} first steps that the medians leave out, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NVLink multicast (NVLS) off in this process and so in every process it starts: the machines
    # these figures are measured on run NCCL without it.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    info = probe()
    cuda = bool(info["gpus"])
    if not args.tiny and not cuda:
        print("no CUDA GPU here: run with --tiny on a CPU", file=sys.stderr)
        return 2
    gpus = args.gpus or (2 if args.tiny else len(info["gpus"]))
    if cuda and gpus > len(info["gpus"]):
        print(f"--gpus: {gpus} asked for, {len(info['gpus'])} here", file=sys.stderr)
        return 2
    if gpus < 2:
        print(f"one GPU here ({info['gpus'][0]['name']}): these measurements need 2 or more", file=sys.stderr)
        return 2
    began = time.perf_counter()
    report: dict = {
        "script": "scripts/multi_gpu.py", "argv": sys.argv[1:] if argv is None else argv, "tiny": args.tiny,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": info, "env_vars": {"NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"]},
    }

    def write_report() -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    with contextlib.ExitStack() as stack:
        if args.work_dir is not None:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="multi-gpu-", dir=args.work_dir)).resolve()
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="multi-gpu-"))).resolve()
        plan = Plan(tiny=args.tiny, cuda=cuda, gpus=gpus, steps=args.steps or (4 if args.tiny else 30),
                    skip=TINY_SKIP if args.tiny else SKIP, fsdp_steps=4 if args.tiny else 12, save_at=2 if args.tiny else 6,
                    common=tiny_overrides(work) if args.tiny else ())
        device = info["gpus"][0]["name"] if cuda else "cpu"
        print(f"{'tiny, ' if args.tiny else ''}{gpus} processes on {device}, torch "
              f"{info['environment'].get('torch')}, transformers {info['environment'].get('transformers')}; "
              f"runs in {work}", flush=True)
        report.update(work_dir=str(work), processes=gpus, common_overrides=list(plan.common))
        for name in args.parts:
            part_began = time.perf_counter()
            print(f"\n== {name}", flush=True)
            if name == "verify":
                report[name] = verify_part(plan, work)
            elif name == "scaling":
                report[name] = scaling_part(plan, work)
            else:
                report[name] = fsdp_part(plan, work, info["gpus"][0]["memory_gib"] if cuda else None)
            report[name]["seconds"] = round(time.perf_counter() - part_began, 1)
            write_report()
    passed = all(report[name]["pass"] for name in args.parts)
    report.update(seconds=round(time.perf_counter() - began, 1), exit_code=0 if passed else 1)
    write_report()
    print(f"\nSummary ({'tiny, ' if args.tiny else ''}{gpus} processes, {report['seconds']:.0f} s)")
    for line in summary(report):
        print(f"  {line}")
    print("every check passed" if passed else "a check failed")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
