"""Using a trained model: finding it from a run, a checkpoint or a model folder, and answering a chat.

    loaded = load_for_inference(Path("runs/quickstart"))       # the run's final/: full model or LoRA
    messages = [{"role": "user", "content": "What is packing?"}]
    reply = generate_reply(loaded.model, loaded.tokenizer, messages, on_text=print)
    reply.text, reply.prompt_tokens, reply.completion_tokens, reply.finish_reason

    # speculative decoding: n-gram drafts, verified by the model (the same greedy answer, sooner)
    reply = generate_reply(loaded.model, loaded.tokenizer, messages, draft=ligertune.decoding.NgramDraft())
    reply.tokens_per_step, reply.acceptance_per_depth, reply.tokens_per_s

What a path may be (`locate_model`):

    runs/x                          a run (recipe.yaml): its final/
    runs/x/final                    a full model (config.json + weights) or LoRA adapters
                                    (adapter_config.json), with any Medusa heads beside them; or
                                    Medusa heads alone over an unchanged base (base_model.json)
    runs/x/checkpoints/step-000100  the same files at the top of a checkpoint
    any/folder                      any Hugging Face model folder, or a peft adapter folder whose
                                    adapter_config.json names a local base model

LoRA adapters are applied to the base model the run's recipe describes (`model.name_or_path`, or
`model.config` rebuilt with the same random weights under `train.seed`); Medusa heads trained over a
frozen model come with that base, built the same way (`ligertune.models.medusa.load_heads` reads the
heads of `model_dir`).

What is trusted: weights are read as data only (safetensors, or torch files with `weights_only`),
each checked before use (`ligertune.weights`). Code shipped with a model (an `auto_map` in its
config.json or tokenizer_config.json, a recipe's `model.trust_remote_code`) runs only when the person
at the command line says so (`trust_remote_code=True`, `--trust-remote-code`): a run folder copied
from elsewhere never turns it on by itself (`check_remote_code`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from transformers import GenerationConfig, TextStreamer

from ligertune.data.chat import special_ids, turn_end_ids
from ligertune.decoding import DecodeStats, Drafter, Sampling, accept_rule, speculative_generate
from ligertune.devices import resolve_device, resolve_dtype
from ligertune.errors import UserError, first_line
from ligertune.models.medusa import BASE_NOTE, read_base_note
from ligertune.recipe import ModelConfig, Recipe
from ligertune.training.checkpoint import checkpoint_steps
from ligertune.training.run_dir import CHECKPOINTS
from ligertune.weights import check_weight_files

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
RUN_RECIPE = "recipe.yaml"
TRUST_FLAG = "--trust-remote-code"
_TOKENIZER_FILES = (TOKENIZER_CONFIG, "tokenizer.json", "tokenizer.model", "vocab.json")


# --------------------------------------------------------------------------------------------------
# finding the model


@dataclass(frozen=True)
class ModelSource:
    """What a path handed to `merge` or `chat` points at."""

    path: Path
    """The path as given."""
    model_dir: Path
    """The folder holding the Hugging Face files: config.json + weights, or adapter_config.json."""
    run_dir: Path | None
    """The run (folder with recipe.yaml) that wrote `model_dir`, when there is one."""
    adapters: bool
    """True when `model_dir` holds LoRA adapters rather than a whole model."""
    frozen_base: bool = False
    """True when `model_dir` holds Medusa heads trained over a frozen model (`base_model.json`): the
    model is their base, unchanged, loaded as the adapters' base is."""
    trust_remote_code: bool = False
    """Code shipped with the model may run: the choice of the person at the command line
    (`--trust-remote-code`), never of the run's recipe."""

    def describe(self) -> str:
        kind = "LoRA adapters" if self.adapters else "Medusa heads over their base" if self.frozen_base else "model"
        return f"{kind} in {self.model_dir}"


