"""The one place where recipe sections become objects: device, data and packs, model, loss head,
optimizer and schedule.

`ligertune train`, `ligertune verify-loss` and `ligertune bench step` all build through here, so
what is verified and benchmarked is what trains:

    device = build_device(recipe.train)
    tokenizer = load_tokenizer(recipe.model)
    data = build_data(recipe, tokenizer)                         # examples, then packs
    model = build_model(recipe, device=device, vocab_size=len(tokenizer))
    head = build_head(model.module, recipe.kernels, recipe.loss)
    optimizer = build_optimizer(head, recipe.optim)              # the model's and any heads' weights
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps=...)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ligertune import models
from ligertune.data import Pack, PreparedData, TokenizedExample, pack, packs_digest, prepare_data
from ligertune.data.preference import PreferenceStats, PreparedPreferences, load_preferences, pack_preferences
from ligertune.data.stats import counted
from ligertune.data.prepare import hold_out, take, target_counts
from ligertune.devices import resolve_device, resolve_dtype
from ligertune.distributed import Topology
from ligertune.errors import UserError
from ligertune.kernels import LossOptions
from ligertune.models import CausalLMLoss, PatchReport, patch_model
from ligertune.models.head import final_logit_softcap
from ligertune.models.lora import cast_adapters, patch_lora
from ligertune.recipe import (
    DataConfig,
    DataSource,
    KernelsConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    Recipe,
    TrainConfig,
    check_objective_data,
)
from ligertune.training import precision
from ligertune.training.adamw import AdamW
from ligertune.training.lion import Lion
from ligertune.training.memory import (
    CheckpointPlanner,
    default_budget_gib,
    device_allocator,
    fixed_offload,
    set_checkpointed,
)
from ligertune.training.optim import lr_multiplier, warmup_length
from ligertune.training.run import Run


def build_device(cfg: TrainConfig) -> torch.device:
    """The device of `train.device`, with torch's CPU threads set from `train.num_threads`."""
    device = resolve_device(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    return device


# --------------------------------------------------------------------------------------------------
# data


@dataclass
class TrainingData:
    """The tokenized conversations of a run and their packs, and what a run says of them before its
    first step (`data_warnings`)."""

    prepared: PreparedData
    eval_examples: list[TokenizedExample]
    train_packs: list[Pack]
    eval_packs: list[Pack]
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def train_examples(self) -> list[TokenizedExample]:
        return self.prepared.train

    @functools.cached_property
    def train_digest(self) -> str:
        """`packs_digest` of the training packs: a checkpoint's data position holds for these packs only."""
        return packs_digest(self.train_packs)


def build_packs(cfg: DataConfig, examples: list[TokenizedExample]) -> list[Pack]:
    """The examples packed as `data.max_seq_len` and `data.packing` say."""
    return pack(examples, cfg.max_seq_len, packing=cfg.packing)


def build_data(recipe: Recipe, tokenizer, *, show_progress: bool = True) -> TrainingData:
    """Read, tokenize, mask and pack the recipe's training and held-out conversations, once
    `data.max_seq_len` is known to fit the model (`check_max_seq_len`); `warnings` of the result
    says what was left out on the way."""
    from ligertune.objectives import build_objective

    build_objective(recipe)  # an objective the trainer cannot run yet is refused before any data is read
    check_max_seq_len(recipe, vocab_size=len(tokenizer))
    if recipe.objective.preference:
        return build_preference_data(recipe, tokenizer)
    prepared = prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, show_progress=show_progress)
    if not prepared.train:
        raise UserError("data: no trainable conversation left after masking and truncation")
    cap = recipe.train.eval_max_conversations
    eval_examples = prepared.eval[:cap] if cap else prepared.eval
    return TrainingData(
        prepared=prepared,
        eval_examples=eval_examples,
        train_packs=build_packs(recipe.data, prepared.train),
        eval_packs=build_packs(recipe.data, eval_examples),
        warnings=data_warnings(recipe, prepared),
    )


