"""The recipe: a typed, validated schema loaded from YAML, with `key=value` overrides.

A recipe is plain YAML with one mapping per section (`model`, `data`, `kernels`, `loss`, `lora`,
`optim`, `train`, `output`). Loading collects *every* problem before failing, each with its key path
(`optim.lr: must be > 0, got -1`), with a "did you mean" for unknown keys, so one run of
`ligertune validate` shows all that is wrong. A key given twice in one mapping is a problem (YAML
would keep the second silently), and a problem at a key written by `--set KEY=VALUE` is reported
as that override's. Numbers must be finite and integers fit in 64 bits, whatever the field.

Paths in a recipe (`model.name_or_path`, `model.tokenizer`, `data.path`, `data.sources[].path`,
`data.eval_path`) are looked up next to the recipe file first, so a recipe and its data travel
together; a path that is not there is kept as written (a hub id, or a path relative to the current
directory) unless its first folder is there. `output.dir` is relative to the current directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from ligertune import hub
from ligertune.errors import RecipeError, first_line

# Every integer of a recipe fits in 64 bits: torch and the C code below it take nothing larger.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# Bounds past which a value is surely a typo and would fail late: an epoch count that overflows the
# step count, adapters that cannot be allocated, a sample list that does not fit in memory.
MAX_EPOCHS = 1e6
MAX_LORA_RANK = 65536
MAX_SAMPLES = 100_000_000
MAX_MICRO_BATCH = 65536
MAX_GRAD_ACCUM = 1_000_000
MAX_THREADS = 4096
# The label of untrained tokens: the data pipeline writes it (`ligertune.data` takes it from here, the
# upstream end of the data flow) and `loss.ignore_index` must name it.
IGNORE_INDEX = -100


def _field(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A dataclass field that carries its documentation (shown by `docs/recipe.md` and `recipes show`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


# --------------------------------------------------------------------------------------------------
# Sections

DEFAULT_BETAS = {"adamw": (0.9, 0.999), "lion": (0.9, 0.99)}
"""`optim.betas` when the recipe gives none: torch's AdamW default, and the Lion paper's."""


@dataclass
class ModelConfig:
    """Which model to train and how to run it."""

    name_or_path: str | None = _field(
        None, "Hub id or local directory of a pretrained model (config, weights, tokenizer)."
    )
    config: str | dict | None = _field(
        None,
        "Build the model from a config with random weights instead: a preset name "
        "(see `ligertune.models.PRESETS`) or a mapping of config fields with `model_type`.",
    )
    tokenizer: str | None = _field(
        None, "Hub id or local directory of the tokenizer; defaults to `name_or_path`."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _field(
        "auto", "Parameter dtype: `auto` is bfloat16 on a GPU and float32 on a CPU."
    )
    quantization: Literal["nf4", "int8"] | None = _field(
        None,
        "QLoRA: store the decoder's linear layers in 4-bit NF4 (`nf4`) or LLM.int8() (`int8`) through "
        "bitsandbytes and train LoRA adapters over them (needs `lora`, one process, and the extra: "
        "pip install 'ligertune[qlora]'). Embeddings, norms and the output projection stay in `dtype`.",
    )
    attention: Literal["packed", "sdpa", "eager"] = _field(
        "packed",
        "`packed`: conversations in a pack attend only to themselves (varlen attention on CUDA, "
        "a block-diagonal mask on CPU). `sdpa`/`eager`: the model's own attention, for padded batches.",
    )
    trust_remote_code: bool = _field(False, "Allow model code from the hub (off by default).")

    def check(self) -> list[tuple[str, str]]:
        if (self.name_or_path is None) == (self.config is None):
            return [("", "give exactly one of `name_or_path` (pretrained) or `config` (random init)")]
        if isinstance(self.config, dict) and "model_type" not in self.config:
            return [("config", "a config mapping needs `model_type` (e.g. llama)")]
        return []


@dataclass
class DataSource:
    """One data source of several; `weight` or `samples` sets its share."""

    path: str = _field(doc="Local .jsonl/.json/.parquet file, or a hub dataset name.")
    format: Literal["auto", "messages", "sharegpt", "prompt_completion"] = _field(
        "auto", "Record format; `auto` detects it from the first record."
    )
    split: str = _field("train", "Split to read when `path` is a hub dataset.")
    weight: float | None = _field(None, "Relative share of this source (repeated or subsampled to its share).")
    samples: int | None = _field(
        None, f"Exact number of conversations to take from this source (at most {MAX_SAMPLES:,})."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.weight is not None and self.samples is not None:
            problems.append(("", "give `weight` or `samples`, not both"))
        if self.weight is not None and self.weight <= 0:
            problems.append(("weight", f"must be > 0, got {self.weight}"))
        if self.samples is not None and not 0 < self.samples <= MAX_SAMPLES:
            problems.append(("samples", f"must be in [1, {MAX_SAMPLES:,}], got {self.samples}"))
        return problems


@dataclass
class DataConfig:
    """Chat data, how it is rendered, masked, truncated and packed."""

    path: str | None = _field(None, "One source: local .jsonl/.json/.parquet file or hub dataset name.")
    sources: list[DataSource] = _field(doc="Several sources, each with a weight or a sample count.", factory=list)
    format: Literal["auto", "messages", "sharegpt", "prompt_completion"] = _field(
        "auto", "Record format: OpenAI `messages`, ShareGPT `conversations`, or prompt/completion."
    )
    split: str = _field("train", "Split to read when `path` is a hub dataset.")
    max_seq_len: int = _field(2048, "Tokens per pack (and the longest conversation kept).")
    packing: bool = _field(True, "Pack several conversations per sequence (best-fit decreasing).")
    truncation: Literal["drop_turns", "drop"] = _field(
        "drop_turns",
        "Too-long conversations: `drop_turns` removes trailing turns until it fits (keeping a "
        "trained turn), `drop` drops the conversation. Both are counted and reported.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = _field(
        "assistant", "Which tokens carry loss: every assistant turn, only the last one, or all."
    )
    on_bad_record: Literal["error", "skip"] = _field(
        "error", "A malformed record stops with its file and line (`error`) or is skipped and counted."
    )
    eval_path: str | None = _field(None, "Held-out data for evaluation (same format rules).")
    eval_fraction: float = _field(
        0.0, "Share of the training conversations held out for evaluation when `eval_path` is unset."
    )
    num_workers: int | None = _field(None, "Processes for tokenization; default: all cores.")
    cache_dir: str | None = _field(
        "~/.cache/ligertune", "Where tokenized data is cached (keyed by data, tokenizer, settings); null disables."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if (self.path is None) == (not self.sources):
            problems.append(("", "give exactly one of `path` (one source) or `sources` (several)"))
        if self.max_seq_len < 8:
            problems.append(("max_seq_len", f"must be >= 8, got {self.max_seq_len}"))
        if not 0.0 <= self.eval_fraction < 1.0:
            problems.append(("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}"))
        if self.eval_path is not None and self.eval_fraction > 0:
            problems.append(("eval_fraction", "give `eval_path` or `eval_fraction`, not both"))
        if self.num_workers is not None and self.num_workers < 1:
            problems.append(("num_workers", f"must be >= 1, got {self.num_workers}"))
        if self.sources and any(s.weight is not None for s in self.sources) and any(
            s.samples is not None for s in self.sources
        ):
            problems.append(("sources", "use `weight` on every source or `samples` on every source, not a mix"))
        return problems


@dataclass
class KernelsConfig:
    """Which layers are replaced by ligertune's kernels."""

    rms_norm: bool = _field(True, "RMSNorm layers.")
    rope: bool = _field(True, "Rotary position embedding applied to q and k.")
    swiglu: bool = _field(True, "The SwiGLU activation of the MLP.")
    fused_linear_cross_entropy: bool = _field(
        True, "Output projection + cross-entropy fused: the [tokens, vocab] logits are never stored."
    )
    loss_chunk_mib: int = _field(1024, "Memory budget of the fused loss for its chunk of logits, in MiB.")
    lora: bool = _field(
        True,
        "With `lora`: the LoRA layers compute peft's values without its per-layer overhead: one GEMM "
        "for the A projections of layers that read one input (q, k, v; gate, up), the input kept for "
        "backward in the model dtype instead of a float32 copy per layer, and the adapters kept in "
        "the model dtype (bf16 over a bf16 model; peft upcasts them to float32) so that "
        "y = base(x) + s (x A^T) B^T is one GEMM adding into the base output, rounded once "
        "(docs/kernels.md). Their updates stay exact through `optim.master_weights`. With "
        "`lora.dropout` > 0 or `model.quantization` peft's own forward runs and the adapters stay "
        "float32; `false`: peft's forward and float32 adapters throughout.",
    )

    def check(self) -> list[tuple[str, str]]:
        if self.loss_chunk_mib < 1:
            return [("loss_chunk_mib", f"must be >= 1, got {self.loss_chunk_mib}")]
        return []


