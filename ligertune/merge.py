"""Merging a run's LoRA adapters into its base model: one standalone Hugging Face model folder.

    report = merge_adapters(Path("runs/lora"))            # writes runs/lora/merged
    AutoModelForCausalLM.from_pretrained(report.output_dir)

The base and the adapters are loaded in float32 and merged there (W + s * B @ A, peft's
`merge_and_unload`); the merged weights are then cast to the output dtype and written with the
tokenizer and its chat template, atomically (a temporary sibling renamed into place). A base that
trained quantized (QLoRA) is merged through its dequantized weights, W = dequant(Q(W0)): those the
adapters were trained over (the original W0 is not what the adapters correct). Before the
rename the written folder is loaded back with `from_pretrained` and its logits on a short chat are
compared with those of base + adapters: a merge that does not reproduce them is never left behind.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ligertune.devices import DTYPES, release_memory, resolve_device, resolve_dtype
from ligertune.errors import UserError
from ligertune.files import write_atomic_dir
from ligertune.models.medusa import CONFIG_FILE, HEADS_FILE
from ligertune.inference import (
    MODEL_CONFIG,
    ModelSource,
    base_model_config,
    check_source,
    load_base_with_adapters,
    load_full_model,
    load_tokenizer_for,
    locate_model,
    run_recipe,
    stop_token_ids,
)
from ligertune.numerics import relative_error
from ligertune.recipe import ModelConfig
from ligertune.training.run_dir import CHECKPOINTS

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Largest relative error ||merged - reference|| / ||reference|| of the check logits, per output
dtype: the error of rounding the merged weights to that dtype, with room."""

CHECK_CONVERSATION = [
    {"role": "user", "content": "Hello! What can you help me with today?"},
    {"role": "assistant", "content": "I can answer questions, explain ideas and draft text."},
]
CHECK_TOKENS = 64


class MergeCheckError(RuntimeError):
    """The merged model, loaded back, does not give the logits of base + adapters."""


@dataclass
class MergeReport:
    """What `merge_adapters` wrote and how closely the written model reproduces base + adapters."""

    output_dir: Path
    source: ModelSource
    dtype: torch.dtype
    tokens_checked: int
    rel_error: float
    """||logits(merged) - logits(base + adapters)|| / ||logits(base + adapters)||."""
    tolerance: float
    adapters_effect: float
    """||logits(base + adapters) - logits(base)|| / ||logits(base + adapters)||: what the check can see."""
    replaced: bool
    """An earlier merged model was at `output_dir` and was replaced."""
    dequantized: str | None = None
    """The quantization (`nf4`, `int8`) of a QLoRA base, whose dequantized weights were merged."""

    @property
    def dtype_name(self) -> str:
        return _name(self.dtype)

    def to_dict(self) -> dict:
        return {
            "output_dir": str(self.output_dir), "source": str(self.source.model_dir),
            "dtype": self.dtype_name, "tokens_checked": self.tokens_checked,
            "rel_error": self.rel_error, "tolerance": self.tolerance,
            "adapters_effect": self.adapters_effect, "replaced": self.replaced,
            "dequantized": self.dequantized,
        }


def default_output_dir(source: ModelSource) -> Path:
    """RUN/merged for a run's final adapters, RUN/merged-step-N for a checkpoint's, and
    FOLDER-merged beside a folder of adapters that belongs to no run."""
    if source.run_dir is None:
        return source.model_dir.with_name(f"{source.model_dir.name}-merged")
    resolved = source.model_dir.resolve()  # checkpoints/latest is a link to checkpoints/step-N
    if resolved.parent.name == CHECKPOINTS:
        return source.run_dir / f"merged-{resolved.name}"
    return source.run_dir / "merged"