def build_preference_data(recipe: Recipe, tokenizer) -> TrainingData:
    """Read, tokenize and pack the recipe's preference data (`ligertune.data.preference`): units
    (prompt + chosen + rejected; KTO: prompt + completion + another example's completion, drawn from
    `train.seed` within each file) packed whole into `data.max_seq_len`. `data.path`, or each of
    `data.sources` with its `weight` or `samples` (units repeated or subsampled to their share, as
    conversations are); the held-out units from `data.eval_path`, or `data.eval_fraction` of each
    source's units (drawn as supervised fine-tuning draws its held-out conversations). Each source's
    format is checked against the objective as soon as it is read. `TrainingData` keeps its shape:
    `prepared.train`/`.eval` are the units, its `stats` the training sources' `PreferenceStats`
    added, the packs `PreferencePack`s."""
    cfg, seed = recipe.data, recipe.train.seed
    if cfg.path is None and not cfg.sources:
        raise UserError("data.path: give the preference data to train on")
    sources = cfg.sources or [DataSource(path=cfg.path, format=cfg.format, split=cfg.split)]
    # What a refusal names: the file, and with several sources which one it is.
    keys = [f"data.sources[{i}] ({s.path})" for i, s in enumerate(sources)] if cfg.sources else [cfg.path]

    def load(source: DataSource, index: int, key: str) -> PreparedPreferences:
        fmt = cfg.format if source.format == "auto" else source.format
        return load_preferences(source.path, tokenizer, max_seq_len=cfg.max_seq_len, fmt=fmt,
                                split=source.split, on_bad_record=cfg.on_bad_record, source=index,
                                system_prompt=cfg.system_prompt, kto=recipe.objective.name == "kto", seed=seed,
                                check_format=lambda fmt: check_objective_data(recipe.objective, fmt, where=key))

    loaded = [load(source, i, key) for i, (source, key) in enumerate(zip(sources, keys))]
    parts, eval_units = [], []
    for i, data in enumerate(loaded):
        if cfg.eval_path is not None:
            parts.append(data.units)
            continue
        rng = random.Random(f"ligertune-data:{seed}:eval:{i}")
        train_i, eval_i = hold_out(data.units, cfg.eval_fraction, rng, record=lambda unit: unit.origin)
        parts.append(train_i)
        eval_units += eval_i
    read = [(source.path, data.stats) for source, data in zip(sources, loaded)]
    if cfg.eval_path is not None:
        held = load(DataSource(path=cfg.eval_path, format=cfg.format, split=cfg.split), len(sources), cfg.eval_path)
        eval_units = held.units
        read.append((cfg.eval_path, held.stats))
    counts = target_counts(sources, [len(part) for part in parts])
    units = [u for i, (part, count) in enumerate(zip(parts, counts))
             for u in take(part, count, random.Random(f"ligertune-data:{seed}:take:{i}"))]
    cap = recipe.train.eval_max_conversations
    eval_units = eval_units[:cap] if cap else eval_units
    prepared = PreparedData(units, eval_units, PreferenceStats.added([data.stats for data in loaded]))
    return TrainingData(
        prepared=prepared,
        eval_examples=eval_units,
        train_packs=pack_preferences(units, cfg.max_seq_len, packing=cfg.packing),
        eval_packs=pack_preferences(eval_units, cfg.max_seq_len, packing=cfg.packing) if eval_units else [],
        warnings=preference_warnings(recipe, read, held_out=bool(eval_units)),
    )


def preference_warnings(recipe: Recipe, read: list[tuple[str, PreferenceStats]], *, held_out: bool) -> list[str]:
    """`key: message` for the preference records a run left out (as `data_warnings` for conversations):
    malformed records skipped, units longer than `data.max_seq_len` or with an answer of no scored
    token dropped, for each (path, stats) of `read`; and evaluation asked for with no held-out unit."""
    cfg = recipe.data
    found = []
    for where, st in read:
        if st.bad_records:
            first = f"; the first: {st.bad_record_examples[0]}" if st.bad_record_examples else ""
            skipped = counted(st.bad_records, 'malformed record')
            found.append(f"data.on_bad_record: skipped {skipped} of {where}{first}")
        too_long = st.dropped.get("too_long", 0)
        if too_long:
            found.append(f"data.max_seq_len: dropped {counted(too_long, 'preference record')} of {where} "
                         f"longer than {cfg.max_seq_len} tokens (prompt and answers together)")
        unscored = sum(n for reason, n in st.dropped.items() if reason != "too_long")
        if unscored:
            found.append(f"data: dropped {counted(unscored, 'preference record')} of {where} with an answer "
                         "of no scored token")
    if not held_out and cfg.eval_fraction > 0:
        found.append(f"data.eval_fraction: {cfg.eval_fraction:g} held out no preference record (at least 2 "
                     "are needed to give one): no evaluation will run")
    elif not held_out and recipe.train.eval_every is not None:
        found.append("train.eval_every: there is no held-out data (data.eval_path or data.eval_fraction): "
                     "no evaluation will run")
    return found


def data_warnings(recipe: Recipe, prepared: PreparedData) -> list[str]:
    """`key: message` for what the data lost that a run should say before its first step (`ligertune
    data` shows the same counts): malformed records skipped (`data.on_bad_record: skip`), conversations
    dropped or shortened to fit `data.max_seq_len`, conversations with no trained token, and
    evaluation asked for (`data.eval_fraction`, `train.eval_every`) with no held-out conversation."""
    cfg, stats = recipe.data, prepared.stats
    found = []
    if stats.bad_records:
        first = f"; the first: {stats.bad_record_examples[0]}" if stats.bad_record_examples else ""
        found.append(f"data.on_bad_record: skipped {counted(stats.bad_records, 'malformed record')}{first}")
    too_long = stats.dropped.get("too_long", 0)
    if too_long:
        why = "data.truncation: drop" if cfg.truncation == "drop" else "not even their first answer fits"
        found.append(f"data.max_seq_len: dropped {counted(too_long, 'conversation')} longer than "
                     f"{cfg.max_seq_len} tokens ({why})")
    truncated = sum(stats.truncated.values())
    if truncated:
        found.append(f"data.truncation: shortened {counted(truncated, 'conversation')} longer than "
                     f"data.max_seq_len ({cfg.max_seq_len} tokens) by "
                     f"{counted(stats.turns_removed, 'trailing turn')}")
    untrained = stats.dropped.get("no_trained_tokens", 0)
    if untrained:
        found.append(f"data.train_on: dropped {counted(untrained, 'conversation')} with no trained token "
                     f"(train_on: {cfg.train_on})")
    if not prepared.eval and cfg.eval_fraction > 0:
        found.append(f"data.eval_fraction: {cfg.eval_fraction:g} held out no conversation (a source needs at "
                     "least 2 to give one): no evaluation will run")
    elif not prepared.eval and recipe.train.eval_every is not None:
        found.append("train.eval_every: there is no held-out data (data.eval_path or data.eval_fraction): "
                     "no evaluation will run")
    return found


