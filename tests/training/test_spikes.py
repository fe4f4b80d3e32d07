"""The loss-spike watch: detection on synthetic loss sequences (and no false alarm on smooth ones), and
in the trainer: a spike logged or skipped with the conversations of its step, the same spikes after
a resume, and under two processes one record with every rank's conversations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_runs import failed_launch, torchrun
from rich.console import Console
from tiny_recipe import write_recipe

from ligertune.errors import UserError
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import RunInterrupted, cleanup, setup, train_loop
from ligertune.training.display import format_metrics
from ligertune.training.spikes import MAD_TO_STD, find_spike, remember

HERE = Path(__file__).resolve().parent


def score(loss: float, window: list[float]) -> float:
    """The robust z-score, computed with numpy (the oracle of `find_spike`'s median and MAD)."""
    median = float(np.median(window))
    mad = float(np.median(np.abs(np.asarray(window) - median)))
    return (loss - median) / (MAD_TO_STD * mad)


def watch(losses, *, threshold=6.0, window=32) -> list[int]:
    """Indices flagged when `losses` go through the watch in order."""
    recent: list[float] = []
    flagged = []
    for i, loss in enumerate(losses):
        if find_spike(loss, recent, threshold=threshold, window=window) is not None:
            flagged.append(i)
        recent = remember(recent, loss, window=window)
    return flagged


def smooth_curve(n=2000, seed=0) -> np.ndarray:
    """A fine-tuning loss: exponential decay to a floor, with 3% multiplicative noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    return (1.2 + 2.5 * np.exp(-steps / 300)) * (1 + 0.03 * rng.standard_normal(n))


def test_spikes_on_a_synthetic_sequence_are_found_and_nothing_else():
    losses = smooth_curve()
    spiked = {100: 1.6, 700: 1.3, 701: 1.3, 1500: 1.25}  # factors on the loss at these steps
    for step, factor in spiked.items():
        losses[step] *= factor
    assert watch(losses) == sorted(spiked)  # two in a row: the first does not hide the second
    # The scores match the formula, computed apart with numpy.
    recent = list(losses[68:100])
    spike = find_spike(losses[100], recent, threshold=6.0, window=32)
    assert spike.score == pytest.approx(score(losses[100], recent), rel=1e-12)
    assert spike.median == pytest.approx(np.median(recent)) and spike.loss == losses[100]


@pytest.mark.parametrize("seed", range(5))
def test_no_false_alarm_on_smooth_sequences(seed):
    """2000 steps of a noisy decaying loss, Gaussian noise: nothing passes the default threshold."""
    assert watch(smooth_curve(seed=seed)) == []


def test_the_watch_waits_for_a_full_window_and_ignores_falls_and_non_finite_losses():
    assert watch([1.0, 1.01, 0.99, 50.0], window=4) == []  # three known losses: the window is not full
    assert watch([1.0, 1.01, 0.99, 1.0, 50.0], window=4) == [4]
    assert watch([1.0, 1.01, 0.99, 1.0, 0.01], window=4) == []  # a fall is not a spike
    assert remember([1.0, 2.0], math.nan, window=4) == [1.0, 2.0]  # the non-finite guard handles those
    assert remember([1.0, 2.0, 3.0], 4.0, window=2) == [3.0, 4.0]


def test_flat_losses_need_a_relative_rise():
    """Losses equal to the last bit (MAD 0): a rise of one ulp is no spike, one of 1% is."""
    flat = [2.0] * 8
    assert find_spike(math.nextafter(2.0, 3.0), flat, threshold=6.0, window=8) is None
    assert find_spike(2.02, flat, threshold=6.0, window=8) is not None


# --------------------------------------------------------------------------------------------------
# in the trainer


def start(path: Path, *overrides: str, resume=None):
    return setup(load_recipe(path, list(overrides)), Console(quiet=True), resume=resume)


def finish(run, stop=None):
    try:
        return train_loop(run, stop)
    finally:
        cleanup(run)


def spike_at(run, steps: set[int], factor: float = 20.0, seen: dict | None = None) -> None:
    """Multiply the loss of the given steps (1-based) by `factor`; record in `seen[step]` the token ids
    of each conversation that those steps' forwards took."""
    forward = run.head.forward

    def spiking(input_ids, *args, cu_seqlens=None, **kwargs):
        out = forward(input_ids, *args, cu_seqlens=cu_seqlens, **kwargs)
        step = run.state.step + 1
        if step in steps:
            out.loss = out.loss * factor
            if seen is not None:
                ids, bounds = input_ids[0].tolist(), cu_seqlens.tolist()
                seen.setdefault(step, []).extend(tuple(ids[a:b]) for a, b in zip(bounds, bounds[1:]))
        return out

    run.head.forward = spiking


def count_updates(run) -> list[int]:
    """The steps (1-based) whose optimizer update ran, filled in as the run goes."""
    updated = []
    original = run.optimizer.step

    def step(*args, **kwargs):
        updated.append(run.state.step + 1)
        return original(*args, **kwargs)

    run.optimizer.step = step
    return updated


WATCH = {"max_steps": 8, "eval_every": None, "spike_window": 4}


@pytest.mark.parametrize("on_spike", ["log", "skip"])
def test_a_spike_is_recorded_with_the_conversations_of_its_step(tmp_path: Path, on_spike: str):
    """The loss of step 6 made 20x larger: spikes.jsonl holds step 6 with that loss and the origin
    (file:line) of every conversation whose tokens that step's forwards took; `log` applies the
    update, `skip` drops it and counts the step as skipped; the metrics and the summary count it."""
    path = write_recipe(tmp_path, train={**WATCH, "on_spike": on_spike})
    run = start(path)
    by_tokens = {tuple(e.input_ids): e.origin for e in run.data.train_examples}
    assert len(by_tokens) == len(run.data.train_examples)  # each conversation found by its tokens
    seen: dict = {}
    spike_at(run, {6}, seen=seen)
    updated = count_updates(run)
    result = finish(run)

    spikes = [json.loads(line) for line in (tmp_path / "run" / "spikes.jsonl").read_text().splitlines()]
    assert [s["step"] for s in spikes] == [6]
    record = spikes[0]
    assert sorted(record["conversations"]) == sorted(by_tokens[ids] for ids in seen[6])
    assert all(origin.startswith(str(tmp_path / "train.jsonl") + ":") for origin in record["conversations"])
    assert record["action"] == ("skipped" if on_spike == "skip" else "logged")
    metrics = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r}
    assert record["loss"] == pytest.approx(metrics[6]["loss"], rel=1e-12)
    assert record["score"] > 6 and record["loss"] > 10 * record["median"]
    assert metrics[6]["spike"] is True and metrics[6]["spikes"] == 1 and metrics[8]["spikes"] == 1
    assert "spikes 1" in format_metrics(metrics[8])  # the live line
    assert result.spikes == 1
    if on_spike == "skip":
        assert metrics[6]["skipped"] == "spike" and result.skipped_steps == 1
        assert updated == [1, 2, 3, 4, 5, 7, 8]
    else:
        assert "skipped" not in metrics[6] and result.skipped_steps == 0
        assert updated == list(range(1, 9))