def locate_model(path: Path, *, trust_remote_code: bool = False) -> ModelSource:
    """Resolve a run, a checkpoint, a run's final/ or a model folder to the folder of model files.

    A user error names `path` when it does not exist or holds no model.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"{path}: not found")
    if not path.is_dir():
        raise UserError(f"{path}: is a file; expected a run, a checkpoint or a model folder")
    model_dir = path
    if _is_run(path) and not _holds_model(path):
        model_dir = path / "final"
        if not _holds_model(model_dir):
            raise UserError(f"{path}: the run has no final/ model yet{_checkpoint_hint(path)}")
    if not _holds_model(model_dir):
        raise UserError(
            f"{path}: holds no model: expected a run (recipe.yaml and final/), a checkpoint "
            f"(checkpoints/step-N) or a Hugging Face model folder ({MODEL_CONFIG} or {ADAPTER_CONFIG})"
        )
    adapters = (model_dir / ADAPTER_CONFIG).is_file()
    return ModelSource(path=path, model_dir=model_dir, run_dir=_run_of(model_dir), adapters=adapters,
                       trust_remote_code=trust_remote_code,
                       frozen_base=not adapters and not (model_dir / MODEL_CONFIG).is_file())


def run_recipe(source: ModelSource) -> Recipe | None:
    """The recipe of the run that wrote the model (its resolved recipe.yaml), if there is one, with
    `model.trust_remote_code` set to the command line's choice: a recipe that turns it on is
    refused unless that choice was made."""
    if source.run_dir is None:
        return None
    from ligertune.recipe import load_recipe

    path = source.run_dir / RUN_RECIPE
    recipe = load_recipe(path)
    if recipe.model.trust_remote_code and not source.trust_remote_code:
        raise UserError(f"{path}: model.trust_remote_code is true: this run's model loads with code of its "
                        f"own, which would run on this machine; refused. Pass {TRUST_FLAG} if you trust it")
    model = dataclasses.replace(recipe.model, trust_remote_code=source.trust_remote_code)
    return dataclasses.replace(recipe, model=model)


def check_source(source: ModelSource, recipe: Recipe | None) -> None:
    """What loading `source` would run and read, checked before anything loads: code of the model's
    own only with `source.trust_remote_code` (`check_remote_code`), and whole weight files
    (`ligertune.weights`): the model folder's and, under adapters, a local base model's."""
    check_remote_code(source, recipe)
    for folder in dict.fromkeys(f for f in (source.model_dir, _base_folder(source, recipe)) if f):
        check_weight_files(folder)


def check_remote_code(source: ModelSource, recipe: Recipe | None) -> None:
    """Refuse, unless `source.trust_remote_code`, a model whose config.json or tokenizer_config.json
    maps an Auto class to code of its own (`auto_map`): in the model folder, or in the local folders
    of the base model and tokenizer loaded with it."""
    if source.trust_remote_code:
        return
    folders = (source.model_dir, _tokenizer_folder(source, recipe), _base_folder(source, recipe))
    for folder in dict.fromkeys(f for f in folders if f):
        for name in (MODEL_CONFIG, TOKENIZER_CONFIG):
            modules = _remote_modules(folder / name)
            if modules:
                raise UserError(
                    f"{folder / name}: its auto_map names code of its own ({', '.join(modules)}), which "
                    f"loading the model would run on this machine; refused. Pass {TRUST_FLAG} if you trust it"
                )


def _base_folder(source: ModelSource, recipe: Recipe | None) -> Path | None:
    """The local folder of the adapters' (or frozen-base Medusa heads') base model: none for a whole
    model, a base built from a config or a hub id."""
    if not source.adapters and not source.frozen_base:
        return None
    return _local_folder(recipe.model.name_or_path if recipe is not None else _named_base(source))


def _tokenizer_folder(source: ModelSource, recipe: Recipe | None) -> Path | None:
    """The local folder the tokenizer loads from (`load_tokenizer_for`)."""
    if _holds_tokenizer(source.model_dir):
        return source.model_dir
    return _local_folder(recipe.model.tokenizer or recipe.model.name_or_path) if recipe is not None else None


def _local_folder(name: str | None) -> Path | None:
    path = Path(name).expanduser() if name else None
    return path if path is not None and path.is_dir() else None


def _remote_modules(config_path: Path) -> list[str]:
    """The Python files a config's `auto_map` names (`{"AutoModelForCausalLM": "modeling_x.XModel"}`:
    modeling_x.py), or none."""
    try:
        auto_map = json.loads(config_path.read_text(encoding="utf-8")).get("auto_map")
    except (OSError, ValueError, AttributeError):  # absent or not a JSON object: nothing it could map
        return []
    if not isinstance(auto_map, dict):
        return []
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    # "module.Class", or "repo--module.Class" for code that lives in another repository
    return sorted({r.split("--")[-1].rpartition(".")[0] + ".py" for r in refs}) or ["auto_map"]


def _is_run(folder: Path) -> bool:
    return (folder / RUN_RECIPE).is_file()


def _holds_model(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (ADAPTER_CONFIG, MODEL_CONFIG, BASE_NOTE))


def _holds_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def _run_of(model_dir: Path) -> Path | None:
    """The run directory: the folder itself, its parent (final/) or its grandparent (checkpoints/step-N)."""
    parent = Path(os.path.normpath(model_dir / ".."))  # `..` of `.` too, and relative paths stay relative
    candidates = [model_dir, parent]
    if parent.resolve().name == CHECKPOINTS:
        candidates.append(Path(os.path.normpath(parent / "..")))
    return next((c for c in candidates if _is_run(c)), None)


def _checkpoint_hint(run_dir: Path) -> str:
    steps = [path for _, path in checkpoint_steps(run_dir / CHECKPOINTS) if _holds_model(path)]
    if not steps:
        return " (still training, or stopped before saving one)"
    return f"; pass one of its checkpoints, e.g. {steps[-1]}"


# --------------------------------------------------------------------------------------------------
# loading


@dataclass
class LoadedModel:
    """A model ready to generate, with its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    source: ModelSource
    device: torch.device
    dtype: torch.dtype