def check_max_seq_len(recipe: Recipe, *, vocab_size: int | None) -> None:
    """Refuse a `data.max_seq_len` beyond the model's positions, the `max_position_embeddings` of its
    own config: a conversation that long would run past the position embeddings (or the rotary
    range) the model has. Found before any data is read; a config that cannot be read without the
    model (a hub id not in the local cache) is not checked here."""
    limit = position_limit(recipe.model, vocab_size=vocab_size)
    if limit is not None and recipe.data.max_seq_len > limit:
        raise UserError(f"data.max_seq_len: {recipe.data.max_seq_len} is more than the model's {limit} "
                        f"positions (max_position_embeddings in its config); give at most {limit}")


def position_limit(model_cfg: ModelConfig, *, vocab_size: int | None) -> int | None:
    """`max_position_embeddings` of the model's config: built from `model.config`, or read from the
    local folder or hub cache of `model.name_or_path`; None where there is none to read."""
    from transformers import AutoConfig

    remote = model_cfg.trust_remote_code
    if model_cfg.config is not None:
        config = models.build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=remote)
    else:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=remote,
                                                local_files_only=True)
        except (OSError, ValueError, KeyError):
            return None  # the model's loader says why, with the hub's state
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def total_steps(cfg: TrainConfig, n_packs: int, world_size: int = 1) -> int:
    """`train.max_steps`, else the steps that `train.epochs` passes over `n_packs` packs take."""
    if cfg.max_steps:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * n_packs / packs_per_step(cfg, world_size)))


def packs_per_step(cfg: TrainConfig, world_size: int = 1) -> int:
    """Packs of one optimizer step over all processes: `micro_batch_size x grad_accum_steps` each."""
    return cfg.micro_batch_size * cfg.grad_accum_steps * world_size


# --------------------------------------------------------------------------------------------------
# model


@dataclass
class BuiltModel:
    """The model to train (peft-wrapped with LoRA) and what was patched in it."""

    module: nn.Module
    dtype: torch.dtype
    patches: PatchReport | None


def build_model(
    recipe: Recipe,
    *,
    device: torch.device,
    vocab_size: int | None,
    attention: str | None = None,
    dtype: torch.dtype | None = None,
    trainable_dtype: torch.dtype | None = None,
    kernels: bool = True,
    before_adapters: Callable[[nn.Module], None] | None = None,
) -> BuiltModel:
    """The recipe's model on `device`: loaded or built, patched with the recipe's kernels, with its
    gradient checkpointing, then wrapped with LoRA adapters when the recipe has `lora`.

    `attention` replaces `model.attention` (a benchmark's peers run the model's own sdpa); `dtype`
    replaces `model.dtype` (float32 master weights under mixed precision); `trainable_dtype` is
    given to the trainable parameters once the adapters are in (`cast_trainable`: float32 adapters
    over a 16-bit frozen base under FSDP, `fsdp_dtypes`); `kernels=False` leaves the model unpatched
    (`patch_kernels` can patch it later); `before_adapters(model)` runs on the base model before LoRA
    wraps it (a peer's own patches).

    A quantized base (`model.quantization`, QLoRA) gets what training adapters over it needs: its
    weights frozen and peft's bitsandbytes LoRA layers around the quantized ones (`wrap_lora`), and
    non-reentrant checkpointing, under which the frozen embeddings need no input-gradient hook. peft's
    `prepare_model_for_kbit_training` is not called: it casts every bf16 weight left unquantized
    (embeddings, norms, output projection) to float32, 2.1 GB more for Llama-3.1-8B, and with them
    the residual stream (twice the activation memory, and a dtype flash attention does not take),
    to keep fp16 norms and logits accurate, which ligertune's kernels compute in float32 anyway.
    """
    model_cfg = recipe.model if attention is None else dataclasses.replace(recipe.model, attention=attention)
    if model_cfg.quantization is not None:
        check_quantized(recipe)
    float8 = recipe.train.precision == "fp8"
    if float8:
        check_float8(device, torchao=recipe.trains_model_weights and not recipe.kernels.float8_linear)
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    model = models.build_model(model_cfg, device=device, dtype=dtype, seed=recipe.train.seed,
                               vocab_size=vocab_size)
    if model_cfg.quantization is not None:
        check_modules_to_save(model, recipe)
    patches = patch_kernels(model, recipe.kernels) if kernels else None
    if float8 and recipe.trains_model_weights:
        from ligertune.models.float8 import convert_to_float8, train_in_float8

        if recipe.kernels.float8_linear:
            train_in_float8(model, weight_grad=recipe.kernels.float8_weight_grad)
        else:
            convert_to_float8(model, recipe.train.torchao_scaling, compiled=True)
    if recipe.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if before_adapters is not None:
        before_adapters(model)
    if recipe.lora is not None:
        model = wrap_lora(model, recipe.lora, fast=kernels and recipe.kernels.lora)
    if trainable_dtype is not None:
        cast_trainable(model, trainable_dtype)
    if not recipe.objective.trains_backbone:
        model.requires_grad_(False)  # Medusa heads over a frozen model: the heads alone train
    if float8 and not recipe.trains_model_weights:
        from ligertune.models.float8 import freeze_to_float8

        freeze_to_float8(model)  # the frozen base: float8 weights once, no weight gradient
    return BuiltModel(model, dtype, patches)


