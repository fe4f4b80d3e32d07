"""Times settings of one recipe against each other with `ligertune bench step`, alternated, each run
in a process of its own, and says whether their difference exceeds the runs' own spread.

    python3 scripts/alternate.py recipes/bench/llama-3.2-1b.yaml --steps 10 --rounds 2 \\
        --variant "bf16=--set train.precision=auto" \\
        --variant "fp8=--set train.precision=fp8"
    python3 scripts/alternate.py recipes/bench/llama-3.1-8b-qlora.yaml --variant now= \\
        --variant "before=" --checkout before=../before   # the same setting at another commit

Each round runs every variant once, in the order given (A, B, A, B for two rounds), as
`python3 -m ligertune bench step RECIPE --no-chat --no-peers --steps S --json FILE ARGS` from the
repository root, or from the variant's `--checkout` folder (another commit's tree), so that a drift
of the machine's speed falls on every variant alike. Figures are the `ligertune` row's: step time,
tokens/s and peak memory.

Prints a Markdown table of the runs, then one line a variant: its median step time, its spread
(slowest over fastest run, minus one), and its tokens/s against the first variant's, round by round.
A difference counts when it is larger than the larger of the two variants' spreads; the line says
which. `--json FILE` keeps the runs, written again after each. Exit code 0 when every run trained,
1 otherwise (a failed run's last lines are printed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_command(recipe: str, steps: int, json_path: Path, args: str) -> list[str]:
    return [sys.executable, "-m", "ligertune", "bench", "step", recipe, "--no-chat", "--no-peers",
            "--steps", str(steps), "--json", str(json_path), *shlex.split(args)]


def run_once(name: str, command: list[str], cwd: Path, json_path: Path) -> dict:
    """One `bench step` run: its `ligertune` row's figures, or why it did not train."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    run = {"variant": name, "command": shlex.join(command), "cwd": str(cwd), "exit_code": result.returncode}
    rows = json.loads(json_path.read_text())["rows"] if result.returncode == 0 and json_path.exists() else []
    row = next((r for r in rows if r["name"] == "ligertune" and r["status"] == "ok"), None)
    if row is None:
        lines = (result.stdout + result.stderr).strip().splitlines()
        run["failure"] = "\n".join(lines[-12:]) or f"exit code {result.returncode}"
        return run
    return {**run, "ms": row["step_ms"], "tokens_per_s": row["tokens_per_s"], "peak_gib": row["peak_mem_gib"]}


def spread(values: list[float]) -> float:
    """Slowest over fastest, minus one (0 for one run)."""
    return max(values) / min(values) - 1


def summary(runs: list[dict], names: list[str]) -> list[str]:
    """One line a variant: median, spread, and its tokens/s against the first variant's."""
    ok = {name: [r for r in runs if r["variant"] == name and "ms" in r] for name in names}
    lines = []
    first = ok[names[0]]
    for name in names:
        mine = ok[name]
        if not mine:
            lines.append(f"- {name}: no run trained")
            continue
        ms = [r["ms"] for r in mine]
        line = f"- {name}: {statistics.median(ms):.1f} ms median over {len(ms)}, spread {spread(ms):.1%}"
        if name != names[0] and first:
            ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(first, mine)]
            noise = max(spread(ms), spread([r["ms"] for r in first]))
            verdict = ("beyond the spread" if min(abs(x - 1) for x in ratios) > noise and
                       len({x > 1 for x in ratios}) == 1 else "within the spread")
            line += (f"; tokens/s {', '.join(f'{x:.3f}x' for x in ratios)} {names[0]}'s, round by round "
                     f"({verdict}: {noise:.1%})")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS",
                        help="a setting: its name and the bench step arguments it adds (repeatable)")
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                        help="run variant NAME from DIR (another commit's tree) instead of this repository")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    variants = dict(item.split("=", 1) for item in args.variant)
    folders = {name: Path(folder).resolve() for name, folder in (item.split("=", 1) for item in args.checkout)}
    unknown = set(folders) - set(variants)
    if unknown or len(variants) != len(args.variant) or "" in variants:
        parser.error(f"each variant needs a name of its own, and each --checkout a variant's: {args.variant}")
    runs: list[dict] = []
    print("| round | variant | ms | tokens/s | peak GiB |\n|---:|---|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(1, args.rounds + 1):
            for name, extra in variants.items():
                json_path = Path(work) / f"{round_}-{len(runs)}.json"
                cwd = folders.get(name, REPO)
                recipe = str(Path(args.recipe).resolve()) if name not in folders else args.recipe
                run = run_once(name, bench_command(recipe, args.steps, json_path, extra), cwd, json_path)
                runs.append({"round": round_, **run})
                if "ms" in run:
                    peak = "n/a" if run["peak_gib"] is None else f"{run['peak_gib']:.2f}"  # the CPU's
                    print(f"| {round_} | {name} | {run['ms']:.1f} | {run['tokens_per_s']:,.0f} | {peak} |",
                          flush=True)
                else:
                    print(f"| {round_} | {name} | failed | | |\n{run['failure']}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"recipe": args.recipe, "runs": runs}, indent=1))
    print("\n".join(["", *summary(runs, list(variants))]))
    return 0 if all("ms" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