def load_tokenizer_for(source: ModelSource, recipe: Recipe | None = None):
    """The tokenizer saved beside the model (what a run writes into final/ and its checkpoints),
    else the one the run's recipe names."""
    from transformers import AutoTokenizer

    if _holds_tokenizer(source.model_dir):
        try:
            return AutoTokenizer.from_pretrained(source.model_dir, trust_remote_code=source.trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"{source.model_dir}: cannot load its tokenizer: {first_line(err)}") from None
    if recipe is not None:
        from ligertune.models import load_tokenizer

        return load_tokenizer(recipe.model)
    raise UserError(f"{source.model_dir}: no tokenizer files there and no run recipe.yaml to name one")


def base_model_config(source: ModelSource, recipe: Recipe | None) -> tuple[ModelConfig, int]:
    """The recipe's `model` section (for the model's own attention, plain sdpa) and seed of the
    adapters' base; a bare adapter folder's base is its adapter_config.json `base_model_name_or_path`.
    Remote code is trusted as `source` says (`run_recipe` has set the recipe's so)."""
    if recipe is not None:
        return dataclasses.replace(recipe.model, attention="sdpa"), recipe.train.seed
    base = _named_base(source)
    if not base:
        what, note = ("LoRA adapters", ADAPTER_CONFIG) if source.adapters else ("Medusa heads", BASE_NOTE)
        raise UserError(
            f"{source.path}: {what} without their base model: no run recipe.yaml above them and "
            f"no base_model_name_or_path in {note}"
        )
    return ModelConfig(name_or_path=base, attention="sdpa", trust_remote_code=source.trust_remote_code), 0


def _named_base(source: ModelSource) -> str | None:
    """The base model that the folder's own files name: adapter_config.json's, or base_model.json's
    for Medusa heads over a frozen model."""
    return _adapters_base(source) if source.adapters else read_base_note(source.model_dir)


def _adapters_base(source: ModelSource) -> str | None:
    """The `base_model_name_or_path` of the adapters' adapter_config.json."""
    path = source.model_dir / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read: {first_line(err)}") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return base if isinstance(base, str) else None


def load_base_with_adapters(source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                            tokenizer, recipe: Recipe | None, dequantize: bool = False):
    """The base model with the adapters of `source.model_dir` applied (a `peft.PeftModel`, eval mode).

    A base that trained quantized (`model.quantization`, QLoRA) is quantized again as it was; with
    `dequantize`, its quantized layers are then replaced by plain ones holding the dequantized
    weights in `dtype`: the weights the adapters were trained over, in a model that merges and saves
    as any other.
    """
    from peft import PeftModel

    from ligertune.models import build_model
    from ligertune.models.quantize import dequantize_linears

    model_cfg, seed = base_model_config(source, recipe)
    base = build_model(model_cfg, device=device, dtype=dtype, seed=seed, vocab_size=len(tokenizer))
    if dequantize and model_cfg.quantization is not None:
        dequantize_linears(base, dtype)
    try:
        with warnings.catch_warnings():  # peft calls an API deprecated in transformers 5: not the user's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = PeftModel.from_pretrained(base, source.model_dir, is_trainable=False)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"{source.model_dir}: cannot apply the adapters to their base model: "
                        f"{first_line(err)}") from None
    return model.to(device).eval()