def build_medusa_heads(recipe: Recipe, model: nn.Module, *, dtype: torch.dtype | None = None):
    """The Medusa heads of `objective.name: medusa` (None for other objectives), on the model's device:
    `objective.heads` heads of `objective.head_layers` residual blocks, each output layer a copy of
    the model's (its base layer's, under LoRA), in `dtype` (None: the output layer's; the trainable
    dtype of a sharded LoRA run, `fsdp_dtypes`)."""
    from ligertune.models.medusa import MedusaHeads
    from ligertune.models.unwrap import plain_projection

    cfg = recipe.objective
    if cfg.name != "medusa":
        return None
    layer = models.output_head_of(model)
    projection = plain_projection(layer)
    weight = projection[0] if projection is not None else getattr(layer, "base_layer", layer).weight
    heads = MedusaHeads.from_output_layer(weight.detach(), heads=cfg.heads, layers=cfg.head_layers, dtype=dtype)
    return heads.requires_grad_(True)


def cast_trainable(model: nn.Module, dtype: torch.dtype) -> None:
    """Every trainable parameter of `model` in `dtype`, the frozen ones as they are. In place (the
    same Parameter objects), so that ties, peft's references and the fast LoRA forward still hold."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)


@dataclass(frozen=True)
class FsdpDtypes:
    """The dtypes of a run sharded by FSDP2 (`fsdp_dtypes`); None where nothing changes."""

    compute: torch.dtype | None = None
    """MixedPrecisionPolicy's `param_dtype`: the dtype every weight is gathered in for the forward
    and backward (`distributed.shard`'s `mixed_precision`); None: no policy."""
    model: torch.dtype | None = None
    """The dtype the model is built in (`build_model`'s `dtype`); None: `model.dtype`."""
    trainable: torch.dtype | None = None
    """The trainable parameters' dtype (`build_model`'s `trainable_dtype`); None: as built."""


def fsdp_dtypes(recipe: Recipe, device_type: str, *, sharded: bool) -> FsdpDtypes:
    """How a run whose model FSDP2 shards (`sharded`: several processes, `distributed.strategy`
    fsdp) on CUDA with a 16-bit `model.dtype` holds its weights: FSDP's MixedPrecisionPolicy
    gathers every weight in that dtype (`compute`) for the forward and backward and reduce-scatters
    the gradients in float32 into the sharded parameters, which the optimizer steps.

    - Full fine-tuning: the model is built in float32, so the sharded parameters are the float32
      master weights (the optimizer keeps no copy of its own, `training.precision`).
    - LoRA: only the trainable parameters need a master. The frozen base is built in the 16-bit
      dtype: 2 bytes a parameter on each rank's shard instead of 4 (Llama-3.1-8B over 2 GPUs: 8 GB
      a GPU, not 16), and its all-gathers need no cast. The adapters, `lora.modules_to_save` and any
      trainable bias are cast to float32 (`trainable`), because FSDP2 requires the trainable
      parameters of one `fully_shard` group to share one dtype ("FSDP expects uniform original
      parameter dtype", torch 2.11 and 2.13), while frozen ones may differ; one process's dtypes
      could mix in a group (peft's float32 adapters beside a 16-bit copy of `lm_head` from
      `lora.modules_to_save`). Float32 is one dtype for all, the master weights the optimizer would
      otherwise keep for 16-bit adapters, and the policy gathers them in `compute` like the base:
      the forward computes 16-bit adapters over a 16-bit base, as one process does with
      `kernels.lora`, and their gradients reach the float32 shards reduced in float32.

    Otherwise (one process, DDP, a float32 `model.dtype`, the CPU, whose sharded runs keep the
    weights of `model.dtype` as they are) nothing changes: no policy, and `build_model`'s dtypes.
    """
    compute = resolve_dtype(recipe.model.dtype, device_type)
    if not sharded or device_type != "cuda" or compute == torch.float32:
        return FsdpDtypes()
    if recipe.lora is None:
        return FsdpDtypes(compute=compute, model=torch.float32)
    return FsdpDtypes(compute=compute, model=compute, trainable=torch.float32)


def check_quantized(recipe: Recipe) -> None:
    """Refuse a quantized base that cannot train: without LoRA adapters (also a recipe check), over
    several processes (FSDP cannot shard bitsandbytes' packed weights), or without bitsandbytes."""
    from ligertune.distributed import topology_from_environment
    from ligertune.models.quantize import require_bitsandbytes

    kind = recipe.model.quantization
    if recipe.lora is None:
        raise UserError(f"model.quantization: a quantized base ({kind}) is frozen: train LoRA adapters "
                        "over it (add a `lora` section)")
    if topology_from_environment().distributed:
        raise UserError(f"model.quantization: a quantized base ({kind}) trains on one process; run "
                        "without --nproc/torchrun, or without quantization")
    require_bitsandbytes(kind)


def check_float8(device: torch.device, *, torchao: bool = True) -> None:
    """Refuse `train.precision: fp8` where it cannot run: without float8 tensor cores, over several
    processes (not yet tried with FSDP's sharded weights), or without torchao where weights train
    in float8 (`torchao`; a frozen base needs only torch's float8 GEMM)."""
    from ligertune.distributed import topology_from_environment
    from ligertune.models.float8 import check_float8_device, require_torchao

    check_float8_device(device)
    if topology_from_environment().distributed:
        raise UserError("train.precision: fp8 trains on one process for now; run without --nproc/torchrun, "
                        "or with precision: auto")
    if torchao:
        require_torchao()


def describe_float8(recipe: Recipe, model: nn.Module) -> str:
    """How `train.precision: fp8` multiplies `model`'s layers, for the run's header and bench's:
    how many are float8 and which layer does it."""
    from ligertune.models.float8 import float8_layers

    if not recipe.trains_model_weights:
        how = "frozen: cast once, a scale per output channel and per token"
    elif recipe.kernels.float8_linear:
        grads = ("in float8 (e5m2 and e4m3, a scale a tensor)" if recipe.kernels.float8_weight_grad
                 else "in bf16")
        how = f"ligertune's layers: a scale per output channel and per token, the weights' gradients {grads}"
    else:
        how = f"torchao's layers, {recipe.train.torchao_scaling} scales"
    return f"{float8_layers(model)} linear layers multiply in float8 ({how})"


def check_modules_to_save(model: nn.Module, recipe: Recipe) -> None:
    """Refuse `lora.modules_to_save` naming a layer that `model.quantization` quantizes: peft would
    train a copy of it in full, and a quantized weight has no gradient (LoRA adapts it instead)."""
    from ligertune.models.quantize import quantized_layer_names

    targets = (recipe.lora.modules_to_save or []) if recipe.lora is not None else []
    for name in quantized_layer_names(model):
        for target in targets:
            if name.endswith(target):  # peft's own matching of modules_to_save
                raise UserError(
                    f"lora.modules_to_save: {target!r} names {name}, a layer quantized by model.quantization "
                    f"({recipe.model.quantization}), which cannot train in full; adapt it through "
                    "lora.target_modules instead"
                )


def patch_kernels(model: nn.Module, cfg: KernelsConfig) -> PatchReport:
    """RMSNorm, RoPE and the gated MLPs through ligertune's kernels, as `kernels` says."""
    return patch_model(model, rms_norm=cfg.rms_norm, rope=cfg.rope, swiglu=cfg.swiglu,
                       mlp_chunk_tokens=cfg.mlp_chunk_tokens)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpointing)."""
    with warnings.catch_warnings():  # renamed in newer transformers; the old name still works
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def wrap_lora(model: nn.Module, cfg: LoraConfig, *, fast: bool = False) -> nn.Module:
    """The model with peft LoRA adapters on `lora.target_modules`; the base weights frozen.

    `fast` (`kernels.lora`) gives the LoRA Linear layers `ligertune.models.lora`'s forward: peft's
    modules and parameters, with one A product per shared input, no float32 copy of the activations
    kept, and the adapters in the model's dtype where that forward computes them
    (`adapters_in_model_dtype`).
    """
    import peft

    lora = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=lora_targets(cfg),
        bias=cfg.bias,
        modules_to_save=cfg.modules_to_save,
        use_rslora=cfg.use_rslora,
        task_type="CAUSAL_LM",
    )
    check_lora_names(model, cfg)
    keep = adapters_in_model_dtype(cfg, fast=fast)
    try:
        # autocast_adapter_dtype=False: peft leaves each adapter in its base layer's dtype instead of
        # upcasting bfloat16/float16 ones to float32.
        wrapped = peft.get_peft_model(model, lora, autocast_adapter_dtype=not keep)
    except ValueError as err:
        raise UserError(f"lora: {err}") from None
    if keep:
        cast_adapters(wrapped, model.get_input_embeddings().weight.dtype)
    if fast:
        patch_lora(wrapped)
    return wrapped


def lora_targets(cfg: LoraConfig) -> str | list[str]:
    """`lora.target_modules` as peft takes it: a plain name written alone (`q_proj`) as a list of one,
    since peft matches a string as a pattern against whole module names (`model.layers.0...`)."""
    targets = cfg.target_modules
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
        return [targets]
    return targets


def check_lora_names(model: nn.Module, cfg: LoraConfig) -> None:
    """Refuse a name of `lora.target_modules` or `lora.modules_to_save` that matches no module of the
    model, naming its linear layers: peft adapts or saves the names that match and drops the others
    without a word, so a typo (`v_prj`) would train fewer layers than asked. Matched as peft does:
    a target is a module's name or its last dotted parts, a module to save the end of its name; a
    pattern must match a whole name."""
    names = [name for name, _ in model.named_modules()]
    targets = lora_targets(cfg)
    if isinstance(targets, str):
        try:
            missing = [] if targets == "all-linear" or any(re.fullmatch(targets, n) for n in names) else [targets]
        except re.error as err:
            raise UserError(f"lora.target_modules: {targets!r} is not a valid pattern: {err}") from None
    else:
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    for key, unmatched in (("target_modules", missing),
                           ("modules_to_save", [t for t in cfg.modules_to_save or []
                                                if not any(n.endswith(t) for n in names)])):
        if unmatched:
            linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                             if isinstance(module, nn.Linear)})
            verb = "matches" if len(unmatched) == 1 else "match"
            raise UserError(f"lora.{key}: {', '.join(unmatched)} {verb} no module of the model; its linear "
                            f"layers: {', '.join(linear)}")


def adapters_in_model_dtype(cfg: LoraConfig, *, fast: bool) -> bool:
    """Whether the LoRA adapters stay in the model's dtype (bfloat16 over a bf16 model) rather than
    peft's float32: where the fast forward (`kernels.lora`) computes them, that is with `fast` and no
    dropout (over a plain or a bitsandbytes-quantized base alike).

    There y = base(x) + s (x A^T) B^T is one GEMM in the model's dtype whose epilogue adds base(x),
    about one read and one write of the output per layer where float32 adapters cost ~28 bytes per
    output element (docs/kernels.md), and it rounds once where peft's path over bf16 adapters rounds
    the product, the scaling and the sum. The optimizer steps 16-bit adapters through float32
    master weights (`optim.master_weights`, `ligertune.training.precision`), so the update is as
    exact as for float32 adapters. With dropout peft's own forward runs, which with 16-bit adapters
    would round three times: it keeps float32.
    """
    return fast and cfg.dropout == 0


def build_head(model: nn.Module, kernels: KernelsConfig, loss: LossConfig) -> CausalLMLoss:
    """The loss head of `model`: fused linear cross-entropy (or the unfused path) with the loss options
    built here, once: the recipe's label smoothing, z-loss and ignore index, the model's logit
    softcap, the kernel's chunk budget, and the "sum" reduction (the step's normalization is in the
    token weights; docs/loss.md)."""
    options = LossOptions(
        ignore_index=loss.ignore_index,
        label_smoothing=loss.label_smoothing,
        z_loss_weight=loss.z_loss_weight,
        softcap=final_logit_softcap(model),
        reduction="sum",
        chunk_bytes=kernels.loss_chunk_mib * 2**20,
    )
    return CausalLMLoss(model, fused=kernels.fused_linear_cross_entropy, options=options)


# --------------------------------------------------------------------------------------------------
# optimizer


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """`optim.name` over the trainable parameters; norms, biases and other vectors get no weight decay.

    AdamW is torch's (`ligertune.training.adamw`), fused on CUDA when every parameter is a plain
    tensor there (sharded parameters take the multi-tensor one); Lion is ligertune's Triton kernel
    (`ligertune.training.lion`). Both step 16-bit parameters through float32 master weights unless
    `optim.master_weights` is false (`ligertune.training.precision`).
    """
    params = trainable_parameters(model)
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "lion":
        return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas), master_weights=cfg.master_weights)
    fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for _, p in params)
    return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None,
                 master_weights=cfg.master_weights)


def trainable_dtypes(recipe: Recipe) -> set[torch.dtype]:
    """The dtypes that the trainable parameters of the recipe's model will have on one process, known
    before it is built: the model's for full fine-tuning (`auto`: bfloat16 where `train.device` is
    CUDA); with LoRA, the adapters' (`adapters_in_model_dtype`: the model's with `kernels.lora`,
    else peft's float32) and the model's dtype for `lora.modules_to_save`."""
    cuda = recipe.train.device == "cuda" or (recipe.train.device == "auto" and torch.cuda.is_available())
    dtype = resolve_dtype(recipe.model.dtype, "cuda" if cuda else "cpu")
    if recipe.lora is None:
        return {dtype}
    same = adapters_in_model_dtype(recipe.lora, fast=recipe.kernels.lora)
    return {dtype if same else torch.float32} | ({dtype} if recipe.lora.modules_to_save else set())


def optimizer_warnings(recipe: Recipe, dtypes: set[torch.dtype]) -> list[str]:
    """`key: message` for an optimizer setting that runs but probably not as meant, for trainable
    parameters of `dtypes` (`ligertune.training.precision.optimizer_warnings`); where those are LoRA
    adapters kept in the model's dtype, the warning of 16-bit steps says so."""
    found = precision.optimizer_warnings(recipe.optim, dtypes, lora=recipe.lora is not None)
    if recipe.lora is not None and adapters_in_model_dtype(recipe.lora, fast=recipe.kernels.lora):
        note = ("; these include the LoRA adapters, which kernels.lora keeps in the model's dtype "
                "(kernels.lora: false gives peft's float32 ones)")
        found = [(key, message + (note if key == "optim.master_weights" else "")) for key, message in found]
    return [f"{key}: {message}" for key, message in found]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, total_steps: int):
    """Linear warmup (`optim.warmup_steps` or `optim.warmup_ratio`, at most the run), then the recipe's
    decay, as a factor of `optim.lr` per optimizer step (`ligertune.training.optim`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))


def schedule_warnings(cfg: OptimConfig, total_steps: int) -> list[str]:
    """`key: message` for a schedule that runs other than the recipe reads: a warmup longer than the
    run (a smoke run with `--max-steps`), cut to the run's length (`training.optim.warmup_length`)."""
    warmup = warmup_length(cfg, total_steps)
    if cfg.warmup_ratio > 0 or warmup == cfg.warmup_steps:
        return []
    return [f"optim.warmup_steps: {cfg.warmup_steps} warmup steps is longer than the run ({total_steps} "
            f"step{'s' * (total_steps != 1)}): the warmup is cut to {warmup}, so the learning rate rises over "
            "the whole run and never decays (optim.warmup_ratio scales the warmup with the run)"]


