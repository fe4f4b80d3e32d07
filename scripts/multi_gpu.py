"""Takes every multi-GPU figure for docs/PERF.md in one command: rank invariance, scaling, an 8B model sharded.

    python3 scripts/multi_gpu.py --json multi_gpu.json     # a machine with 2 or more GPUs (NCCL)
    python3 scripts/multi_gpu.py --tiny --json tiny.json   # the same commands on a tiny model: 2 gloo processes on a CPU

Three parts (`--parts`, all by default), each made of `ligertune` commands run as a user runs them
(recorded with their figures), every process with NVLink multicast off (`NCCL_NVLS_ENABLE=0`):

1. verify: `ligertune verify-loss recipes/bench/llama-3.2-1b.yaml --nproc N --json` for N = 2 and
   the number of GPUs (when it divides the 8 sampled conversations). verify-loss runs each
   conversation alone as the reference, then ligertune's paths in one process and with the step
   dealt out to N processes sharded as `train --nproc N` shards them; the rank-invariance figures
   are its N-process cases, printed with verify-loss's own verdict on each.
2. scaling: `ligertune train recipes/bench/llama-3.2-1b.yaml --nproc N` (Llama-3.2-1B shapes, full
   fine-tuning, 4 x 4096 tokens per device per micro-batch, gradient checkpointing) for N = 1, 2,
   4, ... up to the number of GPUs, `--steps` steps each, a metrics record every step, no
   evaluation, no checkpoint. `train.max_steps` fixes the number of steps: the pack stream runs on
   into further epochs of the bundled data. A run's rate is the median `tokens_per_s` of its steps
   after the first `skip`; the trainer sums the real tokens of every process over the step's wall
   clock, so the rate is the whole job's and scaling efficiency = rate(N) / (N rate(1)). Every
   run steps float32 weights and computes in bf16 (`EQUAL_PRECISION`): one process through the
   float32 master copies of its bf16 weights (`optim.master_weights: true`, where the recipe says
   false), N processes through FSDP2's float32 shards, so the efficiency counts what N processes
   cost, not a change of precision. Each run also gives its steps' spread (interquartile range over
   median). `--repeats R` runs the counts R times in turn (1, 2, 4, 1, 2, 4, ...): launches of the
   same count differ by more than steps of one run do, and the efficiency of each run is then
   against the mean rate of the one-process runs, with each count's mean and range in the summary.
3. fsdp: Llama-3.1-8B shapes trained in full (the LoRA bench recipe with `--set lora=null`) with
   AdamW, FSDP2 over every GPU: 16 bytes a parameter (float32 weights, gradients, two moments),
   128 GB, more than one GPU holds. One run of `--fsdp-steps` steps gives tokens/s, MFU and peak
   memory (rank 0's; FSDP shards evenly). Its final model takes 4 bytes a parameter on
   `--work-dir`'s disk (32 GB), and is removed once written.

`--tiny` runs the same commands with a tiny Llama (float32) on the first conversations of the
quick-start data, 2 processes and a few steps. MFU and peak device memory need CUDA: n/a on a CPU.
`--set KEY=VALUE` adds a recipe override to every command (a variant to compare, such as
`distributed.reshard_after_forward=false`).

This script measures; it judges nothing but the exit code of each command it runs. The checks
(verify-loss passes at N processes, N processes train as one, a sharded checkpoint resumes where
the run stopped) are tests: tests/gpu/test_multi_gpu.py on 2 or more GPUs, and
tests/training/test_distributed*.py on 2 gloo processes.

Prints one Markdown table per part and a summary; `--json FILE` holds the commands, their exit
codes, the figures, the devices and the versions, written again after each part (a run cut short
keeps what it measured). Exit code 0 when every command exited 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
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
# A metrics record every step, no evaluation (the bench recipes hold no held-out data; said anyway),
# no checkpoint.
MEASURE = ("train.log_every=1", "train.eval_every=null", "train.eval_at_start=false", "train.save_every=null")
# The scaling runs' weights stepped in float32 whatever the number of processes: one process through
# master copies of its bf16 weights, FSDP2 through its float32 shards (where the setting changes nothing).
EQUAL_PRECISION = ("optim.master_weights=true",)
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

    cuda: bool
    gpus: int  # processes of part 3, and the most of parts 1 and 2
    steps: int  # each scaling run
    repeats: int  # scaling runs of each count
    fsdp_steps: int  # the run of part 3
    skip: int  # first steps left out of the medians
    common: tuple[str, ...]  # every command's overrides (the tiny model and data)

    def verify_processes(self) -> list[int]:
        return sorted({n for n in (2, self.gpus) if SAMPLES % n == 0})

    def scaling_processes(self) -> list[int]:
        return [n for n in (1, 2, 4, 8, 16) if n <= self.gpus]


@dataclass
class Outcome:
    """One `ligertune` command as it ran."""

    name: str  # its logs: NAME.out and NAME.log in the work folder
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


class Commands:
    """Runs `ligertune` commands from the repository root (this interpreter's ligertune), each one's
    stdout in `work/NAME.out` and its stderr in `work/NAME.log`, and keeps every outcome."""

    def __init__(self, work: Path):
        self.work = work
        self.outcomes: list[Outcome] = []

    def run(self, args: list[str], name: str) -> Outcome:
        out, err = self.work / f"{name}.out", self.work / f"{name}.log"
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
        outcome = Outcome(name, command, code, seconds, text, tail)
        self.outcomes.append(outcome)
        return outcome

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.exit_code]


def sets(overrides: tuple[str, ...] | list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def train_args(recipe: Path, processes: int, run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    return ["train", str(recipe), "--nproc", str(processes), "-o", str(run_dir), "--max-steps", str(steps),
            *sets(overrides)]


# --------------------------------------------------------------------------------------------------
# reading what the runs wrote


def training_records(run_dir: Path) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (not evaluations or checkpoints)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return [r for r in records if "loss" in r]


def rates(records: list[dict], skip: int, *, cuda: bool) -> dict:
    """The median tokens/s (every process's tokens) and MFU of the steps after the first `skip`,
    and the peak device memory (rank 0's, the most of any record: it only grows; CUDA only, since
    on a CPU the trainer reports the process's resident memory)."""
    window = records[skip:]
    mfu = [r["mfu"] for r in window if r.get("mfu") is not None]
    step_rates = [r["tokens_per_s"] for r in window]
    median = statistics.median(step_rates) if step_rates else None
    spread = None
    if len(step_rates) >= 4 and median:
        low, _, high = statistics.quantiles(step_rates, n=4)
        spread = (high - low) / median
    return {
        "tokens_per_s": median,
        "step_spread": spread,
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


def parameter_count(stdout: str) -> int | None:
    """The parameters that `train` says its model has (`model NAME 8030.26M params`: to 10,000),
    however the console wrapped the line."""
    match = re.search(r"\bmodel \S+ ([\d.]+)M params", " ".join(stdout.split()))
    return round(float(match.group(1)) * 1e6) if match else None


def drop_models(run_dir: Path) -> None:
    """Remove a run's checkpoints and final model (the 8B's is 32 GB): its figures are in metrics.jsonl."""
    for name in ("checkpoints", "final"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the parts


def verify_part(plan: Plan, commands: Commands) -> dict:
    runs, rows = [], []
    for n in plan.verify_processes():
        outcome = commands.run(["verify-loss", str(SMALL), "--nproc", str(n), "--samples", str(SAMPLES), "--json",
                                *sets(plan.common)], f"verify-{n}")
        report = json_document(outcome.stdout)
        cases = report["cases"] if report else []
        runs.append({"processes": n, **outcome.to_json(), "cases": cases})
        for case in cases:
            if case["name"].startswith(f"{n} processes"):
                said = ("PASS" if case["pass"] else "FAIL") if case["kind"] == "ligertune" else (
                    "equal (naive)" if case["pass"] else "differs (naive)")
                rows.append([str(n), case["mode"], case["name"].removeprefix(f"{n} processes, "),
                             f"{case['loss_reference']:.5f}", f"{case['loss_candidate']:.5f}",
                             f"{case['abs_diff']:.1e}", f"{case['grad_rel_err']:.1e}", said])
    print(f"\nRank invariance ({SMALL}: verify-loss --nproc N, its cases of N processes)\n")
    print(table(["processes", "mode", "case", "reference", "candidate", "abs diff", "grad rel err",
                 "verify-loss says"], rows))
    return {"recipe": str(SMALL), "samples": SAMPLES, "runs": runs}


def scaling_part(plan: Plan, commands: Commands) -> dict:
    runs = []
    for repeat in range(1, plan.repeats + 1):
        for n in plan.scaling_processes():
            name = f"scaling-{n}" + (f"-{repeat}" if plan.repeats > 1 else "")
            run_dir = commands.work / name
            overrides = [*plan.common, *MEASURE, *EQUAL_PRECISION]
            outcome = commands.run(train_args(SMALL, n, run_dir, plan.steps, overrides), name)
            records = training_records(run_dir)
            drop_models(run_dir)
            runs.append({"processes": n, "repeat": repeat, **outcome.to_json(), "steps": len(records),
                         **rates(records, plan.skip, cuda=plan.cuda)})
    ones = [r["tokens_per_s"] for r in runs if r["processes"] == 1 and r["tokens_per_s"]]
    one = statistics.mean(ones) if ones else None
    rows = []
    for r in runs:
        r["tokens_per_s_per_process"] = r["tokens_per_s"] / r["processes"] if r["tokens_per_s"] else None
        r["efficiency"] = scaling_efficiency(r["tokens_per_s"], r["processes"], one)
        rows.append([str(r["processes"]), str(r["repeat"]), str(r["steps"]), fmt(r["tokens_per_s"], ",.0f"),
                     fmt(r["tokens_per_s_per_process"], ",.0f"), fmt(r["efficiency"], ".3f"),
                     percent(r["step_spread"]), percent(r["mfu"]), fmt(r["peak_mem_gib"], ".2f"),
                     f"{r['seconds']:.0f}", str(r["exit_code"])])
    print(f"\nScaling ({SMALL}, {plan.steps} steps; medians of the steps after the first {plan.skip}; "
          "tokens/s of all processes; efficiency = rate(N) / (N rate(1)), rate(1) the mean of the "
          "one-process runs; step spread = interquartile range / median of a run's steps)\n")
    print(table(["processes", "repeat", "steps", "tokens/s", "tokens/s per process", "efficiency", "step spread",
                 "MFU", "peak GiB", "run s", "exit"], rows))
    return {"recipe": str(SMALL), "steps": plan.steps, "median_after": plan.skip, "repeats": plan.repeats,
            "runs": runs}


def scaling_summary(runs: list[dict]) -> str:
    """Each count's rate and efficiency: the run's, or over repeats their mean and range."""
    parts = []
    for n in sorted({r["processes"] for r in runs}):
        mine = [r for r in runs if r["processes"] == n]
        rates_ = [r["tokens_per_s"] for r in mine if r["tokens_per_s"]]
        text = f"{n}: {fmt(statistics.mean(rates_) if rates_ else None, ',.0f')} tokens/s"
        effs = [r["efficiency"] for r in mine if r["efficiency"] is not None]
        if n > 1 and effs:
            text += (f" (efficiency {statistics.mean(effs):.3f}" if len(effs) > 1 else f" (efficiency {effs[0]:.3f}")
            text += (f", {min(effs):.3f}-{max(effs):.3f} over {len(effs)} runs)" if len(effs) > 1 else ")")
        parts.append(text + "".join(exited(r) for r in mine))
    return ", ".join(parts)


def fsdp_part(plan: Plan, commands: Commands, device_memory_gib: float | None) -> dict:
    run_dir = commands.work / "fsdp"
    overrides = [*plan.common, *FULL_FINE_TUNING, *MEASURE]
    outcome = commands.run(train_args(LARGE, plan.gpus, run_dir, plan.fsdp_steps, overrides), "fsdp")
    records = training_records(run_dir)
    drop_models(run_dir)
    params = parameter_count(outcome.stdout)
    run = {"processes": plan.gpus, **outcome.to_json(), "steps": len(records),
           **rates(records, plan.skip, cuda=plan.cuda)}
    run["tokens_per_s_per_process"] = run["tokens_per_s"] / plan.gpus if run["tokens_per_s"] else None
    part = {"recipe": str(LARGE), "overrides": list(FULL_FINE_TUNING), "steps": plan.fsdp_steps,
            "median_after": plan.skip, "params": params,
            "training_state_gib": TRAINING_BYTES * params / 2**30 if params else None,
            "device_memory_gib": device_memory_gib, "run": run}
    print(f"\nA model that does not fit on one GPU ({LARGE} with {' '.join(FULL_FINE_TUNING)}; "
          f"{fmt(params, ',')} parameters; {plan.fsdp_steps} steps, medians after the first {plan.skip})\n")
    print(table(["processes", "steps", "16 B/param", "one device holds", "tokens/s", "tokens/s per process", "MFU",
                 "peak GiB per GPU", "run s", "exit"],
                [[str(plan.gpus), str(run["steps"]), fmt(part["training_state_gib"], ".3g", " GiB"),
                  fmt(device_memory_gib, ".1f", " GiB"), fmt(run["tokens_per_s"], ",.0f"),
                  fmt(run["tokens_per_s_per_process"], ",.0f"), percent(run["mfu"]), fmt(run["peak_mem_gib"], ".2f"),
                  f"{run['seconds']:.0f}", str(run["exit_code"])]]))
    return part


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


def exited(run: dict) -> str:
    """Nothing for a command that exited 0; its exit code and the steps it recorded otherwise."""
    if not run["exit_code"]:
        return ""
    return f" [exit {run['exit_code']}" + (f", {run['steps']} steps]" if "steps" in run else "]")


def summary(report: dict) -> list[str]:
    lines = []
    if "verify" in report:
        lines.append("verify   verify-loss: " + ", ".join(
            f"{r['processes']} processes, exit {r['exit_code']}" for r in report["verify"]["runs"]))
    if "scaling" in report:
        lines.append("scaling  " + scaling_summary(report["scaling"]["runs"]))
    if "fsdp" in report:
        run = report["fsdp"]["run"]
        lines.append(f"fsdp     {run['processes']} processes{exited(run)}: {fmt(run['tokens_per_s'], ',.0f')} "
                     f"tokens/s, MFU {percent(run['mfu'])}, peak {fmt(run['peak_mem_gib'], '.2f', ' GiB')} per GPU")
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
    parser.add_argument("--json", type=Path, help="Write the commands, exit codes, figures, devices and versions here.")
    parser.add_argument("--tiny", action="store_true", help="A tiny model, 2 processes, a few steps (a CPU).")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated, of: {', '.join(PARTS)}.")
    parser.add_argument("--gpus", type=int, help="Processes of part 3 and the most of parts 1 and 2 "
                        "(default: every GPU; 2 with --tiny).")
    parser.add_argument("--steps", type=int, help="Steps of each scaling run (default 30; 4 with --tiny).")
    parser.add_argument("--repeats", type=int, default=1, help="Scaling runs of each count, in turn (default 1).")
    parser.add_argument("--fsdp-steps", type=int, help="Steps of the run of part 3 (default 12; 4 with --tiny).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="A recipe override for every command (repeatable), e.g. "
                        "distributed.reshard_after_forward=false.")
    parser.add_argument("--work-dir", type=Path, help="Keep the runs' logs and metrics in a new folder here "
                        "(default: a temporary folder, removed); part 3's final model needs 4 bytes a "
                        "parameter free on its disk.")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part {unknown[0]!r}; expected some of {', '.join(PARTS)}" if unknown
                     else "--parts: name at least one part")
    args.parts = [p for p in PARTS if p in parts]
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    if args.gpus is not None and args.gpus < 2:
        parser.error(f"--gpus: at least 2 processes, got {args.gpus}")
    skip = TINY_SKIP if args.tiny else SKIP
    for option, steps in (("--steps", args.steps), ("--fsdp-steps", args.fsdp_steps)):
        if steps is not None and steps <= skip:
            parser.error(f"{option}: more than the {skip} first steps that the medians leave out, got {steps}")
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
        plan = Plan(cuda=cuda, gpus=gpus, steps=args.steps or (4 if args.tiny else 30), repeats=args.repeats,
                    fsdp_steps=args.fsdp_steps or (4 if args.tiny else 12), skip=TINY_SKIP if args.tiny else SKIP,
                    common=(*(tiny_overrides(work) if args.tiny else ()), *args.set))
        commands = Commands(work)
        device = info["gpus"][0]["name"] if cuda else "cpu"
        print(f"{'tiny, ' if args.tiny else ''}{gpus} processes on {device}, torch "
              f"{info['environment'].get('torch')}, transformers {info['environment'].get('transformers')}; "
              f"runs in {work}", flush=True)
        report.update(work_dir=str(work), processes=gpus, common_overrides=list(plan.common))
        for name in args.parts:
            part_began = time.perf_counter()
            print(f"\n== {name}", flush=True)
            if name == "verify":
                report[name] = verify_part(plan, commands)
            elif name == "scaling":
                report[name] = scaling_part(plan, commands)
            else:
                report[name] = fsdp_part(plan, commands, info["gpus"][0]["memory_gib"] if cuda else None)
            report[name]["seconds"] = round(time.perf_counter() - part_began, 1)
            write_report()
    failed = commands.failed()
    report.update(seconds=round(time.perf_counter() - began, 1), exit_code=1 if failed else 0)
    write_report()
    print(f"\nSummary ({'tiny, ' if args.tiny else ''}{gpus} processes, {report['seconds']:.0f} s)")
    for line in summary(report):
        print(f"  {line}")
    print("failed: " + ", ".join(f"{o.name} (exit {o.exit_code})" for o in failed) if failed
          else f"every command exited 0 ({len(commands.outcomes)})")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
