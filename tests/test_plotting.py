"""`plot_metrics` and `ligertune plot`: the curves of metrics.jsonl, what each panel holds, the mistakes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.errors import UserError
from ligertune.metrics import read_metrics

matplotlib = pytest.importorskip("matplotlib")  # the `plot` extra; part of the `test` extra

from ligertune.plotting import metrics_figure, plot_metrics  # noqa: E402 (after the skip)

runner = CliRunner()


def write_metrics(run: Path, steps: int = 12, eval_every: int = 4, cut_last_line: bool = False) -> Path:
    """Records shaped like the trainer's: train records every step, eval at 0 and every `eval_every`."""
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "eval_loss": 5.7, "eval_token_accuracy": 0.0}]
    for step in range(1, steps + 1):
        lines.append({"step": step, "loss": 5.6 / step**0.3, "z_loss": 0.0, "token_accuracy": 0.1,
                      "tokens": 300, "lr": 1e-3 * min(step, 3) / 3, "grad_norm": 10.0 / step**2,
                      "tokens_per_s": 900.0, "peak_mem_gib": 0.5})
        if step % eval_every == 0:
            lines.append({"step": step, "eval_loss": 5.5 / step**0.3, "eval_token_accuracy": 0.2})
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if cut_last_line:
        text += '{"step": 13, "loss": 4.'
    path = run / "metrics.jsonl"
    path.write_text(text)
    return path


def line_data(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_panels_hold_train_and_eval_loss_lr_and_grad_norm(tmp_path: Path):
    records = read_metrics(write_metrics(tmp_path / "run"))
    fig = metrics_figure(records, title="run")
    loss, lr, grad = fig.axes
    curves = line_data(loss)
    assert curves["train loss"] == (list(range(1, 13)), [5.6 / s**0.3 for s in range(1, 13)])
    assert curves["eval loss"] == ([0, 4, 8, 12], [5.7] + [5.5 / s**0.3 for s in (4, 8, 12)])
    assert lr.get_ylabel() == "learning rate" and lr.get_lines()[0].get_ydata()[-1] == pytest.approx(1e-3)
    assert grad.get_ylabel() == "grad norm" and grad.get_yscale() == "log"  # 10 down to 0.07: decades
    assert grad.get_xlabel() == "step"
    assert fig.get_suptitle() == "run: train loss 2.657 at step 12, eval loss 5.7 -> 2.61"


def test_the_objective_gets_panels_of_what_judges_it():
    """A preference run's reward accuracy and margin, train and held out, between the loss and the
    learning rate; a run without such metrics has none (the test above)."""
    records = [{"step": s, "loss": 0.7 - 0.01 * s, "lr": 1e-4, "reward_accuracy": 0.1 * s,
                "reward_margin": 0.2 * s} for s in range(1, 5)]
    records += [{"step": s, "eval_loss": 0.69 - 0.02 * s, "eval_reward_accuracy": 0.15 * s,
                 "eval_reward_margin": 0.25 * s} for s in (0, 2, 4)]
    loss, accuracy, margin, lr = metrics_figure(records, title="dpo").axes
    assert accuracy.get_ylabel() == "reward accuracy" and margin.get_ylabel() == "reward margin"
    assert line_data(accuracy)["train"] == ([1, 2, 3, 4], [0.1 * s for s in range(1, 5)])
    assert line_data(margin)["eval"] == ([0, 2, 4], [0.25 * s for s in (0, 2, 4)])
    assert lr.get_ylabel() == "learning rate"
    distill = [{"step": s, "loss": 1.0 / s, "divergence": 1.0 / s} for s in range(1, 4)]
    assert [ax.get_ylabel() for ax in metrics_figure(distill, title="kd").axes] == ["loss", "divergence"]


def test_long_runs_draw_a_smoothed_loss_over_the_raw_one(tmp_path: Path):
    records = read_metrics(write_metrics(tmp_path / "run", steps=120, eval_every=40))
    loss = metrics_figure(records, title="run").axes[0]
    curves = line_data(loss)
    assert "train loss (smoothed)" in curves
    raw = next(line for line in loss.get_lines() if line.get_label().startswith("_"))
    assert len(raw.get_xdata()) == 120 and raw.get_alpha() < 0.5


def test_the_smoothed_loss_does_not_lag(tmp_path: Path):
    """A centered average follows a straight descent exactly away from the ends; a moving average
    that looks only backwards would sit above it the whole way down."""
    records = [{"step": s, "loss": 10.0 - 0.01 * s} for s in range(1, 201)]
    smoothed = line_data(metrics_figure(records, title="run").axes[0])["train loss (smoothed)"][1]
    assert smoothed[10:-10] == pytest.approx([10.0 - 0.01 * s for s in range(11, 191)])


def test_a_run_without_eval_or_grad_norm_has_fewer_panels(tmp_path: Path):
    records = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-4} for s in range(1, 6)]
    fig = metrics_figure(records, title="run")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate"]
    assert list(line_data(fig.axes[0])) == ["train loss"]


def test_plot_metrics_writes_a_png_and_skips_a_cut_last_line(tmp_path: Path):
    metrics = write_metrics(tmp_path / "run", cut_last_line=True)
    assert [r["step"] for r in read_metrics(metrics)][-1] == 12
    out = plot_metrics(metrics, tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    image = matplotlib.image.imread(out)
    assert image.shape[0] >= image.shape[1] >= 900  # three panels stacked, 120 dpi
    assert image[..., :3].std() > 0.05  # something was drawn
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_read_metrics_errors_name_file_and_line(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)
    path.write_text('{"loss": 2.0}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:1: a record needs a numeric `step`"):
        read_metrics(path)
    path.write_text('{"step": 1, "tokens": 3}\n')
    with pytest.raises(UserError, match="no train or eval loss to plot"):
        plot_metrics(path, tmp_path / "x.png")


def test_plot_command(tmp_path: Path):
    assert "Example" in runner.invoke(app, ["plot", "--help"]).output
    run = tmp_path / "run"
    write_metrics(run)
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    assert f"wrote {run / 'loss.png'}" in result.output and (run / "loss.png").is_file()
    result = runner.invoke(app, ["plot", str(run / "metrics.jsonl"), "-o", str(tmp_path / "curves.png")])
    assert result.exit_code == 0 and (tmp_path / "curves.png").is_file()

    result = runner.invoke(app, ["plot", str(tmp_path / "absent")])
    assert result.exit_code == 2 and "absent: no metrics.jsonl there" in result.stderr


def test_plot_prints_a_bracketed_path_as_it_is(tmp_path: Path):
    run = tmp_path / "run[" / "x]"  # `[/x]` in the path would close a rich markup tag
    write_metrics(run)
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    assert f"wrote {run / 'loss.png'}" in result.output


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch):
    write_metrics(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match=r"needs matplotlib \(the `plot` extra\)"):
        plot_metrics(tmp_path / "run" / "metrics.jsonl", tmp_path / "x.png")
    result = runner.invoke(app, ["plot", str(tmp_path / "run")])
    assert result.exit_code == 2 and "the `plot` extra" in result.stderr and "Traceback" not in result.output