# --------------------------------------------------------------------------------------------------
# the run's step


def build_run(recipe: Recipe, model: nn.Module, *, device: torch.device, total_steps: int,
              topology: Topology | None = None, mixed_precision: torch.dtype | None = None,
              reference_model: nn.Module | None = None, teacher_model: nn.Module | None = None,
              medusa_heads: nn.Module | None = None, **parts) -> Run:
    """What one training step needs, around `model` (from `build_model`): the objective, the loss
    head (sharded over the processes of `topology`), the optimizer, the schedule over `total_steps`
    and the gradient checkpointing of `train.gradient_checkpointing`. `parts` are the `Run`'s other
    fields (its data and outputs); `bench step` times the step of a run built with none. With
    `objective.reference: live`, the objective scores the reference with the adapters off (`lora`)
    or through `reference_model`, the frozen starting model (full fine-tuning, `build_reference_model`).
    Distillation scores against `teacher_model` (`build_teacher_model`), sharded like the student.
    Medusa trains `medusa_heads` (`build_medusa_heads`, built here when not given) as a submodule of
    the loss head, so that they are sharded, checkpointed and stepped with it; the optimizer holds
    the head's trainable parameters (over a frozen model: the heads')."""
    from ligertune.distributed import shard
    from ligertune.objectives import build_objective

    topology = topology or Topology()
    head = build_head(model, recipe.kernels, recipe.loss)
    if recipe.objective.name == "medusa":
        heads = medusa_heads if medusa_heads is not None else build_medusa_heads(recipe, model)
        head.attach_medusa(heads, frozen_backbone=not recipe.objective.trains_backbone)
    engine = head
    if topology.distributed:
        engine = shard(head, models.decoder_of(model).layers, strategy=strategy(recipe), device=device,
                       mixed_precision=mixed_precision,
                       reshard_after_forward=recipe.distributed.reshard_after_forward)
    optimizer = build_optimizer(head, recipe.optim)
    objective = build_objective(recipe)
    if recipe.objective.reference_mode == "live":
        objective.reference = live_reference(recipe, model, engine, reference_model, topology=topology,
                                             device=device, mixed_precision=mixed_precision)
    if recipe.objective.name == "distill":
        if teacher_model is None:
            raise ValueError("objective.name: distill needs its teacher: give teacher_model (build_teacher_model)")
        attach_teacher(objective, model, teacher_model, topology=topology, device=device, sharding=strategy(recipe))
    run = Run(recipe=recipe, device=device, model=model, head=head, objective=objective,
              optimizer=optimizer, scheduler=build_scheduler(optimizer, recipe.optim, total_steps=total_steps),
              total_steps=total_steps, topology=topology, engine=engine, **parts)
    # A frozen model keeps no activations to recompute (its forward runs without gradient).
    run.checkpointing = (checkpointing_policy(recipe.train, model, device, optimizer)
                         if recipe.objective.trains_backbone else None)
    layers = models.decoder_of(model).layers
    run.offload = (run.checkpointing.offloader if isinstance(run.checkpointing, CheckpointPlanner)
                   else fixed_offload(recipe.train, layers, device))
    return run


