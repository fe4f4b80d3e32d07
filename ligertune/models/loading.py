"""Tokenizer and model from the recipe's `model` section: pretrained, or random weights from a config."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ligertune import hub
from ligertune.data.chat import check_tokenizer
from ligertune.data.templates import set_chat_template
from ligertune.devices import resolve_dtype
from ligertune.errors import EnvironmentFault, UserError, first_line
from ligertune.models.attention import register_packed_attention
from ligertune.models.presets import PRESETS, preset_fields
from ligertune.models.quantize import bnb_config, quantize_linears, settle_quantized
from ligertune.recipe import ModelConfig, describe_value

# Config keys `transformers` still accepts under their older names (and converts).
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype"})
# Config keys that count something (a width, heads, layers): a positive integer or null (the default),
# at most _SIZE_MAX (kernels index with 32-bit integers) and, for layers, at most _LAYERS_MAX (each
# layer is built one after the other: a billion of them would not finish).
_SIZE_MAX = 2**31 - 1
_LAYERS_MAX = 1000
_SIZE_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
})


def attn_implementation(attention: str) -> str:
    """The `transformers` attn_implementation for the recipe's `model.attention` choice."""
    if attention == "packed":
        return register_packed_attention()
    if attention in ("sdpa", "eager"):
        return attention
    raise UserError(f"model.attention: must be packed, sdpa or eager, got {attention!r}")


# --------------------------------------------------------------------------------------------------
# tokenizer


def load_tokenizer(model_cfg: ModelConfig, *, key: str | None = None):
    """The tokenizer of `model.tokenizer`, else of `model.name_or_path` (local directory or hub id),
    with `model.chat_template` when the recipe names one; `key` names the source in errors (default:
    the one of those two keys that gave it)."""
    from transformers import AutoTokenizer

    key = key or ("model.tokenizer" if model_cfg.tokenizer else "model.name_or_path")
    source = model_cfg.tokenizer or model_cfg.name_or_path
    if source is None:
        raise UserError(
            "model.tokenizer: a model built from `config` needs a tokenizer (a local directory or hub id)"
        )
    offline = _check_source(source, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=model_cfg.trust_remote_code, local_files_only=offline is not None
        )
    except (OSError, ValueError, KeyError) as err:
        _raise_offline(source, key, offline)
        raise UserError(f"{key}: cannot load a tokenizer from {source!r}: {first_line(err)}") from None
    if model_cfg.chat_template is not None:
        set_chat_template(tokenizer, model_cfg.chat_template, f"the tokenizer of {source}")
    check_tokenizer(tokenizer, f"{key}: the tokenizer of {source}")
    return tokenizer


# --------------------------------------------------------------------------------------------------
# model