@dataclass
class LossConfig:
    """The training objective, defined over one optimizer step (see docs/loss.md)."""

    normalization: Literal["token", "sequence", "sum"] = _field(
        "token",
        "`token`: mean over every supervised token of the step; `sequence`: mean over conversations "
        "of each conversation's token mean; `sum`: plain sum.",
    )
    z_loss_weight: float = _field(0.0, "Weight of the z-loss (log Z)^2 term; 0 disables it.")
    label_smoothing: float = _field(0.0, "Label smoothing epsilon, in [0, 1).")
    ignore_index: int = _field(
        IGNORE_INDEX, f"Label value that carries no loss: {IGNORE_INDEX}, the value the data pipeline writes."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.z_loss_weight < 0:
            problems.append(("z_loss_weight", f"must be >= 0, got {self.z_loss_weight}"))
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(("label_smoothing", f"must be in [0, 1), got {self.label_smoothing}"))
        if self.ignore_index != IGNORE_INDEX:
            problems.append(("ignore_index", f"must be {IGNORE_INDEX}, the label the data pipeline gives "
                             f"untrained tokens; got {self.ignore_index}"))
        return problems


@dataclass
class LoraConfig:
    """LoRA adapters through peft; the base model is frozen (and still patched)."""

    r: int = _field(16, f"Adapter rank, 1 to {MAX_LORA_RANK}.")
    alpha: float = _field(32, "Scaling numerator: adapters are scaled by alpha / r.")
    dropout: float = _field(0.0, "Dropout on the adapter input.")
    target_modules: str | list[str] = _field(
        "all-linear", "Module names to adapt, or `all-linear` (every linear layer but the output)."
    )
    bias: Literal["none", "all", "lora_only"] = _field("none", "Which biases are trained.")
    modules_to_save: list[str] | None = _field(None, "Modules trained in full besides the adapters.")
    use_rslora: bool = _field(False, "Rank-stabilized scaling alpha / sqrt(r).")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not 1 <= self.r <= MAX_LORA_RANK:
            problems.append(("r", f"must be in [1, {MAX_LORA_RANK}], got {self.r}"))
        if not 0.0 <= self.dropout < 1.0:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        return problems


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["adamw", "lion"] = _field(
        "adamw",
        "`adamw`: torch's AdamW (fused on CUDA). `lion`: the sign of a momentum (Chen et al. 2023), one "
        "float32 state per parameter where AdamW keeps two; wants a 3-10x smaller `lr` and 3-10x larger "
        "`weight_decay` than AdamW (see docs/optim.md).",
    )
    lr: float = _field(2e-5, "Peak learning rate.")
    betas: list[float] | None = _field(
        None, "(beta1, beta2); null: [0.9, 0.999] for AdamW, [0.9, 0.99] for Lion (filled in when loaded)."
    )
    eps: float = _field(1e-8, "AdamW epsilon (Lion has none).")
    weight_decay: float = _field(0.0, "Decoupled weight decay (not applied to norms and biases).")
    master_weights: bool = _field(
        True,
        "Step bfloat16/float16 trainable parameters through a float32 copy with float32 optimizer states, "
        "rounded into the parameter after each step: 4 more bytes per such parameter, and AdamW's "
        "states in 8 bytes instead of 4. `false`: torch's behaviour, where a bf16 weight does not move "
        "for steps below its spacing and AdamW's bf16 states lose `eps` and the second moment's decay "
        "(docs/optim.md). Float32 parameters (FSDP on CUDA, LoRA adapters without `kernels.lora`) are "
        "unaffected; LoRA adapters under `kernels.lora` have the model's dtype and get a master copy.",
    )
    schedule: Literal["cosine", "linear", "constant"] = _field("cosine", "Decay after warmup.")
    warmup_steps: int = _field(
        0, "Linear warmup from 0 to `lr`, in optimizer steps; no longer than `train.max_steps` when set."
    )
    min_lr_ratio: float = _field(0.0, "Final learning rate as a fraction of `lr` (cosine, linear).")
    clip: Literal["global", "per_tensor"] = _field(
        "global",
        "Gradient clipping to `max_grad_norm`: `global` scales all gradients by one factor, from the "
        "norm over every trainable parameter (all shards); `per_tensor` scales each parameter tensor's "
        "gradient to at most that norm on its own.",
    )
    max_grad_norm: float | None = _field(1.0, "Clip the gradient norm (see `clip`) to this; null disables.")

    def __post_init__(self) -> None:
        if self.betas is None:
            self.betas = list(DEFAULT_BETAS.get(self.name, DEFAULT_BETAS["adamw"]))

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(("betas", f"must be two numbers in [0, 1), got {self.betas}"))
        if self.eps <= 0:
            problems.append(("eps", f"must be > 0, got {self.eps}"))
        if self.weight_decay < 0:
            problems.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if self.warmup_steps < 0:
            problems.append(("warmup_steps", f"must be >= 0, got {self.warmup_steps}"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"))
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            problems.append(("max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm}"))
        return problems


@dataclass
class TrainConfig:
    """The loop: length, batching, evaluation and checkpoint cadence."""

    max_steps: int | None = _field(None, "Optimizer steps to run; overrides `epochs` when set.")
    epochs: float = _field(
        1.0, f"Passes over the training packs when `max_steps` is unset; at most {MAX_EPOCHS:g}."
    )
    micro_batch_size: int = _field(1, f"Packs per forward/backward; at most {MAX_MICRO_BATCH}.")
    grad_accum_steps: int = _field(1, f"Micro-batches per optimizer step; at most {MAX_GRAD_ACCUM:,}.")
    seed: int = _field(0, "Seed for weights, data order and dropout.")
    gradient_checkpointing: bool | Literal["auto"] = _field(
        False, "Recompute decoder layers' activations in backward to save memory: `true` every layer; "
        "`auto` as few layers as fit `memory_budget_gib`, measured on the first step (CUDA; on a CPU "
        "`auto` recomputes none)."
    )
    memory_budget_gib: float | None = _field(
        None, "With `gradient_checkpointing: auto`: the peak device memory (GiB) a step may use; "
        "null: 90% of the GPU's memory."
    )
    activation_offload: bool | Literal["auto"] = _field(
        "auto", "Park the inputs of checkpointed layers in pinned host memory between their forward and "
        "their recompute, the copies overlapped with compute: `auto` where it lets `gradient_checkpointing: "
        "auto` recompute fewer layers (CUDA); `true` always; `false` never."
    )
    device: Literal["auto", "cpu", "cuda"] = _field("auto", "`auto`: CUDA when available, else CPU.")
    log_every: int = _field(1, "Write a metrics record every N optimizer steps.")
    eval_every: int | None = _field(None, "Evaluate on the held-out data every N steps (and at the end).")
    eval_at_start: bool = _field(True, "Evaluate once before the first step, as a baseline.")
    eval_max_conversations: int | None = _field(None, "Cap on held-out conversations per evaluation.")
    save_every: int | None = _field(
        None, "Save a checkpoint (model, optimizer, schedule, RNG, data position) every N steps, to "
        "resume from with `--resume`; the final model is always saved."
    )
    keep_checkpoints: int = _field(3, "Checkpoints kept; the oldest is removed once a new one is complete.")
    max_skipped_steps: int = _field(
        5, "Stop the run after this many consecutive steps skipped for a non-finite loss or gradient "
        "(or a loss spike, with `on_spike: skip`)."
    )
    spike_threshold: float | None = _field(
        6.0,
        "A step's loss is a spike when it exceeds the median of the last `spike_window` losses by more "
        "than this many robust standard deviations (1.4826 x their median absolute deviation); spikes "
        "go to `spikes.jsonl` with the conversations of the step. null disables the watch.",
    )
    spike_window: int = _field(
        32, "Finite step losses the spike watch compares with; it starts once it holds this many."
    )
    on_spike: Literal["log", "skip"] = _field(
        "log", "`log`: record the spike and apply the update; `skip`: record it and drop the update, "
        "like a non-finite step."
    )
    num_threads: int | None = _field(
        None, f"CPU threads for torch, at most {MAX_THREADS}; default: torch's own choice."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every", "eval_every",
                    "save_every", "keep_checkpoints", "max_skipped_steps", "eval_max_conversations",
                    "num_threads"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append((key, f"must be >= 1, got {value}"))
        if not 0 < self.epochs <= MAX_EPOCHS:
            problems.append(("epochs", f"must be in (0, {MAX_EPOCHS:g}], got {self.epochs}"))
        if self.memory_budget_gib is not None:
            if self.memory_budget_gib <= 0:
                problems.append(("memory_budget_gib", f"must be > 0 or null, got {self.memory_budget_gib}"))
            elif self.gradient_checkpointing != "auto":
                problems.append(("memory_budget_gib", "applies to `gradient_checkpointing: auto` only; "
                                 f"gradient_checkpointing is {str(self.gradient_checkpointing).lower()}"))
        if self.activation_offload is True and self.gradient_checkpointing is False:
            problems.append(("activation_offload", "parks the inputs of checkpointed layers; "
                             "gradient_checkpointing is false"))
        if self.spike_threshold is not None and self.spike_threshold <= 0:
            problems.append(("spike_threshold", f"must be > 0 or null, got {self.spike_threshold}"))
        if self.spike_window < 3:
            problems.append(("spike_window", f"must be >= 3 (a median and its deviation), got {self.spike_window}"))
        for key, most in (("micro_batch_size", MAX_MICRO_BATCH), ("grad_accum_steps", MAX_GRAD_ACCUM),
                          ("num_threads", MAX_THREADS)):
            value = getattr(self, key)
            if value is not None and value > most:
                problems.append((key, f"must be <= {most}, got {value}"))
        return problems


@dataclass
class DistributedConfig:
    """Training on several processes (`torchrun` or `ligertune train --nproc N`); unused with one."""

    strategy: Literal["auto", "fsdp", "ddp"] = _field(
        "auto",
        "`fsdp`: FSDP2 shards every decoder layer and the rest of the model over the processes (bf16 "
        "compute over float32 trained weights on CUDA; a LoRA base stays bf16); `ddp`: each process holds the whole model; `auto`: fsdp.",
    )
    timeout_minutes: float = _field(
        10.0, "How long a collective waits for the other processes before the run fails."
    )

    def check(self) -> list[tuple[str, str]]:
        if not self.timeout_minutes > 0:
            return [("timeout_minutes", f"must be > 0, got {self.timeout_minutes}")]
        return []


@dataclass
class OutputConfig:
    """Where the run writes its files."""

    dir: str = _field("runs/ligertune", "Output directory: resolved recipe, metrics.jsonl, final/.")
    overwrite: bool = _field(
        False, "Replace a run already in `dir` (finished or not): it is moved to `DIR.previous` first."
    )
    report_to: list[str] = _field(
        doc="Also send the metrics to `tensorboard` (event files in `dir/tensorboard`) and/or `wandb` "
        "(offline unless logged in); each needs its extra: pip install 'ligertune[tensorboard]'.",
        factory=list,
    )


@dataclass
class Recipe:
    """A whole fine-tuning recipe."""

    model: ModelConfig = _field(doc="The model.", factory=ModelConfig)
    data: DataConfig = _field(doc="The data.", factory=DataConfig)
    kernels: KernelsConfig = _field(doc="Kernel flags.", factory=KernelsConfig)
    loss: LossConfig = _field(doc="The loss.", factory=LossConfig)
    lora: LoraConfig | None = _field(None, "LoRA adapters; absent or null trains every weight.")
    optim: OptimConfig = _field(doc="Optimizer and schedule.", factory=OptimConfig)
    train: TrainConfig = _field(doc="The training loop.", factory=TrainConfig)
    distributed: DistributedConfig = _field(doc="Several processes.", factory=DistributedConfig)
    output: OutputConfig = _field(doc="Output files.", factory=OutputConfig)
    description: str | None = _field(None, "Free text shown by `ligertune recipes ls`.")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.data.packing and self.model.attention != "packed":
            problems.append(("data.packing", "packing needs `model.attention: packed`; with "
                             f"{self.model.attention!r} packed conversations would attend to each other"))
        if self.model.quantization is not None and self.lora is None:
            problems.append(("model.quantization", f"a quantized base ({self.model.quantization}) is frozen: "
                             "train LoRA adapters over it (add a `lora` section, e.g. `--set lora.r=16`)"))
        if self.train.max_steps is not None and self.optim.warmup_steps > self.train.max_steps:
            problems.append(("optim.warmup_steps",
                             f"{self.optim.warmup_steps} warmup steps is longer than the run "
                             f"(train.max_steps: {self.train.max_steps}): the learning rate would never "
                             "reach `optim.lr`"))
        return problems

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Loading


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override, validate and resolve a recipe file; raise `RecipeError` listing every problem.

    Each problem names where it is to be fixed: the recipe file (`recipe.yaml: optim.lr: ...`) or
    the override that wrote its key (`--set optim.lr=-1: must be > 0, got -1.0`).
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(["recipe file not found"], source) from None
    except IsADirectoryError:
        raise RecipeError(["cannot read recipe: it is a directory"], source) from None
    except OSError as err:
        raise RecipeError([f"cannot read recipe: {err.strerror or err}"], source) from None
    except UnicodeDecodeError as err:
        raise RecipeError([f"cannot read recipe: not valid UTF-8 (byte {err.start})"], source) from None
    raw, problems = parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError([f"the recipe must be a mapping of sections, got {describe_value(raw)}"], source)
    raw = apply_overrides(raw, overrides)
    try:
        recipe = recipe_from_dict(raw)
    except RecipeError as err:
        problems = problems + err.problems
    else:
        if not problems:
            return resolve_paths(recipe, path.parent)
    raise RecipeError(_attribute(problems, source, overrides))


def _attribute(problems: list[str], source: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Prefix each `key.path: message` problem with the override that wrote its key (the last one
    that did), else with the recipe file."""
    written = [(item, item.partition("=")[0].strip()) for item in overrides]
    lines = []
    for problem in problems:
        key, _, message = problem.partition(": ")
        for item, wrote in reversed(written):
            if key == wrote:
                lines.append(f"--set {_shorten(item)}: {message}")
                break
            if key.startswith((f"{wrote}.", f"{wrote}[")):
                lines.append(f"--set {_shorten(item)}: {problem}")
                break
        else:
            lines.append(f"{source}: {problem}")
    return lines


def parse_yaml(text: str, source: str, *, lines: bool = True) -> tuple[Any, list[str]]:
    """The YAML document in `text`, and its duplicate keys as problems (`optim: duplicate key, ...`).

    PyYAML keeps the last of two equal keys of a mapping: a second `optim:` section would silently
    replace the first, so every duplicate, at any depth, is reported with both line numbers (`lines`;
    without them for one-line texts). A syntax error raises `RecipeError` with its line and column.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        problems = _duplicate_keys(node, lines=lines)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError([f"YAML syntax error at {where}{err.problem or err.context}"], source) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"YAML error: {first_line(err)}"], source) from None
    except RecursionError:
        raise RecipeError(["YAML error: nested too deeply"], source) from None
    except ValueError as err:  # a constructor's own check: Python reads no integer of over 4300 digits
        reason = "an integer too long to read" if "digits" in str(err) else first_line(err)
        raise RecipeError([f"YAML error: {reason}"], source) from None
    finally:
        loader.dispose()
    return data, problems


def _duplicate_keys(root: yaml.Node | None, *, lines: bool) -> list[str]:
    """`path: duplicate key (lines a and b)` for every key given twice in one mapping, in the order
    of the text, and `path: ...` for an alias to a node that contains it (a recursive structure)."""
    found: list[tuple[int, str]] = []
    stack: list[tuple[yaml.Node, str, frozenset[int]]] = [(root, "", frozenset())] if root is not None else []
    done: set[int] = set()
    while stack:
        node, path, ancestors = stack.pop()
        if id(node) in ancestors:
            found.append((node.start_mark.line, f"{path}: an alias refers to a node that contains it "
                                                 "(a recursive structure)"))
            continue
        if id(node) in done:  # an alias to a node already checked
            continue
        done.add(id(node))
        inside = ancestors | {id(node)}
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                child = f"{path}.{key_node.value}" if path else key_node.value
                first = seen.setdefault((key_node.tag, key_node.value), key_node)
                if first is not key_node:
                    a, b = first.start_mark, key_node.start_mark
                    where = ("" if not lines else f" (lines {a.line + 1} and {b.line + 1})" if a.line != b.line
                             else f" (line {a.line + 1}, columns {a.column + 1} and {b.column + 1})")
                    found.append((key_node.start_mark.line, f"{child}: duplicate key{where}; "
                                  "the second would silently replace the first"))
                stack.append((value_node, child, inside))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                stack.append((item, f"{path}[{i}]", inside))
    return [problem for _, problem in sorted(found, key=lambda f: f[0])]


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `a.b.c=value` overrides (the value parsed as YAML) to a copy of the raw mapping.

    A key missing or null on the way is created as a mapping (`--set lora.r=8` with no `lora`
    section); a key on the way that holds something else is an error, as is a malformed override.
    """
    import copy

    raw = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        shown = _shorten(item)
        if not sep or not all(parts):
            problems.append(f"--set {shown}: expected KEY=VALUE with a dotted KEY, e.g. optim.lr=1e-4")
            continue
        try:
            value, duplicates = parse_yaml(text, f"--set {shown}", lines=False) if text.strip() else (None, [])
        except RecipeError:
            value, duplicates = text, []  # not YAML: the text itself (the schema says if a string fits)
        problems.extend(f"--set {shown}: {key}{'' if p.startswith('[') else '.'}{p}" for p in duplicates)
        node = raw
        for depth, part in enumerate(parts[:-1], 1):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                problems.append(f"--set {shown}: `{'.'.join(parts[:depth])}` holds {describe_value(child)}, "
                                "not a mapping of keys")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise RecipeError(problems)
    return raw


def _shorten(text: str, width: int = 80) -> str:
    return text if len(text) <= width else f"{text[: width - 3]}..."


def recipe_from_dict(raw: dict, source: str | None = None) -> Recipe:
    """Build a `Recipe` from plain data, collecting every problem with its key path."""
    problems: list[str] = []
    recipe = _build(Recipe, raw, "", problems)
    if recipe is not None:
        # Value checks run on every section whose fields all converted (the others hold None).
        broken = {p.split(":", 1)[0] for p in problems}
        problems.extend(_check_all(recipe, "", broken))
    if problems:
        raise RecipeError(problems, source)
    return recipe


def _check_all(obj: Any, prefix: str, broken: set[str]) -> list[str]:
    """Run every section's `check()` and prefix its keys; skip sections with a key in `broken`."""
    problems = []
    if dataclasses.is_dataclass(obj):
        if hasattr(obj, "check") and not any(k == prefix or k.startswith(f"{prefix}.") or not prefix
                                              for k in broken):
            for key, message in obj.check():
                path = ".".join(p for p in (prefix, key) if p)
                problems.append(f"{path}: {message}" if path else message)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            child = f"{prefix}.{f.name}" if prefix else f.name
            if isinstance(value, list):
                for i, item in enumerate(value):
                    problems.extend(_check_all(item, f"{child}[{i}]", broken))
            else:
                problems.extend(_check_all(value, child, broken))
    return problems


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(raw, dict):
        problems.append(f"{path or 'recipe'}: expected a mapping, got {describe_value(raw)}")
        return None
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else f"; known keys: {', '.join(names)}"
            problems.append(f"{key_path}: unknown key{hint}")
            continue
        kwargs[key] = _convert(hints[key], value, key_path, problems)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in raw:
            problems.append(f"{path}.{f.name}: required" if path else f"{f.name}: required")
    try:
        return cls(**kwargs)
    except TypeError:
        return None


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Check `value` against the type hint `tp`, converting where YAML is loose (int -> float)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            problems.append(f"{path}: must not be null")
            return None
        non_null = [o for o in options if o is not type(None)]
        if len(non_null) == 1:
            return _convert(non_null[0], value, path, problems)
        for option in non_null:
            trial: list[str] = []
            result = _convert(option, value, path, trial)
            if not trial:
                return result
        names = " or ".join(_type_name(o) for o in non_null)
        problems.append(f"{path}: expected {names}, got {describe_value(value)}")
        return None
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        problems.append(f"{path}: must be one of {', '.join(map(str, choices))}, got {value!r}{hint}")
        return None
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {describe_value(value)}")
            return None
        return [_convert(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_MIN <= value <= INT_MAX:
                problems.append(f"{path}: out of range: an integer must fit in 64 bits "
                                f"(-2^63 to 2^63-1), got {describe_value(value)}")
                return None
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = _to_float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                problems.append(f"{path}: must be a finite number, got {describe_value(value)}")
                return None
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    elif tp is Any:
        return value
    problems.append(f"{path}: expected {_type_name(tp)}, got {describe_value(value)}")
    return None


def _type_name(tp: Any) -> str:
    if tp is dict:
        return "a mapping"
    if get_origin(tp) is list:
        return "a list"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _to_float(value: int | float) -> float:
    """`float(value)`, infinite where an integer is too large for a float (instead of raising)."""
    try:
        return float(value)
    except OverflowError:
        return math.copysign(math.inf, value)


def describe_value(value: Any, width: int = 60) -> str:
    """A value as a problem message shows it: `null`, `true`, `a list`, or its repr, shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    if isinstance(value, (dict, list)):
        return {dict: "a mapping", list: "a list"}[type(value)]
    if isinstance(value, int) and value.bit_length() > 200:  # repr is slow, or refused, past 4300 digits
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


def resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    """Point relative paths at the recipe's folder when they are found there (`hub.found_in`): a file
    or folder of that name, or the folder that the path starts with (`data/missing.jsonl` next to a
    folder `data`: the path is meant there, and a missing file is reported there rather than looked
    up on the hub)."""

    def local(p: str | None) -> str | None:
        if p is None:
            return None
        expanded = Path(p).expanduser()
        if expanded.is_absolute():
            return str(expanded)
        return str(base / expanded) if hub.found_in(base, expanded) else p

    model = dataclasses.replace(recipe.model, name_or_path=local(recipe.model.name_or_path),
                                tokenizer=local(recipe.model.tokenizer))
    sources = [dataclasses.replace(s, path=local(s.path)) for s in recipe.data.sources]
    data = dataclasses.replace(recipe.data, path=local(recipe.data.path), sources=sources,
                               eval_path=local(recipe.data.eval_path))
    return dataclasses.replace(recipe, model=model, data=data)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what a run writes next to its outputs)."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def field_docs(cls: type = Recipe, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """(key path, type, default, doc) for every field, sections first-to-last (for the docs)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        section = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in get_args(tp) if dataclasses.is_dataclass(a)), None)
        if section is not None and get_origin(tp) is not list:
            yield key, "section", None, f.metadata.get("doc", "")
            yield from field_docs(section, key + ".")
        else:
            default = f.default
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            yield key, type_label(tp), default, f.metadata.get("doc", "")
            item = get_args(tp)[0] if get_origin(tp) is list else None
            if dataclasses.is_dataclass(item):
                yield from field_docs(item, key + "[].")


def type_label(tp: Any) -> str:
    """A type hint as a reader of the docs would write it: `int or null`, `one of: a, b`."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(map(str, get_args(tp)))
    if origin in (Union, types.UnionType):
        return " or ".join(type_label(a) for a in get_args(tp))
    if origin is list:
        return f"list of {type_label(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", dict: "mapping"}.get(
        tp, getattr(tp, "__name__", str(tp)))


# --------------------------------------------------------------------------------------------------
# Bundled recipes


def bundled_recipes_dir() -> Path:
    """The `recipes/` folder of a source checkout, else its installed copy `ligertune/bundled_recipes/`."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "recipes"
    return checkout if checkout.is_dir() else package / "bundled_recipes"


def bundled_recipes() -> dict[str, Path]:
    """Every bundled recipe by name (its path under recipes/ without `.yaml`), sorted."""
    root = bundled_recipes_dir()
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.yaml"))}


def bundled_recipe(name: str) -> Path:
    recipes = bundled_recipes()
    if name.endswith(".yaml"):
        name = name[: -len(".yaml")]
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, list(recipes), n=1, cutoff=0.5)
    hint = f"; did you mean `{close[0]}`?" if close else f"; bundled: {', '.join(recipes)}"
    from ligertune.errors import UserError

    raise UserError(f"no bundled recipe named {name!r}{hint}")


def recipe_description(path: Path) -> str:
    """The recipe's `description`, else its first comment line."""
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        raw = None
    if isinstance(raw, dict) and isinstance(raw.get("description"), str):
        return raw["description"].strip()
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def reference_markdown() -> str:
    """docs/recipe.md: every key with its type, default and documentation (kept in sync by a test)."""
    lines = [
        "# Recipe reference",
        "",
        "Generated from `ligertune/recipe.py` by `python -m ligertune.recipe > docs/recipe.md`.",
        "Override any key from the command line: `ligertune train RECIPE --set optim.lr=1e-4`",
        "(the value is parsed as YAML).",
        "",
        "Every number must be finite (no `.nan` or `.inf`) and every integer fit in 64 bits; a key",
        "given twice in one mapping is an error (YAML would silently keep the second).",
    ]
    for key, tp, default, doc in field_docs():
        if tp == "section":
            lines += ["", f"## `{key}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
            continue
        shown = "required" if default is dataclasses.MISSING else json_default(default)
        lines.append(f"| `{key}` | {tp} | {shown} | {doc} |")
    return "\n".join(lines) + "\n"


def json_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if value != [] else "`[]`"


if __name__ == "__main__":
    print(reference_markdown(), end="")