def build_reference_model(recipe: Recipe, *, device: torch.device, vocab_size: int,
                          dtype: torch.dtype | None) -> nn.Module | None:
    """The frozen starting model that `objective.reference: live` scores with in full fine-tuning
    (built as the policy is, with the same kernels; its parameters need no gradient); None where no
    copy is needed (no live reference, or LoRA: the policy with its adapters off)."""
    if recipe.objective.reference_mode != "live" or recipe.lora is not None:
        return None
    built = build_model(recipe, device=device, vocab_size=vocab_size, dtype=dtype)
    built.module.requires_grad_(False)
    return built.module.eval()


def build_teacher_model(recipe: Recipe, tokenizer, *, device: torch.device, dtype: torch.dtype,
                        kernels: bool = True) -> nn.Module | None:
    """The frozen teacher of `objective.name: distill` (None for other objectives): `objective.teacher`
    loaded as the student's model is, in `dtype` (the student's compute dtype: it is never trained)
    or in 4 bits (`objective.teacher_quantization`), with the recipe's kernels (unless `kernels` is
    False), every parameter frozen. Refused in one line when its tokenizer's vocabulary is not the
    student's `tokenizer`'s."""
    cfg = recipe.objective
    if cfg.name != "distill":
        return None
    teacher_cfg = dataclasses.replace(recipe.model, name_or_path=cfg.teacher, config=None, tokenizer=None,
                                      quantization=cfg.teacher_quantization)
    check_teacher_vocabulary(tokenizer, models.load_tokenizer(teacher_cfg, key="objective.teacher"), cfg.teacher)
    if cfg.teacher_quantization is not None:
        from ligertune.distributed import topology_from_environment
        from ligertune.models.quantize import require_bitsandbytes

        if topology_from_environment().distributed:
            raise UserError(f"objective.teacher_quantization: a quantized teacher ({cfg.teacher_quantization}) "
                            "runs on one process (FSDP cannot shard its packed weights); run without "
                            "--nproc/torchrun, or without teacher_quantization")
        require_bitsandbytes(cfg.teacher_quantization)
    teacher = models.build_model(teacher_cfg, device=device, dtype=dtype, seed=recipe.train.seed,
                                 key="objective.teacher")
    if output_rows(teacher) < len(tokenizer):
        raise UserError(f"objective.teacher: {cfg.teacher} has {output_rows(teacher):,} output rows for a "
                        f"tokenizer of {len(tokenizer):,} tokens: it cannot score every token")
    if kernels:
        patch_kernels(teacher, recipe.kernels)
    teacher.requires_grad_(False)
    return teacher.eval()


