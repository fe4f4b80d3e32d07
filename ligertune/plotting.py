"""A run's curves from its metrics.jsonl, as one PNG: loss (train and eval), learning rate, grad norm,
and what the objective is judged by (`OBJECTIVE_PANELS`: a preference run's reward accuracy and
margin, a distillation's divergence, Medusa heads' accepted length), train and held out.

    plot_metrics(Path("runs/quickstart/metrics.jsonl"), Path("runs/quickstart/loss.png"))

Drawn with matplotlib's Agg canvas on a `Figure` of its own: no pyplot, no global backend switch, no
display needed. matplotlib is the optional extra `ligertune[plot]`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ligertune.errors import UserError
from ligertune.metrics import read_metrics

SMOOTH_FROM = 50
"""With this many train records or more, the raw loss is drawn faint under a smoothed line."""

OBJECTIVE_PANELS = {
    "reward_accuracy": "reward accuracy",
    "reward_margin": "reward margin",
    "divergence": "divergence",
    "accepted_length": "accepted length",
}
"""The metrics (train, and held out as `eval_<name>`) that get a panel of their own when a run has them."""


def require_matplotlib() -> None:
    """Fail with the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("plot: needs matplotlib (the `plot` extra): pip install matplotlib") from None


def plot_metrics(metrics_path: Path, output_png: Path) -> Path:
    """Draw train and eval loss, the objective's own metrics, learning rate and gradient norm against
    step; return `output_png`.

    Panels without data (a run with no eval, records without `grad_norm`) are left out. The PNG is
    written to a temporary sibling and renamed, so a reader never sees half a file.
    """
    metrics_path, output_png = Path(metrics_path), Path(output_png)
    records = read_metrics(metrics_path)
    fig = metrics_figure(records, title=metrics_path.resolve().parent.name, source=str(metrics_path))
    output_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_png.with_name(f".{output_png.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, output_png)
    finally:
        tmp.unlink(missing_ok=True)
    return output_png


def metrics_figure(records: list[dict], *, title: str, source: str = "metrics"):
    """The matplotlib `Figure` (on an Agg canvas) of `plot_metrics`, from metrics records."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = {key: _series(records, key) for key in ("loss", "lr", "grad_norm")}
    eval_loss = _series(records, "eval_loss")
    if not train["loss"][0] and not eval_loss[0]:
        raise UserError(f"{source}: no train or eval loss to plot")
    judged = {key: (_series(records, key), _series(records, f"eval_{key}")) for key in OBJECTIVE_PANELS}
    judged = {key: series for key, series in judged.items() if series[0][0] or series[1][0]}
    panels = ["loss", *judged] + [key for key in ("lr", "grad_norm") if train[key][0]]

    fig = Figure(figsize=(8, 1.2 + 3.2 + 1.8 * (len(panels) - 1)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [1.8] + [1] * (len(panels) - 1)})[:, 0]
    fig.suptitle(f"{title}: {_headline(train['loss'], eval_loss)}", fontsize=10)

    ax = axes[0]
    steps, values = train["loss"]
    if steps:
        if len(steps) >= SMOOTH_FROM:
            ax.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=0.8)
            ax.plot(steps, _smoothed(values), color="tab:blue", linewidth=1.6, label="train loss (smoothed)")
        else:
            ax.plot(steps, values, color="tab:blue", linewidth=1.4, marker="." if len(steps) < 30 else None,
                    label="train loss")
    if eval_loss[0]:
        ax.plot(*eval_loss, color="tab:orange", linewidth=1.4, marker="o", markersize=4, label="eval loss")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8, frameon=False)

    for ax, key in zip(axes[1:], panels[1:]):
        if key in judged:
            (steps, values), held = judged[key]
            if steps:
                ax.plot(steps, _smoothed(values) if len(steps) >= SMOOTH_FROM else values, color="tab:blue",
                        linewidth=1.2, label="train")
            if held[0]:
                ax.plot(*held, color="tab:orange", linewidth=1.2, marker="o", markersize=3, label="eval")
            ax.set_ylabel(OBJECTIVE_PANELS[key])
            ax.legend(loc="best", fontsize=8, frameon=False)
            continue
        steps, values = train[key]
        ax.plot(steps, values, color="tab:green" if key == "lr" else "tab:purple", linewidth=1.2)
        ax.set_ylabel("learning rate" if key == "lr" else "grad norm")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        elif _spans_decades(values):
            ax.set_yscale("log")

    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[-1].set_xlabel("step")
    return fig


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that carry a number under `key`."""
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in points], [v for _, v in points]


def _smoothed(values: list[float]) -> list[float]:
    """A centered moving average over about 4% of the records (at least 5), narrower at the ends.

    Centered, unlike an exponential average, so the curve does not lag behind the loss and sit
    above the eval loss while both fall.
    """
    half = max(2, len(values) // 50)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _spans_decades(values: list[float]) -> bool:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) > 100


def _headline(train: tuple[list[float], list[float]], eval_loss: tuple[list[float], list[float]]) -> str:
    parts = []
    if train[0]:
        parts.append(f"train loss {train[1][-1]:.4g} at step {train[0][-1]:g}")
    if eval_loss[0]:
        first, last = eval_loss[1][0], eval_loss[1][-1]
        parts.append(f"eval loss {first:.4g} -> {last:.4g}" if len(eval_loss[0]) > 1
                     else f"eval loss {last:.4g}")
    return ", ".join(parts)