def load_base_model(source: ModelSource, *, device: torch.device, dtype: torch.dtype, tokenizer,
                    recipe: Recipe | None):
    """The unchanged base model of Medusa heads trained over a frozen model (eval mode): the run's
    recipe's model, built as the adapters' base is (`base_model_config`)."""
    from ligertune.models import build_model

    model_cfg, seed = base_model_config(source, recipe)
    return build_model(model_cfg, device=device, dtype=dtype, seed=seed, vocab_size=len(tokenizer)).to(device).eval()


def load_full_model(model_dir: Path, *, device: torch.device, dtype: torch.dtype,
                    trust_remote_code: bool = False):
    """A whole model folder through `from_pretrained` (eval mode)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{model_dir}: cannot load the model: {first_line(err)}") from None
    return model.to(device).eval()


def load_for_inference(path: Path, *, device: str = "auto", dtype: str = "auto",
                       merge_adapters: bool = True, trust_remote_code: bool = False) -> LoadedModel:
    """A run, checkpoint or model folder loaded for generation on `device` in `dtype`.

    LoRA adapters are applied to their base and, with `merge_adapters`, merged into it (the same
    function, one matmul less per layer and token), unless the base is quantized: merging would
    round W + s B A back to 4 or 8 bits, a model other than the one trained. `dtype="auto"` is
    bfloat16 on CUDA and float32 on the CPU; errors in `device` and `dtype` name the options
    `--device` and `--dtype`. Code shipped with the model runs only with `trust_remote_code`.
    """
    source = locate_model(path, trust_remote_code=trust_remote_code)
    torch_device = resolve_device(device, key="--device")
    torch_dtype = resolve_dtype(dtype, torch_device, key="--dtype")
    recipe = run_recipe(source)
    check_source(source, recipe)
    tokenizer = load_tokenizer_for(source, recipe)
    if source.adapters:
        model = load_base_with_adapters(source, device=torch_device, dtype=torch_dtype,
                                        tokenizer=tokenizer, recipe=recipe)
        if merge_adapters and not (recipe is not None and recipe.model.quantization is not None):
            model = model.merge_and_unload()
    elif source.frozen_base:
        model = load_base_model(source, device=torch_device, dtype=torch_dtype, tokenizer=tokenizer, recipe=recipe)
    else:
        model = load_full_model(source.model_dir, device=torch_device, dtype=torch_dtype,
                                trust_remote_code=source.trust_remote_code)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, device=torch_device,
                       dtype=torch_dtype)


# --------------------------------------------------------------------------------------------------
# generating


@dataclass
class Reply:
    """One generated assistant turn."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    """`stop` (the model ended its turn) or `length` (`max_new_tokens` reached)."""
    seconds: float = 0.0
    """Wall clock of the generation, prompt included, the device synchronized at both ends."""
    stats: DecodeStats = dataclasses.field(default_factory=DecodeStats, repr=False)
    """Model forwards, and what each one's draft proposed and kept (`ligertune.decoding`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards(self) -> int:
        """Model forwards that wrote the reply (the prompt's included): `completion_tokens` without a draft."""
        return self.stats.forwards

    @property
    def tokens_per_step(self) -> float:
        """Reply tokens per model forward: 1 without a draft, more as drafted tokens are accepted."""
        return self.stats.tokens_per_step

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per forward."""
        return self.stats.mean_accepted

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Entry d - 1: of the forwards whose draft reached d tokens ahead, the share that kept d or more."""
        return self.stats.acceptance_per_depth()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def require_chat_template(loaded: LoadedModel) -> None:
    """Refuse, naming the folder, a tokenizer that cannot render a conversation."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise UserError(f"{loaded.source.model_dir}: its tokenizer has no chat template, which chat "
                        "needs to render the conversation")


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """The token ids of `messages` (and the `tools` offered) through the tokenizer's chat template,
    opening the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat template: chat needs one to render the conversation")
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as err:  # jinja2's TemplateError, raised by the template itself (e.g. "no system role")
        raise UserError(f"the chat template refused the conversation: {first_line(err)}") from None
    # The template writes its own special tokens (BOS included); adding them again would double them.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a reply: the tokenizer's EOS, the token(s) its chat template closes an
    assistant turn with (`<|im_end|>` under a base model's EOS `<|endoftext|>`), and the generation
    config's end tokens.

    Only special tokens count: a model built from a config carries its architecture's default
    `eos_token_id` (2 for Llama), which in the run's own tokenizer may be an ordinary byte.
    """
    special = special_ids(tokenizer)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = [configured] if isinstance(configured, int) else configured or []
    for i in [*turn_end_ids(tokenizer), *configured]:
        if i in special and i not in ids:
            ids.append(i)
    return ids


def check_sampling(*, max_new_tokens: int, temperature: float, top_p: float, accept: str = "exact") -> None:
    """Refuse generation settings that cannot work, naming the `chat` option of each."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise UserError(f"--temperature: must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1], got {top_p}")
    accept_rule(Sampling(temperature, top_p), accept)  # an unknown rule is refused at any temperature