def output_rows(model: nn.Module) -> int:
    """The number of logits the model's output layer gives (its vocabulary, padding rows included)."""
    return models.output_head_of(model).out_features


def check_teacher_vocabulary(tokenizer, teacher_tokenizer, teacher: str) -> None:
    """Refuse a teacher whose tokens are not the student's: the two distributions must be over the
    same tokens, id for id."""
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sum(1 for token, i in ours.items() if theirs.get(token) != i) + len(theirs.keys() - ours.keys())
        raise UserError(f"objective.teacher: {teacher} has another tokenizer vocabulary ({len(theirs):,} tokens, "
                        f"{differ:,} not the student's id for id; the student's has {len(ours):,}): "
                        "distillation needs the same tokens in both models")


def attach_teacher(objective, model: nn.Module, teacher_model: nn.Module, *, topology: Topology,
                   device: torch.device, sharding: str) -> None:
    """Give distillation its `Teacher`: the teacher as a module of its last hidden states, sharded
    like the student under FSDP2 (replicated under DDP: it has no gradient to reduce), the output
    rows both models share, and both models' logit caps in the loss options."""
    from ligertune.distributed import shard
    from ligertune.models.head import TeacherStates
    from ligertune.objectives import Teacher

    student_rows, teacher_rows = output_rows(model), output_rows(teacher_model)
    module = TeacherStates(teacher_model)
    if topology.distributed and sharding == "fsdp":
        module = shard(module, models.decoder_of(teacher_model).layers, strategy="fsdp", device=device,
                       mixed_precision=None)
    objective.teacher = Teacher(module, vocab=min(student_rows, teacher_rows))
    objective.options = dataclasses.replace(objective.options, softcap=final_logit_softcap(model),
                                            teacher_softcap=final_logit_softcap(teacher_model))