def test_a_resumed_run_flags_the_same_spikes(tmp_path: Path):
    """Interrupted at step 5 and resumed, with a spike at step 7: the resumed run judges step 7 against
    the window saved at step 5 (a fresh window would not be full yet), so spikes.jsonl and the
    metrics equal the straight run's (to the bit: on the CPU, where resuming is bitwise)."""
    path = write_recipe(tmp_path, train={**WATCH, "save_every": 5, "device": "cpu"})  # bitwise on the CPU
    straight = start(path, f"output.dir={tmp_path / 'straight'}")
    spike_at(straight, {7})
    finish(straight)

    interrupted = start(path, f"output.dir={tmp_path / 'resumed'}")
    spike_at(interrupted, {7})

    class StopAt5:
        requested = property(lambda self: 2 if interrupted.state.step >= 5 else None)

    with pytest.raises(RunInterrupted):
        finish(interrupted, StopAt5())
    resumed = start(path, f"output.dir={tmp_path / 'resumed'}", resume="latest")
    assert len(resumed.state.recent_losses) == 4
    spike_at(resumed, {7})
    finish(resumed)

    def lines(run_dir: str, name: str) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if not k.endswith(("_per_s", "_s", "_gib"))}
                for line in (tmp_path / run_dir / name).read_text().splitlines()
                if "checkpoint" not in line]

    assert [s["step"] for s in lines("straight", "spikes.jsonl")] == [7]
    assert lines("resumed", "spikes.jsonl") == lines("straight", "spikes.jsonl")
    assert lines("resumed", "metrics.jsonl") == lines("straight", "metrics.jsonl")


def test_the_watch_settings_may_change_on_resume_and_the_optimizer_s_may_not(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 2, "save_every": 1, "eval_every": None})
    finish(start(path))
    run = start(path, "train.spike_threshold=3", "train.spike_window=8", "train.on_spike=skip", resume="latest")
    cleanup(run)
    for key, value in (("optim.name", "lion"), ("optim.clip", "per_tensor"), ("optim.master_weights", "false")):
        with pytest.raises(UserError, match=f"training math: .*{key} "):
            start(path, f"{key}={value}", resume="latest")


def test_the_watch_can_be_turned_off(tmp_path: Path):
    path = write_recipe(tmp_path, train={**WATCH, "spike_threshold": None})
    run = start(path)
    spike_at(run, {6})
    result = finish(run)
    assert result.spikes == 0 and not (tmp_path / "run" / "spikes.jsonl").exists()
    assert all("spikes" not in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))


def test_two_processes_record_each_spike_once_with_every_conversation_of_the_step(tmp_path: Path):
    """Two gloo processes, Lion with per-tensor clipping under FSDP2, a spike at step 6: one record
    (written by the first process only), listing the conversations of both processes' packs, equal
    to the record of one process running the same step; and the metrics (loss, the norm before
    clipping, the tensors clipped) of one process."""
    path = write_recipe(tmp_path, train={**WATCH, "micro_batch_size": 2, "grad_accum_steps": 1},
                        optim={"name": "lion", "lr": 1e-4, "clip": "per_tensor", "max_grad_norm": 0.05})
    result = torchrun(HERE / "distributed_spike.py", str(path), "6", f"output.dir={tmp_path / 'two'}", timeout=300)
    assert result.returncode == 0, failed_launch(result)
    one = start(path, f"output.dir={tmp_path / 'one'}", "train.grad_accum_steps=2")
    spike_at(one, {6})
    finish(one)

    def spikes(name: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / name / "spikes.jsonl").read_text().splitlines()]

    assert [s["step"] for s in spikes("two")] == [6]
    two, single = spikes("two")[0], spikes("one")[0]
    assert len(two["conversations"]) == len(set(two["conversations"]))
    assert sorted(two["conversations"]) == sorted(single["conversations"])
    assert two["loss"] == pytest.approx(single["loss"], rel=1e-5)
    records = {name: [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r]
               for name in ("one", "two")}
    for mine, reference in zip(records["two"], records["one"], strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
        assert mine["clipped_tensors"] == reference["clipped_tensors"] > 0
