"""`ligertune data`: prepare a recipe's data and report what became of it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ligertune.cli.options import JsonOpt, RecipeArg, SetOpt
from ligertune.errors import UserError

if TYPE_CHECKING:  # the data package imports torch: only when the command runs
    from ligertune.data import DataStats, OrderReport, PackingStats
    from ligertune.data.preference import PreferenceStats, PreferenceUnit
    from ligertune.recipe import Recipe

ShowOpt = Annotated[
    int,
    typer.Option(
        "--show", min=0, metavar="N",
        help="Also print N rendered training conversations (preference recipes: pairs, the prompt once, then "
             "each answer): trained tokens bold green, the rest dimmed.",
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

    A preference recipe (`objective.name` other than sft) reports its pairs (KTO: its examples)
    instead: records read, dropped and kept, scored tokens and packing; --show N prints each pair's
    prompt once, then the chosen and the rejected answer with their scored tokens marked.

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
    if loaded.objective.preference:
        if order:
            raise UserError("--order: measures how steps mix sources and lengths of conversations; "
                            f"preference data (objective.name: {loaded.objective.name}) reads one source")
        preference_report(loaded, tokenizer, json_=json_, show=show)
        return
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


def preference_report(recipe: Recipe, tokenizer, *, json_: bool, show: int) -> None:
    """What `data` prints for a preference recipe: the units as the trainer builds them."""
    from ligertune.data import packing_stats
    from ligertune.training.build import build_preference_data

    data = build_preference_data(recipe, tokenizer)
    stats = data.prepared.stats
    noun = "examples" if recipe.objective.name == "kto" else "pairs"
    packing = packing_stats(data.train_packs, recipe.data.max_seq_len)
    shown = [(unit.origin, unit_parts(tokenizer, unit)) for unit in data.prepared.train[:show]]

    if json_:
        report = {"data": stats.to_dict() | {f"train_{noun}": len(data.prepared.train),
                                             f"eval_{noun}": len(data.prepared.eval)},
                  "packing": packing.to_dict(), "warnings": data.warnings}
        if show:
            report[noun] = [{"origin": origin, "parts": [part.to_dict() for part in parts]}
                            for origin, parts in shown]
        typer.echo(json.dumps(report, indent=2))
        return

    console = Console()
    for origin, parts in shown:
        blocks = []
        for part in parts:
            scored = "" if part.name == "prompt" else f", {part.scored:,} scored"
            block = Text()
            block.append(f"{part.name} ({part.tokens:,} tokens{scored})\n", style="bold")
            for text, is_scored in part.segments:
                block.append(text, style=TRAINED_STYLE if is_scored else CONTEXT_STYLE)
            block.rstrip()  # the template's newline after the end of turn
            blocks.append(block)
        body = Text("\n\n").join(blocks)
        console.print(Panel(body, title=Text(origin), title_align="left"))  # Text: no markup in paths
    console.print(preference_table(stats, noun, len(data.prepared.train), len(data.prepared.eval)))
    console.print(Group(packing_table(packing, recipe.data.packing, noun), histogram_table(packing, noun)))
    for warning in data.warnings:
        console.print(Text(f"warning {warning}", style="yellow"))


@dataclass
class UnitPart:
    """A preference unit's prompt, or one of its answers, as `ligertune data --show` prints it."""

    name: str  # prompt, chosen, rejected; KTO: (un)desirable completion, mismatched completion
    tokens: int
    scored: int
    segments: list[tuple[str, bool]]  # (text, scored) runs

    def to_dict(self) -> dict:
        return {"name": self.name, "tokens": self.tokens, "scored": self.scored,
                "segments": [{"text": text, "scored": scored} for text, scored in self.segments]}


def unit_parts(tokenizer, unit: PreferenceUnit) -> list[UnitPart]:
    """The prompt once, then each answer (a pair's chosen then rejected one; a KTO completion with its
    label, then the mismatched completion its KL estimate scores), each decoded in runs of scored
    and unscored tokens, as `trained_segments` does for SFT."""
    from ligertune.data import TokenizedExample, trained_segments
    from ligertune.data.preference import KTOExample

    if isinstance(unit, KTOExample):  # answer 1: another example's completion, scored for z0 only
        names = [f"{'desirable' if unit.desirable else 'undesirable'} completion", "mismatched completion"]
    else:
        names = ["chosen", "rejected"]
    spans = [("prompt", 0, unit.prompt_len), *((name, s, e) for name, (s, e) in zip(names, unit.answer_spans))]
    parts = []
    for name, start, end in spans:
        piece = TokenizedExample(unit.input_ids[start:end], unit.labels[start:end])
        parts.append(UnitPart(name, len(piece), piece.trained_tokens, trained_segments(tokenizer, piece)))
    return parts


def counts_table(title: str, read: tuple[str, int], bad_records: int, dropped: dict[str, int]) -> Table:
    """The head that the data tables share: what was read, skipped and dropped (by reason)."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row(read[0], f"{read[1]:,}")
    table.add_row("bad records skipped", f"{bad_records:,}")
    for reason, count in sorted(dropped.items()):
        table.add_row(f"dropped: {reason.replace('_', ' ')}", f"{count:,}")
    return table


def preference_table(stats: PreferenceStats, noun: str, n_train: int, n_eval: int) -> Table:
    table = counts_table(f"Preference data ({noun})", ("records read", stats.records), stats.bad_records,
                         stats.dropped)
    table.add_row(f"train {noun}", f"{n_train:,}")
    table.add_row(f"eval {noun}", f"{n_eval:,}")
    share = stats.scored_tokens / stats.total_tokens if stats.total_tokens else 0.0
    table.add_row("scored / total tokens", f"{stats.scored_tokens:,} / {stats.total_tokens:,} ({share:.1%})")
    return table


def data_table(stats: DataStats) -> Table:
    table = counts_table("Data", ("conversations read", stats.conversations_read), stats.bad_records, stats.dropped)
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


def packing_table(packing: PackingStats, packed: bool, noun: str = "conversations") -> Table:
    """`noun`: what a pack holds (conversations; pairs or examples for a preference recipe)."""
    table = Table(title="Packing" if packed else f"Packing (off: one {noun[:-1]} per pack)",
                  show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row(noun, f"{packing.conversations:,}")
    table.add_row("packs", f"{packing.packs:,} of {packing.max_seq_len:,} tokens")
    table.add_row("real tokens / slots", f"{packing.real_tokens:,} / {packing.slots:,}")
    table.add_row("efficiency", f"{packing.efficiency:.1%}")
    return table


def histogram_table(packing: PackingStats, noun: str = "conversations", width: int = 40) -> Table:
    table = Table(title=f"{noun[:-1].capitalize()} lengths (tokens)", title_justify="left")
    table.add_column("length", justify="right")
    table.add_column(noun, justify="right")
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