def live_reference(recipe: Recipe, model: nn.Module, engine: nn.Module, reference_model: nn.Module | None, *,
                   topology: Topology, device: torch.device, mixed_precision: torch.dtype | None):
    """The scorer of `objective.reference: live` (`ligertune.objectives.reference.LiveReference`)."""
    from ligertune.distributed import shard
    from ligertune.objectives.reference import LiveReference

    if recipe.lora is not None:
        return LiveReference(engine, model.disable_adapter)
    if reference_model is None:
        raise ValueError("objective.reference: live without LoRA scores through a frozen copy: give reference_model")
    head = build_head(reference_model, recipe.kernels, recipe.loss)
    if topology.distributed:
        head = shard(head, models.decoder_of(reference_model).layers, strategy="fsdp", device=device,
                     mixed_precision=mixed_precision)
    return LiveReference(head)


def checkpointing_policy(cfg: TrainConfig, model: nn.Module, device: torch.device,
                         optimizer: torch.optim.Optimizer) -> CheckpointPlanner | int | None:
    """What `train.gradient_checkpointing` makes of the model's decoder layers (`training.memory`):
    None (off), the number of layers recomputed, or the planner of `auto`."""
    layers = models.decoder_of(model).layers
    if cfg.gradient_checkpointing is False:
        return None
    if cfg.gradient_checkpointing is True:
        return len(layers)
    allocator = device_allocator(device)
    if allocator is None:
        set_checkpointed(layers, 0)  # no device memory to budget
        return 0
    budget = cfg.memory_budget_gib if cfg.memory_budget_gib is not None else default_budget_gib(device)
    return CheckpointPlanner(model, layers, allocator, budget, offload=cfg.activation_offload, optimizer=optimizer)


def strategy(recipe: Recipe) -> str:
    """How several processes share the model: `distributed.strategy`, `auto` being FSDP."""
    return "ddp" if recipe.distributed.strategy == "ddp" else "fsdp"


# --------------------------------------------------------------------------------------------------
# checking without building


def check_model_skeleton(recipe: Recipe, *, vocab_size: int | None) -> None:
    """What `build_model` would refuse, found without loading a weight: a local model folder with no
    weight files, a quantized base it cannot train (`check_quantized`, `check_modules_to_save`), and
    LoRA target modules the model lacks (the model's shapes are built on the meta device, no memory,
    and wrapped)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_cfg = recipe.model
    if model_cfg.quantization is not None:
        check_quantized(recipe)
    source = model_cfg.name_or_path
    if source is not None and Path(source).is_dir():
        patterns = ("*.safetensors", "*.bin", "*.pt", "*.pth")
        if not any(next(Path(source).glob(p), None) for p in patterns):
            raise UserError(f"model.name_or_path: {source} holds no model weights (*.safetensors, *.bin)")
    if recipe.lora is None:
        return
    remote = model_cfg.trust_remote_code
    if model_cfg.config is not None:
        config = models.build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=remote)
    else:
        config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    if model_cfg.quantization is not None:
        check_modules_to_save(skeleton, recipe)
    wrap_lora(skeleton, recipe.lora)