@torch.no_grad()
def generate_reply(
    model,
    tokenizer,
    messages: list[dict[str, str]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    draft: Drafter | None = None,
    accept: str = "exact",
    tools: list[dict] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Reply:
    """The model's next assistant turn after `messages` (role/content dicts), offered `tools`
    (function definitions, written by the chat template) when given.

    `temperature=0` decodes greedily (the same answer every time); above 0 it samples with nucleus
    `top_p`, under `seed` when given (the global random state is left as it was). `on_text`
    receives the reply's text piece by piece, as whole words are generated.

    With a `draft` (`ligertune.decoding`), each forward verifies the drafter's guesses and keeps
    those the model confirms: greedy answers are the plain greedy answer, token for token; sampled
    ones follow `accept` (`exact`: the plain sampling distribution; `typical`: Medusa's rule).
    """
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, accept=accept)
    prompt_ids = render_prompt(tokenizer, messages, tools)
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    streamer = _TextCallback(tokenizer, on_text) if on_text is not None else None
    _synchronize(device)
    started = time.perf_counter()
    with _seeded(seed, device):
        if draft is None:
            new_ids = _plain_generate(model, tokenizer, prompt_ids, stops, streamer, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p)
            stats = DecodeStats.plain(len(new_ids))
        else:
            if streamer is not None:
                streamer.put(torch.tensor(prompt_ids))  # skipped: the streamer shows the reply only
            result = speculative_generate(
                model, prompt_ids, draft, accept_rule(Sampling(temperature, top_p), accept),
                max_new_tokens=max_new_tokens, stop_ids=stops,
                on_tokens=None if streamer is None else lambda ids: streamer.put(torch.tensor(ids)),
            )
            if streamer is not None:
                streamer.end()
            new_ids, stats = result.ids, result.stats
    _synchronize(device)
    seconds = time.perf_counter() - started
    finished = bool(new_ids) and new_ids[-1] in stops
    return Reply(
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(new_ids),
        finish_reason="stop" if finished else "length",
        seconds=seconds,
        stats=stats,
    )


def _plain_generate(model, tokenizer, prompt_ids: list[int], stops: list[int], streamer, *,
                    max_new_tokens: int, temperature: float, top_p: float) -> list[int]:
    """The reply's token ids through `model.generate`: one forward per token."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [0])[0]
    # A fresh config: sampling defaults shipped with the model (temperature, top_k) must not leak
    # into a greedy reply.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=stops or None, pad_token_id=pad,
        do_sample=temperature > 0, **({"temperature": temperature, "top_p": top_p, "top_k": 0}
                                      if temperature > 0 else {}),
    )
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            generation_config=config, streamer=streamer)
    return output[0, len(prompt_ids):].tolist()


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall clock around it measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TextCallback(TextStreamer):
    """`TextStreamer` that hands each finished piece of text to a function instead of printing it."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self._on_text(text)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class ChatSession:
    """A conversation with a model: an optional system prompt and the turns so far.

    A reply joins the history only once it is complete, so an interrupted one leaves the
    conversation as it was before the question.
    """

    def __init__(self, model, tokenizer, *, system: str | None = None, **generation: Any):
        self.model = model
        self.tokenizer = tokenizer
        self.system = system or None
        self.turns: list[dict[str, str]] = []
        self.generation = generation
        """Keyword arguments of `generate_reply`: max_new_tokens, temperature, top_p, seed, draft, accept,
        tools."""

    @property
    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def ask(self, text: str, *, role: str = "user", on_text: Callable[[str], None] | None = None) -> Reply:
        """The reply to `text`, a user's message (or with `role="tool"`, a tool's result)."""
        question = {"role": role, "content": text}
        reply = generate_reply(self.model, self.tokenizer, [*self.messages, question], on_text=on_text,
                               **self.generation)
        self.turns += [question, {"role": "assistant", "content": reply.text}]
        return reply

    def reset(self) -> None:
        """Forget the turns; keep the system prompt."""
        self.turns = []

    def set_system(self, text: str | None) -> None:
        """A new system prompt (none when empty) starts a new conversation."""
        self.system = text or None
        self.turns = []
