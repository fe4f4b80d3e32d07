"""Tokenizer and model from the recipe's `model` section: pretrained, or random weights from a config."""

from __future__ import annotations

import contextlib
import difflib
import inspect
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ligertune.devices import resolve_dtype
from ligertune.errors import UserError
from ligertune.models.attention import register_packed_attention
from ligertune.models.presets import PRESETS, preset_fields
from ligertune.recipe import ModelConfig

# Config keys `transformers` still accepts under their older names (and converts).
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype"})


def attn_implementation(attention: str) -> str:
    """The `transformers` attn_implementation for the recipe's `model.attention` choice."""
    if attention == "packed":
        return register_packed_attention()
    if attention in ("sdpa", "eager"):
        return attention
    raise UserError(f"model.attention: must be packed, sdpa or eager, got {attention!r}")


# --------------------------------------------------------------------------------------------------
# tokenizer


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer of `model.tokenizer`, else of `model.name_or_path` (local directory or hub id)."""
    from transformers import AutoTokenizer

    key = "model.tokenizer" if model_cfg.tokenizer else "model.name_or_path"
    source = model_cfg.tokenizer or model_cfg.name_or_path
    if source is None:
        raise UserError(
            "model.tokenizer: a model built from `config` needs a tokenizer (a local directory or hub id)"
        )
    _check_local(source, key)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{key}: cannot load a tokenizer from {source!r}: {_first_line(err)}") from None


# --------------------------------------------------------------------------------------------------
# model


def build_model(
    model_cfg: ModelConfig,
    *,
    device: torch.device | str,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
):
    """The recipe's causal LM on `device`, in `dtype` (default `model.dtype`), with its attention.

    Pretrained (`model.name_or_path`), or built from `model.config` with weights drawn from the
    model's own initializer under `seed` (the global random state is left as it was). `vocab_size`
    (normally `len(tokenizer)`) sets the vocabulary of a model built from a config, unless the config
    declares a larger one; a pretrained model whose embedding is smaller than it is resized.
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    dtype = resolve_dtype(model_cfg.dtype if dtype is None else dtype, device)
    attn = attn_implementation(model_cfg.attention)
    remote = model_cfg.trust_remote_code
    if model_cfg.config is not None:
        config = build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=remote)
        with _seeded(seed, device), device:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=remote
            )
        return model

    source = model_cfg.name_or_path
    if source is None:
        raise UserError("model: give `name_or_path` (pretrained) or `config` (random init)")
    _check_local(source, "model.name_or_path")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn, trust_remote_code=remote
        )
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            f"model.name_or_path: cannot load a model from {source!r}: {_first_line(err)}"
        ) from None
    model.to(device)
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        with _seeded(seed, device):
            model.resize_token_embeddings(vocab_size)
    return model


def check_model(model_cfg: ModelConfig, *, vocab_size: int | None = None) -> str:
    """Resolve the recipe's model without loading weights; return a one-line description of it.

    A config (preset or mapping) is built; a pretrained model's config is read (from the local
    folder, or the hub when `name_or_path` is a hub id).
    """
    if model_cfg.config is not None:
        config = build_config(model_cfg.config, vocab_size=vocab_size, trust_remote_code=model_cfg.trust_remote_code)
        origin = "random init from config"
    else:
        from transformers import AutoConfig

        source = model_cfg.name_or_path
        _check_local(source, "model.name_or_path")
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"model.name_or_path: cannot load a config from {source!r}: {_first_line(err)}") from None
        origin = f"pretrained from {source}"
    return (f"{config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocab {config.vocab_size} ({origin})")


def build_config(
    spec: str | Mapping[str, Any], *, vocab_size: int | None = None, trust_remote_code: bool = False
):
    """A `transformers` config from a preset name or a mapping of config fields with `model_type`.

    Unknown field names are an error (with a suggestion): `transformers` would keep a misspelt
    field as an unused attribute and silently use the default.
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
    declared = fields.get("vocab_size")
    if vocab_size is not None:
        fields["vocab_size"] = max(int(declared or 0), int(vocab_size))
    elif declared is None:
        raise UserError("model.config: no `vocab_size`; give one, or a tokenizer to take it from")
    try:
        return AutoConfig.for_model(model_type, trust_remote_code=trust_remote_code, **fields)
    except (ValueError, TypeError) as err:
        raise UserError(f"model.config: {_first_line(err)}") from None


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


def _looks_like_path(source: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else with separators is meant as a local path."""
    return source.startswith(("/", "./", "../", "~", ".\\")) or source.count("/") > 1 or "\\" in source


def _check_local(source: str, key: str) -> None:
    """Fail early, without asking the hub, for a local path that does not exist."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{key}: {source} is a file; expected a directory (or a hub id)")
        return
    if _looks_like_path(source):
        raise UserError(f"{key}: {source} not found (no such directory)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