def build_model(
    model_cfg: ModelConfig,
    *,
    device: torch.device | str,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    key: str = "model.name_or_path",
):
    """The recipe's causal LM on `device`, in `dtype` (default `model.dtype`), with its attention.

    Pretrained (`model.name_or_path`), or built from `model.config` with weights drawn from the
    model's own initializer under `seed` (the global random state is left as it was). `vocab_size`
    (normally `len(tokenizer)`) sets the vocabulary of a model built from a config, unless the config
    declares a larger one; a pretrained model whose embedding is smaller than it is resized.
    With `model.quantization`, the decoder's linear layers are quantized (`ligertune.models.quantize`):
    as a pretrained model loads, or once a model built from a config has its weights. `key` names
    the recipe key of the source in errors (`objective.teacher` for a distillation teacher).
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    dtype = resolve_dtype(model_cfg.dtype if dtype is None else dtype, device)
    attn = attn_implementation(model_cfg.attention)
    remote = model_cfg.trust_remote_code
    if model_cfg.config is not None:
        config = build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=remote)
        with _seeded(seed, device), device, _model_errors(config):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=remote
            )
        if model_cfg.quantization is not None:
            quantize_linears(model, model_cfg.quantization, dtype)
        return model

    source = model_cfg.name_or_path
    if source is None:
        raise UserError("model: give `name_or_path` (pretrained) or `config` (random init)")
    offline = _check_source(source, key)
    quantized = {}
    if model_cfg.quantization is not None:
        # Quantized tensor by tensor as they load, straight onto the device.
        quantized = dict(quantization_config=bnb_config(model_cfg.quantization, dtype),
                         device_map={"": str(device)})
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn, trust_remote_code=remote,
            local_files_only=offline is not None, **quantized,
        )
    except (OSError, ValueError, KeyError) as err:
        _raise_offline(source, key, offline)
        raise UserError(
            f"{key}: cannot load a model from {source!r}: {first_line(err)}"
        ) from None
    if quantized:
        settle_quantized(model)
    else:
        model.to(device)
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        with _seeded(seed, device):
            model.resize_token_embeddings(vocab_size)
    return model


def check_model(model_cfg: ModelConfig, *, vocab_size: int | None = None) -> str:
    """Resolve the recipe's model without loading weights; return a one-line description of it.

    A config (preset or mapping) is built, and the model built from it on the meta device (shapes
    only, no memory), so that what `train` would refuse is refused here; a pretrained model's config
    is read (from the local folder, or the hub when `name_or_path` is a hub id).
    """
    if model_cfg.config is not None:
        from transformers import AutoModelForCausalLM

        remote = model_cfg.trust_remote_code
        config = build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=remote)
        with torch.device("meta"), _model_errors(config, meta=True):
            AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
        origin = "random init from config"
    else:
        from transformers import AutoConfig

        source = model_cfg.name_or_path
        offline = _check_source(source, "model.name_or_path")
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code,
                                                local_files_only=offline is not None)
        except (OSError, ValueError, KeyError) as err:
            _raise_offline(source, "model.name_or_path", offline)
            raise UserError(
                f"model.name_or_path: cannot load a config from {source!r}: {first_line(err)}"
            ) from None
        origin = f"pretrained from {source}"
    return (f"{config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocab {config.vocab_size} ({origin})")


def build_config(
    spec: str | Mapping[str, Any], *, vocab_size: int | None = None, trust_remote_code: bool = False
):
    """A `transformers` config from a preset name or a mapping of config fields with `model_type`.

    Unknown field names are an error (with a suggestion): `transformers` would keep a misspelt
    field as an unused attribute and silently use the default. So are values that would only fail
    once the model is built or trained, each named `model.config.KEY`: a size that is not a
    positive integer, heads that do not divide the hidden size (or key/value heads the heads), a
    number that is not finite, and whatever `transformers` itself refuses.
    """
    from transformers import AutoConfig

    if isinstance(spec, str):
        if spec not in PRESETS:
            close = difflib.get_close_matches(spec, list(PRESETS), n=1, cutoff=0.5)
            hint = f"; did you mean `{close[0]}`?" if close else f"; presets: {', '.join(PRESETS)}"
            raise UserError(f"model.config: unknown preset {spec!r}{hint}")
        fields = preset_fields(spec)
    else:
        fields = dict(spec)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise UserError("model.config: a config mapping needs `model_type` (e.g. llama)")
    try:
        defaults = AutoConfig.for_model(model_type, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError):
        raise UserError(f"model.config.model_type: unknown model type {model_type!r}") from None
    _check_config_fields(type(defaults), defaults, fields)
    _check_config_values(defaults, fields)
    declared = fields.get("vocab_size")
    if vocab_size is not None:
        fields["vocab_size"] = max(int(declared or 0), int(vocab_size))
    elif declared is None:
        raise UserError("model.config: no `vocab_size`; give one, or a tokenizer to take it from")
    try:
        return AutoConfig.for_model(model_type, trust_remote_code=trust_remote_code, **fields)
    except _config_refusals() as err:
        raise UserError(_config_error(err)) from None


def _check_config_fields(config_class: type, defaults: Any, fields: Mapping[str, Any]) -> None:
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {})) | _LEGACY_CONFIG_KEYS
    known |= set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    problems = []
    for key in fields:
        if key in known or hasattr(config_class, key):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        problems.append(f"model.config.{key}: unknown field for model type {defaults.model_type!r}{hint}")
    if problems:
        raise UserError("\n".join(problems))


def _check_config_values(defaults: Any, fields: Mapping[str, Any]) -> None:
    """Sizes, head counts and numbers that `transformers` accepts but the model cannot use."""
    problems = []
    for key, value in fields.items():
        problems += [f"model.config.{path}: must be a finite number, got {number}"
                     for path, number in _non_finite(value, key)]
        if value is None:
            continue
        default = 1.0 if key == "rope_theta" else getattr(defaults, key, None)  # rope_theta: a legacy key
        if key in _SIZE_KEYS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"model.config.{key}: must be a positive integer, got {describe_value(value)}")
        elif key in _SIZE_KEYS and value > (most := _LAYERS_MAX if key == "num_hidden_layers" else _SIZE_MAX):
            problems.append(f"model.config.{key}: must be at most {most}, got {value}")
        elif _is_number(default) and not _is_number(value):
            problems.append(f"model.config.{key}: must be a number, got {describe_value(value)}")
    if not problems:
        def effective(key: str) -> Any:
            return fields[key] if key in fields else getattr(defaults, key, None)

        hidden, heads = effective("hidden_size"), effective("num_attention_heads")
        kv_heads = effective("num_key_value_heads")
        # With an explicit head_dim, the heads need not tile the hidden size (Qwen3, Gemma).
        if isinstance(hidden, int) and isinstance(heads, int) and "head_dim" not in fields and hidden % heads:
            key = "num_attention_heads" if "num_attention_heads" in fields else "hidden_size"
            problems.append(f"model.config.{key}: {heads} attention heads do not divide hidden_size {hidden} "
                            "(each head gets hidden_size / num_attention_heads channels)")
        if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
            key = "num_key_value_heads" if "num_key_value_heads" in fields else "num_attention_heads"
            problems.append(f"model.config.{key}: {kv_heads} key/value heads do not divide "
                            f"num_attention_heads {heads} (each serves the same number of query heads)")
    if problems:
        raise UserError("\n".join(problems))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _non_finite(value: Any, path: str) -> Iterator[tuple[str, float]]:
    """(key path, value) of every NaN or infinite float in a config value, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _non_finite(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{path}[{i}]")


def _config_refusals() -> tuple[type[BaseException], ...]:
    """What a config class raises for a value it refuses (huggingface_hub's strict dataclass checks)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ValueError, TypeError)
    return (ValueError, TypeError, StrictDataclassError)


def _config_error(err: BaseException) -> str:
    """A refusal of `transformers` as one line naming `model.config.KEY` where it names a field."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    cause = lines[-1] if lines else type(err).__name__
    field = re.search(r"field '(\w+)'", lines[0]) if lines else None
    return f"model.config.{field.group(1)}: {cause}" if field else f"model.config: {cause}"


@contextlib.contextmanager
def _model_errors(config: Any, *, meta: bool = False) -> Iterator[None]:
    """A model class that refuses its config (a shape it cannot build) as a `model.config` error.

    On the meta device nothing is allocated, so a `RuntimeError` there (a size that overflows) is
    the config's too; on a real device it may be an exhausted memory, which is not.
    """
    refusals = (ValueError, TypeError, ZeroDivisionError, AttributeError, IndexError)
    try:
        yield
    except refusals + ((RuntimeError,) if meta else ()) as err:
        raise UserError(f"model.config: cannot build a {config.model_type} model from it: "
                        f"{first_line(err)}") from None


# --------------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block under `torch.manual_seed(seed)`; the random state outside is left as it was."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _check_source(source: str, key: str) -> str | None:
    """Check a model or tokenizer source before `from_pretrained`; None, or why the hub is offline.

    A local directory is fine, a file is not; a path that does not exist (`./tok`, `/models/x`, or
    any name that cannot be a hub id: see `ligertune.hub.meant_as_path`) is the user's mistake, told
    at once without asking the hub. A hub id returns why the hub cannot be reached, if it cannot:
    then only the local hub cache is read (no minute of retries).
    """
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{key}: {source} is a file; expected a directory (or a hub id)")
        return None
    if hub.meant_as_path(source):
        raise UserError(f"{key}: no such folder: {source}{_unfinished_run(path)}")
    return hub.offline_reason()


def _unfinished_run(path: Path) -> str:
    """For a missing `RUN/final` (the model a finished run leaves): the run to train first, named by
    its command when a bundled recipe writes RUN (`runs/quickstart/final`: the quick start)."""
    if path.name != "final":
        return ""
    from ligertune.recipe.catalogue import bundled_recipe_writing

    recipe = bundled_recipe_writing(path.parent)
    if recipe is None:
        return f" (the model a run writing to {path.parent} leaves when it finishes: train that run first)"
    try:
        shown = recipe.relative_to(Path.cwd())
    except ValueError:
        shown = recipe
    return f" (the model `ligertune train {shown}` leaves: run that first)"


def _raise_offline(source: str, key: str, offline: str | None) -> None:
    """When the hub is offline, a source missing from the local cache is the network's fault."""
    if offline is not None:
        raise EnvironmentFault(
            f"{key}: {source} not found locally and the hub cannot be reached (offline: {offline}); "
            "give a local directory, or download it while online"
        )