def merge_adapters(
    path: Path,
    *,
    output: Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
) -> MergeReport:
    """Merge the LoRA adapters of a run or checkpoint into their base; write a standalone model.

    `dtype` is the dtype of the written weights: `auto` keeps the base model's own (the recipe's
    `model.dtype` when set, else a pretrained base's checkpoint dtype, else float32). Raises
    `UserError` for a path without adapters and `MergeCheckError` when the check fails (nothing is
    written then). Code shipped with the base model runs only with `trust_remote_code`. Medusa heads
    trained with the adapters (`objective.backbone: lora`) are copied beside the merged model: they
    read its last hidden states, which merging leaves as they were.
    """
    source = locate_model(path, trust_remote_code=trust_remote_code)
    if source.frozen_base:
        raise UserError(f"{path}: no LoRA adapters to merge: {source.model_dir} holds Medusa heads trained over "
                        "an unchanged base model, which `chat` loads with them as they are")
    if not source.adapters:
        raise UserError(
            f"{path}: no LoRA adapters to merge: {source.model_dir} holds a whole model "
            "(a full fine-tune), which already loads with from_pretrained"
        )
    torch_device = resolve_device(device, key="--device")
    requested = None if dtype == "auto" else resolve_dtype(dtype, torch_device, key="--dtype")
    recipe = run_recipe(source)
    check_source(source, recipe)
    base_cfg = base_model_config(source, recipe)[0]
    out_dtype = _output_dtype(requested, base_cfg)
    target = Path(output).expanduser() if output is not None else default_output_dir(source)
    replaced = _check_output(target, source)
    tokenizer = load_tokenizer_for(source, recipe)

    # Merged in float32 whatever the output dtype: the product B @ A is added at full precision and
    # rounded once, when the weights are cast.
    model = load_base_with_adapters(source, device=torch_device, dtype=torch.float32, tokenizer=tokenizer,
                                    recipe=recipe, dequantize=True)
    input_ids = check_input_ids(tokenizer).to(torch_device)
    with torch.no_grad():
        reference = model(input_ids=input_ids).logits.float()
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids).logits.float()
    adapters_effect = relative_error(reference, base_logits)  # how far the adapters move the base's logits
    del base_logits

    merged = model.merge_and_unload(safe_merge=True)
    del model
    merged.to(out_dtype)
    stops = stop_token_ids(merged, tokenizer)
    if stops:  # a model built from a config ends its turns where the tokenizer does, not at id 2
        merged.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    if tokenizer.pad_token_id is not None:
        merged.generation_config.pad_token_id = tokenizer.pad_token_id
    tolerance = TOLERANCE[out_dtype]
    rel_error = float("nan")

    def write(tmp: Path) -> None:
        nonlocal merged, rel_error
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name in (HEADS_FILE, CONFIG_FILE):  # Medusa heads trained with the adapters read the merged model as well
            if (source.model_dir / name).is_file():
                shutil.copyfile(source.model_dir / name, tmp / name)
        merged = None
        release_memory(torch_device)
        # What a user will load, read back from disk; upcast so that the check sees only the
        # rounding of the written weights.
        reloaded = load_full_model(tmp, device=torch_device, dtype=torch.float32,
                                   trust_remote_code=source.trust_remote_code)
        with torch.no_grad():
            logits = reloaded(input_ids=input_ids).logits.float()
        rel_error = relative_error(logits, reference)
        if not rel_error <= tolerance:  # NaN fails too
            raise MergeCheckError(
                f"the merged model does not reproduce base + adapters: logits differ by "
                f"{rel_error:.2e} relative (tolerance {tolerance:.0e} for {_name(out_dtype)}); "
                "nothing was written"
            )

    write_atomic_dir(target, write)
    return MergeReport(
        output_dir=target, source=source, dtype=out_dtype, tokens_checked=int(input_ids.numel()),
        rel_error=rel_error, tolerance=tolerance, adapters_effect=adapters_effect, replaced=replaced,
        dequantized=base_cfg.quantization,
    )


def check_input_ids(tokenizer, max_tokens: int = CHECK_TOKENS) -> torch.Tensor:
    """A short chat rendered by the tokenizer's template (plain text without one), as a [1, T] batch."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(CHECK_CONVERSATION, tokenize=False)
    else:
        text = " ".join(m["content"] for m in CHECK_CONVERSATION)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    return torch.tensor([ids])


def _check_output(target: Path, source: ModelSource) -> bool:
    """Refuse an output folder that would replace the adapters or anything but a model; return
    whether an earlier model there will be replaced."""
    resolved, model_dir = target.resolve(), source.model_dir.resolve()
    if resolved == model_dir or model_dir.is_relative_to(resolved):
        raise UserError(f"--output: {target} would replace the adapters being merged; choose another folder")
    if not target.exists():
        return False
    if not target.is_dir():
        raise UserError(f"--output: {target} is a file; expected a folder")
    if (target / MODEL_CONFIG).is_file():
        return True
    if any(target.iterdir()):
        raise UserError(f"--output: {target} exists and holds no model; choose another folder or remove it")
    return False


def _output_dtype(requested: torch.dtype | None, base: ModelConfig) -> torch.dtype:
    """`--dtype` when given, else the base's `model.dtype` when set, else a pretrained base's
    checkpoint dtype, else float32 (a base built from `model.config`)."""
    if requested is not None:
        return requested
    if base.dtype != "auto":
        return DTYPES[base.dtype]
    return _saved_dtype(base) or torch.float32


def _saved_dtype(base: ModelConfig) -> torch.dtype | None:
    """The dtype a pretrained model's config names: the base is loaded in float32 for the merge,
    so this is read from its config, not from the loaded model."""
    from transformers import AutoConfig

    if not base.name_or_path:
        return None
    try:
        config = AutoConfig.from_pretrained(base.name_or_path, trust_remote_code=base.trust_remote_code)
        dtype = getattr(config, "dtype", None)
    except (OSError, ValueError, KeyError):
        return None
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    return dtype if dtype in TOLERANCE else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
