"""`ligertune data`: prepare a recipe's data and report what became of it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ligertune.cli.options import JsonOpt, RecipeArg, SetOpt

if TYPE_CHECKING:  # the data package imports torch: only when the command runs
    from ligertune.data import DataStats, OrderReport, PackingStats

ShowOpt = Annotated[
    int,
    typer.Option(
        "--show", min=0, metavar="N",
        help="Also print N rendered training conversations: trained tokens bold green, the rest dimmed.",
    ),
]

OrderOpt = Annotated[
    bool,
    typer.Option(
        "--order",
        help="Also report how the first epoch's steps mix sources and lengths, against random orders.",
    ),
]
WorldSizeOpt = Annotated[
    int,
    typer.Option(
        "--world-size", min=1, metavar="N",
        help="Processes the run will have (torchrun): a step takes micro_batch_size x grad_accum_steps packs on each.",
    ),
]

TRAINED_STYLE = "bold green"
CONTEXT_STYLE = "dim"


def data(recipe: RecipeArg, set_: SetOpt = None, json_: JsonOpt = False, show: ShowOpt = 0,
         order: OrderOpt = False, world_size: WorldSizeOpt = 1) -> None:
    """Read, render, mask, truncate and pack the recipe's data; print what happened to it.

    Counts (conversations read, skipped, dropped and truncated, by reason), trained tokens, packing
    efficiency and a histogram of conversation lengths. With --order, how far each step of the
    first epoch strays from the whole data's mix of sources and lengths, with a verdict. Nothing
    is trained.

    Example: [bold]ligertune data recipes/quickstart.yaml --show 2 --order[/]
    """
    from ligertune.data import order_report, pack, packing_stats, prepare_data, trained_segments
    from ligertune.models import load_tokenizer
    from ligertune.recipe import load_recipe
    from ligertune.training.build import packs_per_step
    from ligertune.training.state import first_epoch_steps

    loaded = load_recipe(recipe, list(set_ or []))
    cfg = loaded.data
    tokenizer = load_tokenizer(loaded.model)
    prepared = prepare_data(cfg, tokenizer, seed=loaded.train.seed, show_progress=not json_)
    packs = pack(prepared.train, cfg.max_seq_len, packing=cfg.packing)
    packing = packing_stats(packs, cfg.max_seq_len)
    shown = [(e.origin, trained_segments(tokenizer, e)) for e in prepared.train[:show]]
    mixing = None
    if order:
        seed = loaded.train.seed
        steps = first_epoch_steps(packs, seed, packs_per_step(loaded.train, world_size))
        n_train = len(cfg.sources) or 1
        names = [s.path for s in prepared.stats.sources[:n_train]]
        mixing = order_report(packs, steps, source_names=names, seed=seed)

    if json_:
        report = {"data": prepared.stats.to_dict(), "packing": packing.to_dict()}
        if mixing is not None:
            report["order"] = mixing.to_dict()
        if show:
            report["conversations"] = [
                {"origin": origin, "segments": [{"text": t, "trained": trained} for t, trained in segments]}
                for origin, segments in shown
            ]
        typer.echo(json.dumps(report, indent=2))
        return

    console = Console()
    for origin, segments in shown:
        body = Text()
        for text, trained in segments:
            body.append(text, style=TRAINED_STYLE if trained else CONTEXT_STYLE)
        console.print(Panel(body, title=Text(origin), title_align="left"))  # Text: no markup in paths
    console.print(data_table(prepared.stats))
    if len(prepared.stats.sources) > 1:
        console.print(sources_table(prepared.stats))
    console.print(Group(packing_table(packing, cfg.packing), histogram_table(packing)))
    for line in prepared.stats.bad_record_examples:
        console.print(Text(f"skipped {line}", style="yellow"))
    if mixing is not None:
        console.print(order_table(mixing))
        console.print(verdict_line(mixing))


def data_table(stats: DataStats) -> Table:
    table = Table(title="Data", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("conversations read", f"{stats.conversations_read:,}")
    table.add_row("bad records skipped", f"{stats.bad_records:,}")
    for reason, count in sorted(stats.dropped.items()):
        table.add_row(f"dropped: {reason.replace('_', ' ')}", f"{count:,}")
    for reason, count in sorted(stats.truncated.items()):
        table.add_row(f"truncated: {reason.replace('_', ' ')}",
                      f"{count:,} ({stats.turns_removed:,} turns removed)")
    table.add_row("train conversations", f"{stats.train_conversations:,}")
    table.add_row("eval conversations", f"{stats.eval_conversations:,}")
    share = stats.trained_tokens / stats.total_tokens if stats.total_tokens else 0.0
    table.add_row("trained / total tokens",
                  f"{stats.trained_tokens:,} / {stats.total_tokens:,} ({share:.1%})")
    cached = sum(s.cached for s in stats.sources)
    table.add_row("from cache", f"{cached} of {len(stats.sources)} sources")
    return table


def sources_table(stats: DataStats) -> Table:
    table = Table(title="Sources", title_justify="left")
    for name in ("source", "records", "bad", "dropped", "truncated", "kept", "eval", "taken", "cached"):
        table.add_column(name, justify="left" if name == "source" else "right")
    for s in stats.sources:
        table.add_row(
            Text(s.path), f"{s.records:,}", f"{s.bad_records:,}", f"{sum(s.dropped.values()):,}",
            f"{sum(s.truncated.values()):,}", f"{s.kept:,}", f"{s.eval:,}", f"{s.taken:,}",
            "yes" if s.cached else "no",
        )
    return table


def packing_table(packing: PackingStats, packed: bool) -> Table:
    table = Table(title="Packing" if packed else "Packing (off: one conversation per pack)",
                  show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("conversations", f"{packing.conversations:,}")
    table.add_row("packs", f"{packing.packs:,} of {packing.max_seq_len:,} tokens")
    table.add_row("real tokens / slots", f"{packing.real_tokens:,} / {packing.slots:,}")
    table.add_row("efficiency", f"{packing.efficiency:.1%}")
    return table


def histogram_table(packing: PackingStats, width: int = 40) -> Table:
    table = Table(title="Conversation lengths (tokens)", title_justify="left")
    table.add_column("length", justify="right")
    table.add_column("conversations", justify="right")
    table.add_column("")
    most = max((b.count for b in packing.histogram), default=0) or 1
    for bucket in packing.histogram:
        bar = "\u2588" * round(width * bucket.count / most)
        table.add_row(f"{bucket.low:,}-{bucket.high:,}", f"{bucket.count:,}", Text(bar, style="cyan"))
    return table


def order_table(report: OrderReport) -> Table:
    """Per source, then per figure: this order, what random orders give, and the limit."""
    table = Table(
        title=f"Step order: first epoch, {report.steps:,} steps of {report.packs_per_step:,} packs "
              f"({report.packs:,} packs; random: mean of {report.draws} uniformly random orders)",
        title_justify="left",
    )
    for name in ("", "this order", "random", "limit", ""):
        table.add_column(name, justify="left" if not name else "right")
    if len(report.sources) > 1:
        for s in report.sources:  # Text: no markup in paths
            table.add_row(Text(f"{s.name} ({s.share:.1%} of trained tokens): mean |step share - {s.share:.3f}|"),
                          f"{s.mean_deviation:.3f}", f"{s.random_mean_deviation:.3f}", "", "")
        table.add_row("steps all from one source", f"{report.single_source_steps:,}",
                      f"{report.random_single_source_steps:.1f}", "", "")
    labels = {
        "source deviation": "source deviation (mean total variation)",
        "length deviation": f"length deviation (mean |m - M| / M, M = {report.mean_length:,.0f} tokens)",
        "length persistence": "length persistence (lag-1 autocorrelation of m)",
    }
    for check in report.checks:
        verdict = Text("ok", style="green") if check.passed else Text("too high", style="bold red")
        table.add_row(labels.get(check.name, check.name), f"{check.value:.3f}", f"{check.random_mean:.3f}",
                      f"{check.limit:.3f}", verdict)
    if report.length_autocorrelation is None:
        table.add_row("length persistence", "-", "", "", Text("fewer than 3 steps, or no variation", style="dim"))
    return table


def verdict_line(report: OrderReport) -> Text:
    if report.passed:
        return Text("order: mixed at least as well as a random order", style="green")
    failed = ", ".join(c.name for c in report.checks if not c.passed)
    return Text(f"order: worse mixed than random orders ({failed})", style="bold red")
