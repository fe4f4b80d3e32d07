"""How bench results are shown: rich tables, JSON files and a bar chart."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.table import Table

from ligertune.bench.shapes import FLOP_RATED
from ligertune.data.stats import counted
from ligertune.errors import UserError

KERNEL_TITLES = {
    "flce": "fused linear cross-entropy, forward + backward",
    "divergence": "fused linear divergence (JSD, beta 0.5, against a teacher), forward + backward",
    "kl": "fused linear divergence (forward KL, against a teacher), forward + backward",
    "rms_norm": "RMSNorm, forward + backward",
    "rope": "rotary embedding (q and k), forward + backward",
    "swiglu": "SwiGLU, forward + backward",
    "geglu": "GeGLU (tanh GELU), forward + backward",
    "lion": "Lion optimizer step, in place",
}
DRAWN_SHOWN = 8
"""The drawn pairs whose lengths a preference report's header lists (the JSON has all of them)."""


def fmt(value: float | None, spec: str = ".3g", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def fmt_error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "[red]nan[/]"
    return f"{value:.1e}"


def split_errors(errors: dict[str, float]) -> tuple[float | None, float | None]:
    """(largest error of the outputs, largest error of the gradients)."""
    values = [v for k, v in errors.items() if not k.startswith("grad")]
    grads = [v for k, v in errors.items() if k.startswith("grad")]

    def worst(xs):
        if not xs:
            return None
        return math.nan if any(math.isnan(x) for x in xs) else max(xs)

    return worst(values), worst(grads)


def kernel_tables(report) -> list[Table]:
    """One table per kernel and shape, the ligertune row first; why a row has no numbers is its caption."""
    tables = []
    groups: dict[tuple[str, str], list] = {}
    for row in report.rows:
        groups.setdefault((row.kernel, row.shape), []).append(row)
    for (kernel, shape), rows in groups.items():
        rate = "TFLOP/s" if kernel in FLOP_RATED else "GB/s"
        title = f"{KERNEL_TITLES.get(kernel, kernel)}: {shape}, {report.dtype}"
        notes = [f"* {row.impl}: {_status_text(row)}" for row in rows if row.status != "ok"]
        table = Table(title=title, title_justify="left", title_style="bold",
                      caption=_escape("\n".join(notes)) or None, caption_justify="left")
        table.add_column("implementation", overflow="fold", min_width=18)
        roofline = ("% peak", "% copy") if rate == "GB/s" else ()
        columns = ("ms", rate, *roofline, "extra MiB", "speed-up", "err out", "err grad")
        for name in columns:
            table.add_column(name, justify="right", no_wrap=True)
        for row in rows:
            err_out, err_grad = split_errors(row.errors)
            timing = row.timing
            extra = timing.extra_peak_mib if timing else None
            if row.status == "ok":
                shares = [_percent(row.of_peak_bandwidth), _percent(row.of_copy_bandwidth)] if roofline else []
                cells = [
                    fmt(timing.median_ms, ".4g"),
                    fmt(row.tflops if kernel in FLOP_RATED else row.gbps, ".4g"),
                    *shares,
                    fmt(extra, ".0f" if extra is not None and extra >= 10 else ".2g"),
                    fmt(row.vs_ligertune, ".2f", "x"),
                    fmt_error(err_out),
                    fmt_error(err_grad),
                ]
            else:
                cells = ["-"] * len(columns)
            if row.status != "ok":
                name = f"[{'red' if row.status == 'failed' else 'dim'}]{row.impl} *[/]"
            elif row.impl.startswith("ligertune"):
                name = f"[bold]{row.impl}[/]"
            else:
                name = row.impl
            table.add_row(name, *cells)
        tables.append(table)
    return tables


def _percent(fraction: float | None) -> str:
    return fmt(None if fraction is None else 100 * fraction, ".0f", "%")


def roofline_line(report) -> str | None:
    """The line under the header that says what the GB/s rows are held against (None off CUDA)."""
    parts = []
    if report.peak_gbps:
        parts.append(f"% peak of the data sheet's {report.peak_gbps:,.0f} GB/s")
    if report.copy_gbps:
        parts.append(f"% copy of a device-to-device copy's {report.copy_gbps:,.0f} GB/s, measured now")
    return "memory roofline: " + "; ".join(parts) if parts else None


def _status_text(row) -> str:
    return row.status if not row.detail or row.detail == row.status else f"{row.status}: {row.detail}"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON; non-finite floats become null, so every JSON reader accepts the
    file. The file is replaced whole (written beside it, then renamed): never half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(_finite(data), indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def require_matplotlib() -> None:
    """Fail before any measurement when a plot was asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or ligertune[plot])") from None


def plot_kernels(report, path: Path) -> None:
    """A PNG with one horizontal bar chart of median ms per kernel and shape (measured rows only)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list] = {}
    for row in report.rows:
        if row.timing is not None:
            groups.setdefault((row.kernel, row.shape), []).append(row)
    if not groups:
        raise UserError("--plot: no row was measured, nothing to draw")
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 1.2 + 0.45 * sum(len(g) for g in groups.values())),
                             squeeze=False)
    for ax, ((kernel, shape), rows) in zip(axes[:, 0], groups.items()):
        names = [r.impl for r in rows]
        values = [r.timing.median_ms for r in rows]
        colours = ["tab:orange" if n.startswith("ligertune") else "tab:gray" if "floor" in n else "tab:blue"
                   for n in names]
        ax.barh(names, values, color=colours)
        ax.invert_yaxis()
        ax.set_title(f"{kernel} {shape} ({report.dtype}, {report.device})", fontsize=9, loc="left")
        ax.set_xlabel("median ms, forward + backward (lower is better)", fontsize=8)
        ax.tick_params(labelsize=8)
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:.3g}", va="center", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def step_header(report) -> list[str]:
    """Lines above the step table: the model, the batch, the kernels and the peak rates."""
    m = report.model
    lines = []
    if m:
        lines.append(
            f"{m['type']}, {human_count(m['params'])} parameters ({m['layers']} layers, "
            f"hidden {m['hidden_size']}, vocabulary {m['vocab_size']}), {report.dtype} on {report.device}"
        )
        if m.get("quantization"):
            lines.append(f"base quantized: the decoder's linear layers in {m['quantization']} (QLoRA), "
                         "in every variant")
    ckpt = ", gradient checkpointing" if report.gradient_checkpointing else ""
    if report.pairs:
        p = report.pairs
        packed = p["prompt_len"] + 2 * p["answer_len"]
        answers = ("a completion and a mismatched completion" if p["objective"] == "kto" else "two answers")
        spread = p.get("length_spread") or 0.0
        drawn = f"; each length drawn within {spread:.0%} of these, uniformly" if spread else ""
        middle = " in the middle" if spread else ""
        lines.append(f"{p['objective']}: {p['pairs']} {rated(report)} a step, each a prompt of {p['prompt_len']} "
                     f"tokens and {answers} of {p['answer_len']}{drawn} ({packed} tokens packed{middle}, the "
                     f"prompt once; {2 * (p['prompt_len'] + p['answer_len'])} as two sequences)")
        if p.get("drawn"):
            parts = "prompt+completion+mismatched" if p["objective"] == "kto" else "prompt+chosen+rejected"
            lengths = ", ".join("+".join(map(str, unit)) for unit in p["drawn"][:DRAWN_SHOWN])
            more = f", ... ({len(p['drawn'])} in all)" if len(p["drawn"]) > DRAWN_SHOWN else ""
            lines.append(f"drawn with seed {p.get('seed', 0)}, {parts}: {lengths}{more}")
        lines.append(f"ligertune: {counted(p['packs'], 'pack')} of at most {report.max_seq_len} tokens in "
                     f"{counted(p['micro_batches'], 'micro-batch', 'micro-batches')} of "
                     f"{report.micro_batch_size}{ckpt}; "
                     f"{report.warmup} warm-up + {counted(report.steps, 'timed step')}")
    elif report.context:
        lines.append(f"batch: one conversation a step, from {report.max_seq_len:,} tokens up to "
                     f"{report.context['limit']:,}{ckpt}; {report.warmup} warm-up + "
                     f"{counted(report.steps, 'timed step')}")
    else:
        lines.append(f"batch: {report.micro_batch_size} x {report.max_seq_len} tokens{ckpt}; "
                     f"{report.warmup} warm-up + {counted(report.steps, 'timed step')}")
    if report.kernels:
        lines.append(f"ligertune kernels: {report.kernels}")
    references = [f"{row.name}: {row.reference}" for row in report.rows if row.reference]
    if references:
        lines.append("reference log-probs: " + "; ".join(references))
    rates = []
    if report.peak_tflops:
        rates.append(f"the data-sheet peak {report.peak_tflops:.0f} TFLOP/s")
    if report.matmul_tflops:
        rates.append(f"a measured bf16 matmul, {report.matmul_tflops:.0f} TFLOP/s")
    if rates:
        lines.append("MFU against " + " and against ".join(rates))
    if report.note:
        lines.append(report.note)
    return lines


