"""The throughput a run reports: wall clock over the logging window, evaluation and saves apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import unpaired_records, write_preference_recipe, write_recipe

import ligertune.training.trainer as trainer_module
from ligertune.flops import StepFlops
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, evaluate, setup, train_loop
from ligertune.training.throughput import Rates, Throughput


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_excludes_the_time_set_apart():
    clock = FakeClock()
    meter = Throughput(torch.device("cpu"), clock)
    meter.add(real_tokens=1000, trained_tokens=400)
    clock.now += 2.0
    with meter.excluded() as timing:
        clock.now += 5.0
    meter.add(real_tokens=1000, trained_tokens=600)
    clock.now += 2.0
    assert timing["seconds"] == 5.0
    assert meter.lap() == Rates(500.0, 250.0, None)  # 2000 and 1000 tokens over 4 s, not 9
    clock.now += 1.0
    meter.add(10, 5)
    assert meter.lap() == Rates(10.0, 5.0, None)  # a new window


def test_units_are_counted_over_the_window_like_tokens():
    clock = FakeClock()
    meter = Throughput(torch.device("cpu"), clock)
    meter.add(100, 50, units=3)
    clock.now += 1.0
    meter.add(100, 50, units=5)
    clock.now += 1.0
    assert meter.lap() == Rates(100.0, 50.0, None, 4.0)
    clock.now += 2.0
    assert meter.lap().units_per_s == 0.0  # a new window, nothing added


def test_the_summary_gives_the_median_of_the_logged_windows():
    from ligertune.training.trainer import median_rates

    records = [{"step": 0, "eval_loss": 0.7},
               {"step": 10, "loss": 0.6, "tokens_per_s": 900.0, "pairs_per_s": 9.0},
               {"step": 20, "loss": 0.5, "tokens_per_s": 5000.0, "pairs_per_s": 50.0},
               {"step": 30, "loss": 0.4, "tokens_per_s": 5400.0, "pairs_per_s": 60.0, "mfu": 0.4}]
    assert median_rates(records, "pairs") == "50.00 pairs/s, 5,000 tokens/s (median of 3 logged windows)"
    assert median_rates(records[:2], None) == "900 tokens/s (median of 1 logged window)"
    assert median_rates([r | {"mfu": 0.4} for r in records[1:3]], None) == (
        "2,950 tokens/s, MFU 40.0% (median of 2 logged windows)")
    assert median_rates(records[:1], "pairs") is None


def test_mfu_is_the_window_flops_over_the_peak():
    clock = FakeClock()
    meter = Throughput(torch.device("cpu"), clock, peak_tflops=2.0)
    meter.add(100, 50, flops=3e12)
    clock.now += 1.0
    meter.add(100, 50, flops=1e12)
    clock.now += 1.0
    assert meter.lap().mfu == pytest.approx(4e12 / 2.0 / 2e12)


def test_train_reports_tokens_per_second_of_the_window(tmp_path: Path, monkeypatch):
    """Each step takes 0.5 s of the fake clock and each evaluation 3 s: the rate counts the steps'
    real tokens over the steps' time only, and the evaluation time is recorded apart."""
    clock = FakeClock()
    steps_taken = []
    real_train_step = trainer_module.train_step

    seq_lens = []  # of each step's conversations

    def timed_step(run, batches):
        stats = real_train_step(run, batches)
        clock.now += 0.5
        steps_taken.append(stats)
        seq_lens.append([n for b in batches for n in (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()])
        return stats

    def timed_evaluate(run):
        clock.now += 3.0
        return evaluate(run)

    monkeypatch.setattr(trainer_module, "train_step", timed_step)
    monkeypatch.setattr(trainer_module, "evaluate", timed_evaluate)
    monkeypatch.setattr(trainer_module, "device_peak_tflops", lambda device: 1e-3)  # a device of 1 GFLOP/s
    path = write_recipe(tmp_path, train={"max_steps": 4, "log_every": 2, "eval_every": 1})
    run = setup(load_recipe(path), Console(quiet=True), clock=clock)
    try:
        train_loop(run)
    finally:
        cleanup(run)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for record, window, lengths in zip(train, (steps_taken[0:2], steps_taken[2:4]), (seq_lens[0:2], seq_lens[2:4])):
        real = sum(s.real_tokens for s in window)
        trained = sum(s.tokens for s in window)
        assert record["tokens_per_s"] == pytest.approx(real / 1.0)
        assert record["trained_tokens_per_s"] == pytest.approx(trained / 1.0)
        assert trained < real
        # Full fine-tuning of the tiny Llama: 6 flops per token and weight, plus attention.
        flops = StepFlops.of(run.model)
        assert sum(sum(step) for step in lengths) == real
        want = 6 * flops.matmul_params * real + 6 * flops.layers * flops.heads * flops.head_dim * sum(
            n * n for step in lengths for n in step)
        assert record["mfu"] == pytest.approx(want / 1.0 / 1e9)
    assert all(r["eval_s"] == pytest.approx(3.0) for r in evals)
    # real tokens are the packs' tokens, with no padding
    assert sum(s.real_tokens for s in steps_taken) == sum(
        len(p) for p in run.stream.order(0)[:16])


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_preference_run_reports_its_pairs_or_examples_per_second(tmp_path: Path, monkeypatch,
                                                                   objective: str):
    """Each step takes 0.5 s of the fake clock: `pairs_per_s` (KTO: `examples_per_s`) is the window's
    pairs over its steps' time, every micro-batch of every step counted, and the progress line shows it."""
    from ligertune.objectives.preference import num_pairs
    from ligertune.training.display import format_metrics

    clock = FakeClock()
    pairs = []
    real_train_step = trainer_module.train_step

    def timed_step(run, batches):
        stats = real_train_step(run, batches)
        clock.now += 0.5
        pairs.append(sum(num_pairs(b) for b in batches))
        return stats

    monkeypatch.setattr(trainer_module, "train_step", timed_step)
    kto = {"make_records": unpaired_records, "objective": {"name": "kto"},
           "data": {"format": "unpaired"}} if objective == "kto" else {}
    path = write_preference_recipe(tmp_path, train={"max_steps": 4, "log_every": 2}, **kto)
    run = setup(load_recipe(path), Console(quiet=True), clock=clock)
    try:
        train_loop(run)
    finally:
        cleanup(run)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    units = "examples" if objective == "kto" else "pairs"
    assert [r["step"] for r in records] == [2, 4] and all(pairs)
    for record, window in zip(records, (pairs[0:2], pairs[2:4])):
        assert record[f"{units}_per_s"] == pytest.approx(sum(window) / 1.0)
        assert f"{record[f'{units}_per_s']:,.2f} {units}/s" in format_metrics(record)
    other = "pairs" if objective == "kto" else "examples"
    assert not any(f"{other}_per_s" in r for r in records)
