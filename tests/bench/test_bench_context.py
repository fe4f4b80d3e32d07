"""`bench step --max-context`: the search for the longest conversation whose step trains (doubling,
then bisection), and the probes through the CLI on a tiny model on the CPU, where running out of
memory is played by a step that raises it above a length."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_bench_step import recipe_file  # noqa: F401 (a fixture)
from typer.testing import CliRunner

from ligertune.bench.context import STRIDE, longest_that_fits
from ligertune.cli.bench import app
from ligertune.training import step as training_step


def search(threshold: int, start: int, limit: int) -> tuple[int | None, list[int]]:
    tried = []

    def fits(tokens: int) -> bool:
        tried.append(tokens)
        return tokens <= threshold

    return longest_that_fits(fits, start, limit), tried


@pytest.mark.parametrize("threshold", [100, 4_000, 100_000, 342_000, 500_000])
def test_the_search_finds_the_longest_within_a_sixteenth(threshold):
    found, tried = search(threshold, start=4096, limit=1 << 20)
    assert found is not None and found <= threshold
    assert threshold - found <= max(found // 16, STRIDE) + STRIDE
    assert all(t % STRIDE == 0 for t in tried) and len(tried) == len(set(tried)) <= 20


def test_the_search_stops_at_the_limit_and_says_none_when_nothing_fits():
    assert search(10**9, start=1000, limit=5000) == (5000, [1000, 2000, 4000, 5000])
    assert search(STRIDE - 1, start=256, limit=4096)[0] is None


def out_of_memory_above(monkeypatch, tokens: int) -> list[int]:
    """Make the trainer's step raise CUDA's out-of-memory error above `tokens` a step; the lengths
    of the steps tried come back."""
    step, seen = training_step.train_step, []

    def train_step(run, batches):
        n = sum(b.num_tokens for b in batches)
        seen.append(n)
        if n > tokens:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(run, batches)

    monkeypatch.setattr(training_step, "train_step", train_step)
    return seen


def test_max_context_probes_one_conversation_a_step_until_memory_runs_out(recipe_file, tmp_path, monkeypatch,  # noqa: F811
                                                                            no_peers):
    monkeypatch.setenv("COLUMNS", "200")
    seen = out_of_memory_above(monkeypatch, 150)
    out = tmp_path / "context.json"
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--max-context", "4096", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert (data["steps"], data["warmup"]) == (1, 0)  # --max-context's defaults: a long step takes minutes
    # From data.max_seq_len (48): 48 and 96 train, 192 does not; then halfway, in strides of 64: 128.
    assert [(r["tokens"], r["status"], r["detail"]) for r in data["rows"]] == [
        (48, "ok", None), (96, "ok", None), (192, "failed", "out of memory"), (128, "ok", None)]
    assert all(r["layout"] == "context" and r["name"] == "ligertune" for r in data["rows"])
    assert set(seen) == {48, 96, 192, 128}  # one conversation a step, of each length
    assert data["micro_batch_size"] == 1
    best = data["rows"][-1]
    assert data["context"] == {"limit": 4096, "longest": 128, "tokens_per_s": best["tokens_per_s"],
                               "peak_mem_gib": None}
    assert "the longest that trained: 128 tokens (searched up to 4,096)" in result.output
    assert "one conversation a step, from 48 tokens up to 4,096" in result.output
    # Each probe's outcome is logged as it ends, so a search cut short still says what it found.
    assert "context: 192 tokens did not train: out of memory" in result.output
    assert re.search(r"context: 128 tokens trained: [\d,]+ tokens/s \(every layer\)", result.output), result.output


def test_a_search_stopped_midway_leaves_the_probes_so_far(recipe_file, tmp_path, monkeypatch, no_peers):  # noqa: F811
    """Each probe takes minutes on a GPU: the JSON is rewritten after each, so a search stopped by
    the user (here at the third probe) leaves the probes that ended."""
    step, seen = training_step.train_step, []

    def train_step(run, batches):
        seen.append(sum(b.num_tokens for b in batches))
        if len(set(seen)) == 3:
            raise KeyboardInterrupt
        return step(run, batches)

    monkeypatch.setattr(training_step, "train_step", train_step)
    out = tmp_path / "context.json"
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--max-context", "4096", "--json", str(out)])
    assert isinstance(result.exception, KeyboardInterrupt) or result.exit_code != 0, result.output
    data = json.loads(out.read_text())
    assert [(r["tokens"], r["status"]) for r in data["rows"]] == [(48, "ok"), (96, "ok")]
    assert data["context"] is None  # the search did not end
    assert not list(tmp_path.glob(".context.json*"))  # nothing half written beside it


def test_a_failure_other_than_memory_ends_the_search(recipe_file, tmp_path, monkeypatch, no_peers):  # noqa: F811
    def broken(run, batches):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(training_step, "train_step", broken)
    out = tmp_path / "context.json"
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--steps", "1", "--warmup", "0",
                                      "--max-context", "4096", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 1 and data["context"]["longest"] is None
    assert "--max-context: the step of 48 tokens failed: RuntimeError: a bug, not memory" in data["note"]
    assert "no length up to 4,096 tokens trained" in result.output


@pytest.mark.parametrize("args, message", [
    (["--max-context", "32"], "--max-context 32: below data.max_seq_len=48"),
    (["--max-context", "4096", "--memory-cap", "8"], "--max-context and --memory-cap: one search at a time"),
    (["--max-context", "4096", "--pairs", "2"], "--pairs: these are for preference pairs"),
    (["--max-context", "4096", "--device-memory", "79"], "--device-memory: caps a CUDA device's memory; the "
                                                          "device here is cpu"),
])
def test_bad_max_context_options_are_one_clear_error(recipe_file, args, message):  # noqa: F811
    result = CliRunner().invoke(app, ["step", str(recipe_file), *args])
    assert result.exit_code == 2 and message in result.output, result.output
