"""Medusa heads: K extra next-token heads on a causal LM's last hidden state (Cai et al. 2024, Medusa).

Head k (k = 0 .. K-1) reads the decoder's last hidden state h_t at position t and predicts the token
k + 2 places ahead, x_{t+k+2} (the model's own head predicts x_{t+1}):

    head_k(h) = W_k (h + sum of `layers` residual blocks),  block(h) = h + SiLU(A h + b)

as in the paper's implementation: each block's A starts at zero, so that a new head starts as the
model's own output layer (W_k starts as a copy of it), predicting x_{t+1} for x_{t+k+2}.

The heads are saved beside the model as `medusa_heads.safetensors` with their shape in
`medusa_config.json` (`save_heads`, `load_heads`); `ligertune chat --draft medusa` proposes from them.
A run that trained them over a frozen model saves the heads alone, with `base_model.json` naming that
model (`save_base_note`, `read_base_note`): the model itself is the recipe's, unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from ligertune.errors import UserError, first_line
from ligertune.weights import check_safetensors

HEADS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_config.json"
BASE_NOTE = "base_model.json"
"""Beside heads trained over a frozen model: the model they read (`base_model_name_or_path`)."""


@dataclass(frozen=True)
class MedusaConfig:
    """The shape of a set of heads: how many, how deep, over which hidden size and vocabulary."""

    heads: int
    layers: int
    hidden_size: int
    vocab_size: int


class ResidualBlock(nn.Module):
    """h + SiLU(A h + b), A zero at the start (the block is the identity until it learns)."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype, device=device)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class MedusaHead(nn.Module):
    """One head: `layers` residual blocks, then an output layer [V, H] (`proj`)."""

    def __init__(self, hidden_size: int, vocab_size: int, layers: int, *, dtype=None, device=None):
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualBlock(hidden_size, dtype=dtype, device=device) for _ in range(layers)))
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device)

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """What the output layer reads: the hidden state after the residual blocks."""
        return self.blocks(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.features(h))


class MedusaHeads(nn.Module):
    """K heads over one hidden state; `heads[k]` predicts k + 2 tokens ahead."""

    def __init__(self, config: MedusaConfig, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.vocab_size, config.layers, dtype=dtype, device=device)
            for _ in range(config.heads)
        )

    @classmethod
    def from_output_layer(cls, output_weight: torch.Tensor, *, heads: int, layers: int,
                          dtype: torch.dtype | None = None) -> MedusaHeads:
        """Heads whose output layers start as copies of the model's (`output_weight` [V, H])."""
        vocab, hidden = output_weight.shape
        module = cls(MedusaConfig(heads, layers, hidden, vocab), dtype=dtype or output_weight.dtype,
                     device=output_weight.device)
        with torch.no_grad():
            for head in module.heads:
                head.proj.weight.copy_(output_weight)
        return module

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The heads' logits of `h` [..., H]: [..., K, V], head k's at index k (decoding: a few rows;
        training never forms them, `ligertune.models.head.CausalLMLoss` takes each head's features
        and output weight to the fused loss)."""
        return torch.stack([head(h) for head in self.heads], dim=-2)

    def extra_repr(self) -> str:
        c = self.config
        return f"heads={c.heads}, layers={c.layers}, hidden_size={c.hidden_size}, vocab_size={c.vocab_size}"


def save_heads(heads: MedusaHeads, folder: Path, *, state: dict[str, torch.Tensor] | None = None) -> None:
    """The heads' weights and shape into `folder` (beside a model or its adapters); `state` replaces
    their own state dict (the heads' weights gathered from a sharded run)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = heads.state_dict() if state is None else state
    save_file({name: t.detach().contiguous().cpu() for name, t in state.items()}, str(folder / HEADS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(asdict(heads.config), indent=2) + "\n", encoding="utf-8")


def has_heads(folder: Path) -> bool:
    return (Path(folder) / HEADS_FILE).is_file() and (Path(folder) / CONFIG_FILE).is_file()


def read_config(folder: Path) -> MedusaConfig:
    """The heads' shape from `folder`'s medusa_config.json; a user error naming the file when it is
    not one."""
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read the Medusa heads' config: {first_line(err)}") from None
    names = [f.name for f in fields(MedusaConfig)]
    if not isinstance(raw, dict) or sorted(raw) != sorted(names):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{path}: not a Medusa heads' config: expected the keys {', '.join(names)}, got {got}")
    bad = [name for name in names if not (type(raw[name]) is int and raw[name] > (0 if name != "layers" else -1))]
    if bad:
        raise UserError(f"{path}: {bad[0]} must be a whole number > {0 if bad[0] != 'layers' else -1}, "
                        f"got {raw[bad[0]]!r}")
    return MedusaConfig(**raw)


def load_heads(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> MedusaHeads:
    """The heads `save_heads` wrote into `folder` (read as data: safetensors, checked whole first),
    on `device` in `dtype` (None: as saved). A damaged file, a config that is not one, or weights of
    another shape than the config's are a user error naming the file."""
    from safetensors.torch import load_file

    config = read_config(folder)
    path = Path(folder) / HEADS_FILE
    check_safetensors(path)
    state = load_file(str(path), device=str(device))
    dtype = dtype or (next(iter(state.values())).dtype if state else torch.float32)
    heads = MedusaHeads(config, dtype=dtype, device=device)
    try:
        heads.load_state_dict({name: t.to(dtype) for name, t in state.items()})
    except RuntimeError as err:
        raise UserError(f"{path}: the weights do not fit {CONFIG_FILE} ({config.heads} heads of "
                        f"{config.layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}): "
                        f"{first_line(err)}") from None
    return heads


def save_base_note(folder: Path, base: str | None) -> None:
    """`base_model.json` in `folder`: the model the heads were trained over, unchanged (a local folder
    or a hub id; null for a model built from `model.config`: the run's recipe rebuilds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    note = {"base_model_name_or_path": base, "backbone": "frozen"}
    (folder / BASE_NOTE).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")


def read_base_note(folder: Path) -> str | None:
    """The base model that `base_model.json` in `folder` names (None: built from the run's recipe)."""
    path = Path(folder) / BASE_NOTE
    try:
        note = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read: {first_line(err)}") from None
    base = note.get("base_model_name_or_path") if isinstance(note, dict) else None
    return base if isinstance(base, str) else None