def rated(report) -> str:
    """What a preference step's rate counts: pairs, or KTO's examples."""
    return "examples" if report.pairs and report.pairs.get("objective") == "kto" else "pairs"


def step_table(report) -> Table:
    """Synthetic rows (one step: forward, backward, optimizer) then chat rows (one pass over the
    micro-batches: forward and backward), each section compared with its ligertune row."""
    notes = [f"* {row.name}: {_status_text(row)}" for row in report.rows if row.status != "ok"]
    pairs = report.pairs is not None
    unit = rated(report)
    epochs = (report.pairs or {}).get("epochs", 1)
    share = f"reference ms / {epochs}" if epochs > 1 else "reference ms"
    served = f"the {unit} it serves in {epochs} epochs" if epochs > 1 else f"the {unit} it serves"
    title = (f"preference step: {unit}/s = {unit} / (step ms + {share}), the reference pass spread over {served}"
             if pairs else "training step (chat rows: one pass over all micro-batches, real tokens only)")
    table = Table(title=title, title_justify="left", title_style="bold",
                  caption=_escape("\n".join(notes)) or None, caption_justify="left")
    table.add_column("variant", overflow="fold", min_width=14)
    table.add_column("checkpointing", no_wrap=True)
    columns = ("ms", "ref ms", f"{unit}/s") if pairs else ("ms", "tokens/s")
    for name in (*columns, "peak GiB", "MFU", "MFU matmul", "speed-up"):
        table.add_column(name, justify="right", no_wrap=True)
    layout = None
    for row in report.rows:
        if layout is not None and row.layout != layout:
            table.add_section()
        layout = row.layout
        if row.status != "ok":
            name = f"[{'red' if row.status == 'failed' else 'dim'}]{row.name} *[/]"
        else:
            name = f"[bold]{row.name}[/]" if row.name.startswith("ligertune") else row.name
        rate = ([fmt(row.reference_ms, ".4g"), fmt(row.pairs_per_s, ".3g")] if pairs
                else [fmt(row.tokens_per_s, ",.0f")])
        table.add_row(
            name,
            _escape(row.checkpointing or "-"),
            fmt(row.step_ms, ".4g"),
            *rate,
            fmt(row.peak_mem_gib, ".2f"),
            fmt(None if row.mfu is None else 100 * row.mfu, ".1f", "%"),
            fmt(None if row.mfu_measured is None else 100 * row.mfu_measured, ".1f", "%"),
            fmt(row.vs_ligertune, ".2f", "x"),
        )
    return table


