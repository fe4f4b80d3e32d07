"""`ligertune chat`: talk to a trained model, interactively or one prompt at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from ligertune.cli.interrupts import INTERRUPTS, is_ctrl_c
from ligertune.cli.options import DeviceOpt, TrustRemoteCodeOpt
from ligertune.errors import UserError, first_line

HELP = ("/system TEXT sets the system prompt and starts over, /tool TEXT answers a tool call with its "
        "result, /reset starts over, /exit (or Ctrl-D) quits")


def chat(
    model: Annotated[
        Path, typer.Argument(help="A run, a checkpoint, a merged model or any Hugging Face model folder.",
                             show_default=False, metavar="RUN_OR_MODEL")
    ],
    prompt: Annotated[
        Optional[str], typer.Option("--prompt", "-p", help="Answer this one message and exit.",
                                    show_default=False)
    ] = None,
    json_: Annotated[
        bool, typer.Option("--json", help="With --prompt: print the prompt, answer, token counts and "
                           "settings as one JSON object.")
    ] = False,
    system: Annotated[
        Optional[str], typer.Option("--system", help="System prompt; by default the run's "
                                    "data.system_prompt, if it trained under one.", show_default=False)
    ] = None,
    tools: Annotated[
        Optional[Path], typer.Option("--tools", help="A JSON file of function definitions to offer the "
                                     "model (a list, as a data record's `tools`).", show_default=False)
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="0 answers greedily (the same answer every time); "
                            "above 0 samples.")
    ] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the most likely tokens "
                                         "up to this probability mass (with --temperature > 0).")] = 1.0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Longest reply, in tokens.")
    ] = 256,
    seed: Annotated[
        Optional[int], typer.Option("--seed", help="Seed of the sampling (with --temperature > 0).",
                                    show_default=False)
    ] = None,
    draft: Annotated[
        str, typer.Option("--draft", help="Speculative decoding: none (one token per forward), ngram (guesses "
                          "from earlier text, verified by the model) or medusa (the run's Medusa heads). "
                          "Greedy answers are the same whatever the draft.")
    ] = "none",
    accept: Annotated[
        str, typer.Option("--accept", help="With a draft and --temperature > 0: exact (rejection sampling, "
                          "the plain sampling distribution) or typical (Medusa's rule: more guesses kept, "
                          "not the same distribution).")
    ] = "exact",
    device: DeviceOpt = "auto",
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto (bf16 on a GPU, fp32 on a CPU), bf16, fp16 or fp32.")
    ] = "auto",
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Chat with a trained model through its tokenizer's chat template; the reply streams as it comes.

    Without --prompt: an interactive conversation (/system TEXT, /reset, /exit or Ctrl-D).
    With --prompt: one answer on stdout (--json: prompt, answer and token counts, for scripts).

    Example: [bold]ligertune chat runs/quickstart --prompt "uppercase yarn" --json[/]
    """
    import transformers

    from ligertune.decoding import make_drafter
    from ligertune.inference import (
        ChatSession,
        check_sampling,
        load_for_inference,
        locate_model,
        require_chat_template,
        run_recipe,
    )

    if json_ and prompt is None:
        raise UserError("--json: needs --prompt (one answer, for scripts)")
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, accept=accept)
    # before loading: a draft the model cannot serve (medusa without heads) is refused at once
    drafter = None if draft == "none" else make_drafter(
        draft, model_dir=locate_model(model, trust_remote_code=trust_remote_code).model_dir)
    transformers.utils.logging.disable_progress_bar()
    loaded = load_for_inference(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    require_chat_template(loaded)
    if system is None:  # the system prompt the run trained under, if any
        recipe = run_recipe(loaded.source)
        system = recipe.data.system_prompt if recipe is not None else None
    offered = None if tools is None else read_tools(tools, loaded.tokenizer)
    session = ChatSession(loaded.model, loaded.tokenizer, system=system, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, draft=drafter, accept=accept,
                          tools=offered)
    note = Console(stderr=True, highlight=False, soft_wrap=True)
    if prompt is None:
        mode = "greedy" if temperature == 0 else f"temperature {temperature:g}, top-p {top_p:g}"
        if drafter is not None:
            mode += f", {draft} draft" + (f", {accept} acceptance" if temperature > 0 else "")
        note.print(Text(f"{loaded.source.describe()}, {loaded.device.type}, "
                        f"{str(loaded.dtype).removeprefix('torch.')}, {mode}", style="dim"))
        note.print(Text(HELP, style="dim"))
        interact(session, Console(highlight=False, soft_wrap=True))
        return
    if json_:
        reply = session.ask(prompt)
        print(json.dumps({"model": str(model), "system": system, "tools": offered, "prompt": prompt,
                          "answer": reply.text,
                          "prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                          "finish_reason": reply.finish_reason, "temperature": temperature, "top_p": top_p,
                          "max_new_tokens": max_new_tokens, "seed": seed, "draft": draft,
                          "accept": accept if drafter is not None and temperature > 0 else None,
                          "forwards": reply.forwards, "tokens_per_step": round(reply.tokens_per_step, 4),
                          "mean_accepted": round(reply.mean_accepted, 4),
                          "acceptance_per_depth": [round(r, 4) for r in reply.acceptance_per_depth],
                          "tokens_per_s": round(reply.tokens_per_s, 2)}, indent=2, ensure_ascii=False))
        return
    reply = session.ask(prompt, on_text=write)
    write("\n")
    if reply.finish_reason == "length":
        note.print(Text(f"stopped at --max-new-tokens {max_new_tokens}", style="dim"))


def interact(session, console: Console) -> None:
    """Read a line, answer it with the reply streamed, until /exit, Ctrl-D or Ctrl-C at the prompt."""
    while True:
        try:
            line = console.input("[bold cyan]>[/] ").strip()
        except EOFError:
            console.print()
            return
        except INTERRUPTS as err:
            if not is_ctrl_c(err):  # SIGTERM stops the command (exit 143)
                raise
            console.print()
            return
        if not line:
            continue
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                session.reset()
                console.print("[dim]new conversation[/]")
            elif command == "/system":
                session.set_system(argument.strip())
                state = "set" if session.system else "cleared"
                console.print(f"[dim]system prompt {state}; new conversation[/]")
            elif command == "/tool" and argument.strip():
                answer(session, console, argument.strip(), role="tool")
            else:  # the user's text, as Text: `/[/x]` is not rich markup
                console.print(Text.assemble((f"unknown command {command}", "yellow"), f": {HELP}"))
            continue
        answer(session, console, line)


def answer(session, console: Console, text: str, *, role: str = "user") -> None:
    """Ask `text` (a user's message, or a tool's result) and stream the reply; an interrupted reply or
    an error leaves the conversation as it was."""
    try:
        reply = session.ask(text, role=role, on_text=write)
    except INTERRUPTS as err:
        if not is_ctrl_c(err):
            raise
        console.print("\n[dim]interrupted; the question is dropped[/]")
        return
    except UserError as err:  # e.g. a chat template without a system role: the loop goes on
        console.print(Text.assemble(("error:", "bold red"), " ", str(err)))
        return
    write("\n")
    if reply.finish_reason == "length":
        console.print(f"[dim](stopped at {reply.completion_tokens} tokens: --max-new-tokens)[/]")


def read_tools(path: Path, tokenizer) -> list[dict]:
    """The function definitions of a `--tools` file, once the model's chat template is known to write them."""
    from ligertune.data.chat import ONE_EXCHANGE, renders_alike
    from ligertune.data.formats import RecordError, record_tools

    try:
        tools = record_tools({"tools": json.loads(path.read_text(encoding="utf-8"))})
    except FileNotFoundError:
        raise UserError(f"--tools: {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecordError) as err:
        raise UserError(f"--tools: {path}: {first_line(err)}") from None
    if not tools:
        raise UserError(f"--tools: {path}: no function definitions in it")
    question = ONE_EXCHANGE[:1]
    if renders_alike(tokenizer, question, tools, question, None, add_generation_prompt=True):
        raise UserError("--tools: the model's chat template does not write tools into the prompt")
    return tools


def write(text: str) -> None:
    """Reply text goes to stdout as it is, unstyled, and at once."""
    sys.stdout.write(text)
    sys.stdout.flush()
