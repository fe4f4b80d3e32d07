"""`ligertune bench [kernels | step RECIPE | decode RUN]`: kernels and training steps against torch and
peers, and decoding with each draft against plain decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ligertune.cli.guard import guarded
from ligertune.cli.options import DeviceOpt, RecipeArg, SetOpt, TrustRemoteCodeOpt

app = typer.Typer(
    help="Measure ligertune's kernels and training step against torch, Liger-Kernel and Cut Cross-Entropy.",
    invoke_without_command=True,
    add_completion=False,
    rich_markup_mode="rich",
)

JsonFileOpt = Annotated[
    Optional[Path], typer.Option("--json", help="Write every number (with device, versions, date) to FILE.",
                                 metavar="FILE", show_default=False)
]


@app.callback()
def _bench(ctx: typer.Context) -> None:
    """Without a subcommand, `ligertune bench` runs `ligertune bench kernels` with its defaults."""
    if ctx.invoked_subcommand is None:
        kernels()


@app.command("kernels")
@guarded
def kernels(
    kernels_: Annotated[
        str, typer.Option("--kernels", "-k", help="Comma-separated: flce, divergence and kl (distillation's "
                          "fused loss: JSD, forward KL), rms_norm, rope, swiglu, geglu, and lion (the "
                          "optimizer step; only when named).")
    ] = "flce,divergence,kl,rms_norm,rope,swiglu,geglu",
    shapes: Annotated[
        Optional[list[str]],
        typer.Option(
            "--shapes",
            help="KERNEL:AxBx... replacing that kernel's default shapes (repeatable): flce:NxHxV, "
            "divergence:NxHxV and kl:NxHxV (student and teacher alike), rms_norm:TxH, swiglu:TxI, geglu:TxI, "
            "rope:BxLxHqxHkxD, "
            "lion:LxHxIxVxE (a Llama-style model's parameters: layers, hidden, MLP, vocabulary, 1 tied "
            "or 2 untied embeddings).",
            metavar="KERNEL:SHAPE",
            show_default=False,
        ),
    ] = None,
    json_file: JsonFileOpt = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", help="Draw a bar chart PNG to FILE (needs matplotlib).",
                                     metavar="FILE", show_default=False)
    ] = None,
    repeats: Annotated[
        Optional[int],
        typer.Option("--repeats", "-n", min=1, help="Timed calls per row (default 10 on CUDA, 3 on CPU).",
                     show_default=False),
    ] = None,
    warmup: Annotated[
        Optional[int],
        typer.Option("--warmup", min=0, help="Untimed calls first (default 2 on CUDA, 1 on CPU).",
                     show_default=False),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cuda or cpu.")] = "auto",
    dtype: Annotated[
        Optional[str],
        typer.Option("--dtype", help="bfloat16, float16 or float32 (default bf16 on CUDA, fp32 on CPU).",
                     show_default=False),
    ] = None,
    compile_: Annotated[
        Optional[bool], typer.Option("--compile/--no-compile", help="Also time torch.compile of the eager "
                                     "functions (default: on CUDA only).", show_default=False)
    ] = None,
    flush_l2: Annotated[
        bool, typer.Option("--flush-l2", help="Evict the L2 cache before every timed call.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    peak_gbps: Annotated[
        Optional[float], typer.Option("--peak-gbps", min=1.0, help="The device's memory bandwidth in GB/s for "
                                      "the % peak column (default: known GPUs' data sheet).", show_default=False)
    ] = None,
) -> None:
    """Time each kernel, forward + backward, against torch and the peers on the same inputs.

    Each row also gives its extra peak memory and its error against the float32 reference, and
    the rows in GB/s their share of the memory roofline (docs/bench.md says what every column
    means). `-k lion` times one Lion optimizer step over a 1B and an 8B model's parameters.

    Example: [bold]ligertune bench kernels -k flce --shapes flce:8192x4096x128256 --json bench.json[/]
    """
    from ligertune.bench.kernels import KernelBenchConfig, run_kernel_bench
    from ligertune.bench.report import (
        kernel_tables,
        plot_kernels,
        require_matplotlib,
        roofline_line,
        write_json,
    )
    from ligertune.bench.shapes import KERNELS, parse_shape
    from ligertune.errors import UserError

    names = tuple(k.strip().replace("-", "_") for k in kernels_.split(",") if k.strip())
    if not names:
        raise UserError(f"--kernels: name at least one of {', '.join(KERNELS)}")
    parsed: dict[str, list[tuple[int, ...]]] = {}
    for text in shapes or []:
        kernel, values = parse_shape(text)
        parsed.setdefault(kernel, []).append(values)
    if plot is not None:
        require_matplotlib()
    config = KernelBenchConfig(
        kernels=names, shapes=parsed, device=device, dtype=dtype, repeats=repeats, warmup=warmup,
        compile=compile_, flush_l2=flush_l2, seed=seed, peak_gbps=peak_gbps,
    )
    console = Console()
    progress = Console(stderr=True, highlight=False)
    report = run_kernel_bench(config, log=lambda line: progress.print(f"[dim]{line}[/]"))
    if report.note:
        console.print(f"[yellow]{report.note}[/]")
    console.print(f"[dim]{report.device}, {report.dtype}, median of {report.repeats} after {report.warmup} "
                  f"warm-up; errors against the {report.reference_dtype} reference[/]")
    roofline = roofline_line(report)
    if roofline:
        console.print(f"[dim]{roofline}[/]")
    for table in kernel_tables(report):
        console.print(table)
    if json_file is not None:
        write_json(json_file, report.to_dict())
        console.print(f"wrote {json_file}", markup=False)
    if plot is not None:
        plot_kernels(report, plot)
        console.print(f"wrote {plot}", markup=False)


@app.command("step")
@guarded
def step(
    recipe: RecipeArg,
    set_: SetOpt = None,
    steps: Annotated[
        Optional[int], typer.Option("--steps", min=1, show_default=False,
                                    help="Timed training steps per variant (default 5; 1 with --max-context).")
    ] = None,
    warmup: Annotated[
        Optional[int], typer.Option("--warmup", min=0, show_default=False,
                                    help="Untimed steps first (default 2; 0 with --max-context).")
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="Also compare packed and padded chat batches.")
    ] = True,
    peers: Annotated[
        bool, typer.Option("--peers/--no-peers", help="Also time the peers (plain transformers, + Liger); "
                                                     "--no-peers: ligertune's rows only.")
    ] = True,
    peak_tflops: Annotated[
        Optional[float], typer.Option("--peak-tflops", help="The device's peak bf16 TFLOP/s for MFU "
                                      "(default: known GPUs' data sheet).", show_default=False)
    ] = None,
    json_file: JsonFileOpt = None,
    memory_cap: Annotated[
        Optional[str], typer.Option("--memory-cap", metavar="GIB[,GIB...]", show_default=False,
                                    help="Under each cap, run each variant at its fastest setting that fits "
                                         "(peers: checkpointing on or off; ligertune: gradient_checkpointing: auto).")
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", help="With --memory-cap: draw tokens/s against peak memory to this PNG.",
                                     show_default=False)
    ] = None,
    max_context: Annotated[
        Optional[int], typer.Option("--max-context", metavar="LIMIT", min=1, show_default=False,
                                    help="Find the longest single conversation (up to LIMIT tokens) whose step "
                                         "trains, from data.max_seq_len up, and its tokens/s there.")
    ] = None,
    device_memory: Annotated[
        Optional[float], typer.Option("--device-memory", metavar="GIB", show_default=False,
                                      help="Cap this process's CUDA allocator at GIB, as a card of that size "
                                           "would (with --max-context: what trains on a smaller GPU).")
    ] = None,
    pairs: Annotated[
        Optional[int], typer.Option("--pairs", help="Preference recipes: pairs (kto: examples) a step (default: "
                                    "micro_batch_size x grad_accum_steps).", show_default=False)
    ] = None,
    prompt_len: Annotated[
        Optional[int], typer.Option("--prompt-len", help="Preference recipes: tokens of each pair's prompt "
                                    "(default: half of data.max_seq_len).", show_default=False)
    ] = None,
    answer_len: Annotated[
        Optional[int], typer.Option("--answer-len", help="Preference recipes: tokens of each answer, chosen "
                                    "and rejected (default: a quarter of data.max_seq_len).", show_default=False)
    ] = None,
    length_spread: Annotated[
        Optional[float], typer.Option("--length-spread", metavar="F", show_default=False,
                                      help="Preference recipes: draw each prompt's and answer's length "
                                           "uniformly within F (0 to below 1) of --prompt-len and --answer-len, "
                                           "as real pairs differ (default 0: all alike).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic tokens, and of the lengths that "
                                      "--length-spread draws.")] = 0,
    epochs: Annotated[
        Optional[int], typer.Option("--epochs", metavar="N", show_default=False,
                                    help="Preference recipes: the epochs of the run the rates stand for; "
                                         "the reference pass, run once before the first step, is spread over "
                                         "the pairs of all N (default 1).")
    ] = None,
) -> None:
    """Time training steps of the recipe's model: ligertune, plain transformers, transformers + Liger.

    The batch is synthetic (micro_batch_size x max_seq_len tokens); then chat conversations of mixed
    lengths run packed and padded (docs/bench.md says what every column means). A preference recipe
    (dpo, ipo, simpo, orpo) runs synthetic pairs instead, in pairs/s, against TRL's DPOTrainer; kto
    runs examples, in examples/s, against TRL's KTOTrainer.

    Example: [bold]ligertune bench step recipes/bench/llama-3.2-1b.yaml --steps 10 --json step.json[/]
    """
    from ligertune.bench.caps import run_memory_caps
    from ligertune.bench.context import run_max_context
    from ligertune.bench.report import (
        cap_table,
        context_summary,
        context_table,
        plot_frontier,
        require_matplotlib,
        step_header,
        step_table,
        write_json,
    )
    from ligertune.bench.step import StepBenchConfig, run_step_bench
    from ligertune.errors import UserError
    from ligertune.recipe import load_recipe

    caps = None
    if memory_cap is not None:
        try:
            caps = [float(c) for c in memory_cap.split(",") if c.strip()]
        except ValueError:
            raise UserError(f"--memory-cap: expected GiB figures separated by commas, got {memory_cap!r}") from None
    if plot is not None:
        if caps is None:
            raise UserError("--plot: draws the memory frontier, so it needs --memory-cap")
        require_matplotlib()
    if max_context is not None and caps is not None:
        raise UserError("--max-context and --memory-cap: one search at a time")
    loaded = load_recipe(recipe, list(set_ or []))
    # A long conversation's step takes minutes: one timed step and no warm-up, unless asked.
    default = StepBenchConfig(steps=1, warmup=0) if max_context is not None else StepBenchConfig()
    config = StepBenchConfig(steps=default.steps if steps is None else steps,
                             warmup=default.warmup if warmup is None else warmup,
                             chat=chat, peers=peers, peak_tflops=peak_tflops, device_memory_gib=device_memory,
                             pairs=pairs, prompt_len=prompt_len, answer_len=answer_len,
                             length_spread=length_spread, seed=seed, epochs=epochs)
    console = Console()
    progress = Console(stderr=True, highlight=False)
    log = lambda line: progress.print(f"[dim]{line}[/]")  # noqa: E731
    if caps is not None:
        capped = run_memory_caps(loaded, config, caps, recipe_name=str(recipe), log=log)
        report = capped.step
    elif max_context is not None:
        def save(so_far) -> None:  # a probe takes minutes: the probes so far, whatever stops the search
            if json_file is not None:
                write_json(json_file, so_far.to_dict())

        report = run_max_context(loaded, config, max_context, recipe_name=str(recipe), log=log, on_probe=save)
    else:
        report = run_step_bench(loaded, config, recipe_name=str(recipe), log=log)
    for line in step_header(report):
        console.print(line, highlight=False)
    if max_context is not None:
        console.print(context_table(report))
        console.print(context_summary(report), highlight=False)
    else:
        console.print(step_table(report))
    if caps is not None:
        console.print(cap_table(capped))
    if json_file is not None:
        write_json(json_file, (capped if caps is not None else report).to_dict())
        console.print(f"wrote {json_file}", markup=False)
    if plot is not None:
        plot_frontier(capped, plot)
        console.print(f"wrote {plot}", markup=False)


@app.command("decode")
@guarded
def decode(
    model: Annotated[
        Path, typer.Argument(help="A run, a checkpoint, a merged model or any Hugging Face model folder.",
                             show_default=False, metavar="RUN_OR_MODEL")
    ],
    drafts: Annotated[
        str, typer.Option("--drafts", help="Comma-separated drafts to time: none (plain decoding), ngram, medusa.")
    ] = "none,ngram",
    prompt: Annotated[
        Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt to answer (repeatable; default: four "
                                          "built-in ones, two of which copy text).", show_default=False)
    ] = None,
    prompts_from: Annotated[
        Optional[Path], typer.Option("--prompts-from", help="Answer each conversation of a chat-data file "
                                     "(JSONL: {\"messages\": [...]}) up to its last assistant turn, after "
                                     "any -p prompts.", metavar="FILE", show_default=False)
    ] = None,
    max_prompts: Annotated[
        Optional[int], typer.Option("--max-prompts", min=1, help="Take the first N conversations of "
                                    "--prompts-from (default: all).", metavar="N", show_default=False)
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Longest answer.")] = 128,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed answers per prompt (the median counts).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed answers first, per draft.")] = 1,
    depth: Annotated[int, typer.Option("--depth", min=1, help="Tokens ahead an ngram draft proposes.")] = 5,
    device: DeviceOpt = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="auto (bf16 on a GPU, fp32 on a CPU), bf16, fp16 or fp32.")] = "auto",
    json_file: JsonFileOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Time greedy answers at batch 1 with each draft against plain decoding (tokens/s, tokens per forward).

    Example: [bold]ligertune bench decode runs/quickstart --drafts none,ngram -n 256 --json decode.json[/]
    """
    import transformers

    from ligertune.bench.decode import DecodeBenchConfig, bench_prompts, decode_table, run_decode_bench
    from ligertune.bench.report import write_json

    transformers.utils.logging.disable_progress_bar()
    config = DecodeBenchConfig(
        drafts=tuple(d.strip() for d in drafts.split(",") if d.strip()),
        prompts=bench_prompts(prompt or (), prompts_from, max_prompts=max_prompts),
        max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, depth=depth, device=device, dtype=dtype,
        trust_remote_code=trust_remote_code,
    )
    progress = Console(stderr=True, highlight=False)
    report = run_decode_bench(model, config, log=lambda line: progress.print(f"[dim]{line}[/]", markup=True))
    console = Console()
    console.print(decode_table(report))
    if json_file is not None:
        write_json(json_file, report.to_dict())
        console.print(f"wrote {json_file}", markup=False)