def cap_table(report) -> Table:
    """Per memory cap, each variant at its fastest setting that fits (`bench step --memory-cap`)."""
    table = Table(title="under memory caps: each variant's fastest setting whose peak fits",
                  title_justify="left", title_style="bold")
    pairs = any(choice.pairs_per_s is not None for choice in report.choices)
    for name, justify in (("cap GiB", "right"), ("variant", "left"), ("checkpointing", "left"),
                          (f"{rated(report.step)}/s" if pairs else "tokens/s", "right"), ("peak GiB", "right"),
                          ("ligertune vs", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "variant")
    cap = None
    for choice in report.choices:
        if cap is not None and choice.cap_gib != cap:
            table.add_section()
        cap = choice.cap_gib
        if choice.tokens_per_s is None:
            setting = "[dim]nothing fits[/]"
        elif not choice.fits:
            setting = f"[red]{_escape(choice.checkpointing or '-')} (over the cap)[/]"
        else:
            setting = _escape(choice.checkpointing or "-")
        name = f"[bold]{choice.name}[/]" if choice.name.startswith("ligertune") else _escape(choice.name)
        rate = fmt(choice.pairs_per_s, ".3g") if pairs else fmt(choice.tokens_per_s, ",.0f")
        table.add_row(fmt(choice.cap_gib, "g"), name, setting, rate,
                      fmt(choice.peak_mem_gib, ".2f"), fmt(choice.vs_ligertune, ".2f", "x"))
    return table


def context_table(report) -> Table:
    """`bench step --max-context`: every probe, shortest first, and the longest that trained."""
    longest = report.context["longest"]
    table = Table(title="one conversation a step", title_justify="left", title_style="bold")
    for name in ("tokens", "trains", "ms", "tokens/s", "peak GiB", "reserved GiB", "MFU", "checkpointing"):
        table.add_column(name, justify="left" if name in ("trains", "checkpointing") else "right",
                         no_wrap=name != "checkpointing")
    for row in sorted((r for r in report.rows if r.layout == "context"), key=lambda r: r.tokens):
        trains = "yes" if row.status == "ok" else f"[red]{_escape(row.detail or row.status)}[/]"
        tokens = f"[bold]{row.tokens:,}[/]" if row.tokens == longest else f"{row.tokens:,}"
        table.add_row(tokens, trains, fmt(row.step_ms, ".4g"), fmt(row.tokens_per_s, ",.0f"),
                      fmt(row.peak_mem_gib, ".2f"), fmt(row.peak_reserved_gib, ".2f"),
                      fmt(None if row.mfu is None else 100 * row.mfu, ".1f", "%"), _escape(row.checkpointing or "-"))
    return table


def context_summary(report) -> str:
    """The line under `context_table`: the longest length that trained, its speed and peak."""
    context = report.context
    if context["longest"] is None:
        return f"no length up to {context['limit']:,} tokens trained"
    peak = f", peak {context['peak_mem_gib']:.2f} GiB" if context["peak_mem_gib"] is not None else ""
    return (f"the longest that trained: {context['longest']:,} tokens (searched up to {context['limit']:,}), "
            f"{context['tokens_per_s']:,.0f} tokens/s{peak}")


def plot_frontier(report, path: Path) -> None:
    """A PNG of tokens/s against peak memory: every measured setting of every variant, each
    variant's best-under-a-budget frontier as a step line, and the caps as vertical lines."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.step.rows if r.status == "ok" and r.tokens_per_s and r.peak_mem_gib is not None]
    if not rows:
        raise UserError("--plot: no setting was measured with its peak memory (a GPU is needed), nothing to draw")
    fig, ax = plt.subplots(figsize=(8, 5))
    peer_colours = iter(["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:gray"])
    for name in dict.fromkeys(r.name for r in rows):
        points = sorted((r.peak_mem_gib, r.tokens_per_s, r.checkpointing) for r in rows if r.name == name)
        ours = name.startswith("ligertune")
        style = {"color": "tab:orange" if ours else next(peer_colours, "black"), "linewidth": 2 if ours else 1.2}
        frontier, best = [], 0.0
        for memory, rate, _ in points:
            best = max(best, rate)
            frontier.append((memory, best))
        line, = ax.step([m for m, _ in frontier], [b for _, b in frontier], where="post", label=name, **style)
        ax.scatter([m for m, _, _ in points], [t for _, t, _ in points], color=line.get_color(), s=18)
    for cap in report.caps:
        ax.axvline(cap, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("peak memory allocated (GiB)")
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(f"{report.step.recipe}: {report.step.device}, {report.step.dtype}", fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
