"""Route a `transformers` model's RMSNorm, RoPE and gated MLP (SwiGLU, GeGLU) through ligertune's
kernels, and back.

One table, `PATCH_TABLE`, says for each model family which classes and functions of its modeling
file correspond to which kernel; `patch_model` applies any row of it and `unpatch_model` reverts it.

- RMSNorm: every norm module of the model gets an instance-level `forward` that calls
  `ligertune.kernels.rms_norm(x, weight, eps, offset)` (offset 1 for Gemma's `(1 + w)` scaling).
- SwiGLU, GeGLU: every gated MLP gets an instance-level `forward`,
  `down_proj(swiglu(gate_proj(x), up_proj(x)))` when its activation is SiLU, `geglu` in place of
  `swiglu` when it is the tanh GELU (Gemma's `gelu_pytorch_tanh`); any other activation is left
  alone. Phi-3's MLP computes gate and up with one joined projection, `gate_up_proj`: its two
  halves go to the kernel as they lie, and their gradients come back into one buffer, no copy.
  With `mlp_chunk_tokens` the MLP runs over chunks of that many tokens, each chunk recomputed in
  backward (non-reentrant checkpointing): what autograd keeps of the MLP is its input, not the
  three [tokens, intermediate_size] products (gate, up, their product), and what runs at once is
  one chunk's. At long context those products are a decoder layer's largest
  tensors (at 131,072 tokens of Llama-3.1-8B, 3.5 GiB each); the price is one more forward of the
  MLP in backward. In the families whose decoder layers only add the MLP's output to the residual
  stream (`PatchSpec.mlp_output_summed_only`), a plain down_proj is multiplied by
  `_ProductSkippedInRecompute`: F.linear's values and gradients, the product skipped when a
  gradient checkpointing recompute runs it (nothing the layer keeps for backward reads it).
- RoPE: the attention modules call their modeling file's module-level `apply_rotary_pos_emb`, so
  that function is replaced in the modeling module by a redirect to `ligertune.kernels.apply_rope`.
  With a partial rotary embedding (Phi-3's `partial_rotary_factor`: cos and sin narrower than the
  head) the kernel turns the first channels and the rest pass through, as the original does.
  This one is per family, not per model: while any patched model of a family is alive, every model
  of that family in the process uses the kernel (which computes the same values). The redirect
  keeps the original function and the set of models that asked for it; `unpatch_model` of the last
  of them puts the original back.

The instance-level forwards leave the classes untouched, so a patched model and an unpatched one
can live side by side, and `unpatch_model` simply deletes them.
"""

from __future__ import annotations

import functools
import importlib
import warnings
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ligertune import kernels
from ligertune.models.columns import split_columns
from ligertune.models.unwrap import unwrap_model


@dataclass(frozen=True)
class PatchSpec:
    """Where one model family keeps the layers that ligertune's kernels replace."""

    modeling: str
    """The `transformers` modeling module, e.g. `transformers.models.llama.modeling_llama`."""
    rms_norm: str
    """RMSNorm class name in that module."""
    norm_eps: str = "variance_epsilon"
    """Attribute of the norm module holding its epsilon."""
    norm_offset: float = 0.0
    """Added to the norm weight: 0 for `w * x_hat`, 1 for Gemma's `(1 + w) * x_hat`."""
    norm_casting: str | None = None
    """Where the norm rounds to the input dtype (`kernels.rms_norm`'s `casting`): "llama" before the
    weight multiplies, "gemma" after it (OLMo 2's too); None: by the offset."""
    mlp: str | None = None
    """Gated MLP class name (with gate_proj, up_proj, down_proj), patched when its activation is one
    of `GLU_KERNELS`."""
    activation: str = "hidden_act"
    """Config attribute naming that MLP's activation."""
    rope: str | None = "apply_rotary_pos_emb"
    """Module-level function applying the rotary embedding to q and k, as `apply_rope` does."""
    mlp_gate_up: bool = False
    """The MLP computes gate and up as the two halves of one projection, `gate_up_proj` (Phi-3)."""
    mlp_output_summed_only: bool = True
    """The decoder layer adds the MLP's output to the residual stream and does nothing else with it
    (no norm after the MLP, as Gemma 2 and 3 have): a recomputed layer's last product, down_proj's,
    is needed by nothing (`lora`: its base product is skipped in the recompute)."""


def _spec(family: str, prefix: str, **kwargs: Any) -> PatchSpec:
    return PatchSpec(
        modeling=f"transformers.models.{family}.modeling_{family}",
        rms_norm=f"{prefix}RMSNorm",
        mlp=f"{prefix}MLP",
        **kwargs,
    )


PATCH_TABLE: Mapping[str, PatchSpec] = MappingProxyType({
    "llama": _spec("llama", "Llama"),
    "mistral": _spec("mistral", "Mistral"),
    "qwen2": _spec("qwen2", "Qwen2"),
    "qwen3": _spec("qwen3", "Qwen3"),
    "gemma": _spec("gemma", "Gemma", norm_eps="eps", norm_offset=1.0),
    "gemma2": _spec("gemma2", "Gemma2", norm_eps="eps", norm_offset=1.0, activation="hidden_activation",
                    mlp_output_summed_only=False),
    "gemma3_text": _spec("gemma3", "Gemma3", norm_eps="eps", norm_offset=1.0, activation="hidden_activation",
                         mlp_output_summed_only=False),
    # The MLP's output passes a dropout (`resid_pdrop`) before the sum, whose backward reads its mask only.
    "phi3": _spec("phi3", "Phi3", mlp_gate_up=True),
    "smollm3": _spec("smollm3", "SmolLM3"),
    # Norms after the attention and the MLP (and over q and k), rounding once after the weight.
    "olmo2": _spec("olmo2", "Olmo2", norm_casting="gemma", mlp_output_summed_only=False),
    "olmo3": _spec("olmo3", "Olmo3", norm_casting="gemma", mlp_output_summed_only=False),
})
"""`config.model_type` -> `PatchSpec`, the one table of supported families."""

GLU_KERNELS: Mapping[str, str] = MappingProxyType(
    {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu"}
)
"""A gated MLP's activation (its `transformers` name) -> the `ligertune.kernels` function of its unit."""


@dataclass
class PatchReport:
    """What `patch_model` changed."""

    model_type: str
    supported: bool
    rms_norm: int = 0
    """Norm modules now running `kernels.rms_norm`."""
    rope: str | None = None
    """The redirected function, e.g. "llama apply_rotary_pos_emb"."""
    mlps: int = 0
    """Gated MLP modules now running `kernels.swiglu` or `kernels.geglu`."""
    glu: str | None = None
    """Which of the two: "swiglu" or "geglu"."""
    notes: list[str] = field(default_factory=list)
    """Kernels that were asked for but not applied, with the reason."""

    def describe(self) -> str:
        """One line, e.g. `rms_norm: 9 modules, rope: llama apply_rotary_pos_emb, swiglu: 2 MLPs`."""
        if not self.supported:
            return f"none (no kernel patches for model type {self.model_type!r})"
        parts = []
        if self.rms_norm:
            parts.append(f"rms_norm: {self.rms_norm} modules")
        if self.rope:
            parts.append(f"rope: {self.rope}")
        if self.mlps:
            parts.append(f"{self.glu}: {self.mlps} MLPs")
        text = ", ".join(parts) or "none"
        return f"{text} ({'; '.join(self.notes)})" if self.notes else text


# --------------------------------------------------------------------------------------------------
# apply / revert


def patch_model(
    model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
    mlp_chunk_tokens: int | None = None,
) -> PatchReport:
    """Route the model's RMSNorm, RoPE and gated MLPs through ligertune's kernels; see the module
    docstring (`swiglu`: the gated MLPs, SwiGLU or GeGLU; `mlp_chunk_tokens`: those MLPs over chunks
    of that many tokens, each recomputed in backward).

    `model` may be a peft wrapper: its base model is patched (adapters stay in place). A model type
    missing from `PATCH_TABLE` gets a warning and runs unpatched. Patching twice is harmless.
    """
    base = unwrap_model(model)
    model_type = getattr(base.config, "model_type", type(base).__name__)
    spec = PATCH_TABLE.get(model_type)
    if spec is None:
        warnings.warn(
            f"ligertune has no kernel patches for model type {model_type!r} (supported: "
            f"{', '.join(PATCH_TABLE)}); the model runs with its own layers",
            stacklevel=2,
        )
        return PatchReport(model_type, supported=False)
    modeling = importlib.import_module(spec.modeling)
    report = PatchReport(model_type, supported=True)

    if rms_norm:
        norm_class = getattr(modeling, spec.rms_norm)
        for module in base.modules():
            if isinstance(module, norm_class):
                _set_forward(module, _rms_norm_forward, eps_attr=spec.norm_eps, offset=spec.norm_offset,
                             casting=spec.norm_casting)
                report.rms_norm += 1

    if swiglu and spec.mlp is not None:
        activation = getattr(base.config, spec.activation, None)
        glu = GLU_KERNELS.get(activation)
        if glu is not None:
            mlp_class = getattr(modeling, spec.mlp)
            for module in base.modules():
                if isinstance(module, mlp_class):
                    _set_forward(module, _glu_forward, glu=glu, gate_up=spec.mlp_gate_up,
                                 chunk_tokens=mlp_chunk_tokens,
                                 last_unneeded_in_recompute=spec.mlp_output_summed_only)
                    report.mlps += 1
            report.glu = glu
            if mlp_chunk_tokens is not None and report.mlps:
                report.notes.append(f"MLPs in chunks of {mlp_chunk_tokens} tokens")
        else:
            report.notes.append(f"gated MLP: not applied, its activation is {activation}, "
                                f"not one of {', '.join(GLU_KERNELS)}")

    if rope and spec.rope is not None:
        redirect = getattr(modeling, spec.rope)
        if not isinstance(redirect, _RopeRedirect):
            redirect = _RopeRedirect(redirect)
            setattr(modeling, spec.rope, redirect)
        redirect.models.add(base)
        report.rope = f"{model_type} {spec.rope}"
    return report


def unpatch_model(model: nn.Module) -> None:
    """Undo `patch_model`: the original forwards, and the original RoPE function once no patched
    model of the family is left."""
    base = unwrap_model(model)
    for module in base.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func in _PATCHED_FORWARDS:
            del module.forward
    spec = PATCH_TABLE.get(getattr(base.config, "model_type", None))
    if spec is not None and spec.rope is not None:
        modeling = importlib.import_module(spec.modeling)
        redirect = getattr(modeling, spec.rope)
        if isinstance(redirect, _RopeRedirect):
            redirect.models.discard(base)
            if not redirect.models:
                setattr(modeling, spec.rope, redirect.original)


def is_patched(model: nn.Module) -> bool:
    """Whether any module of the model runs one of ligertune's instance-level forwards."""
    return any(
        isinstance(f := m.__dict__.get("forward"), functools.partial) and f.func in _PATCHED_FORWARDS
        for m in unwrap_model(model).modules()
    )


def _set_forward(module: nn.Module, fn: Callable, **options: Any) -> None:
    # An instance attribute shadows the class's forward for this module only; `nn.Module.__call__`
    # looks `forward` up on the instance, so hooks, FSDP and checkpointing still see the module.
    module.forward = functools.partial(fn, module, **options)


# --------------------------------------------------------------------------------------------------
# the replacement forwards


def _rms_norm_forward(module: nn.Module, x: torch.Tensor, *, eps_attr: str, offset: float,
                      casting: str | None = None) -> torch.Tensor:
    return kernels.rms_norm(x, module.weight, getattr(module, eps_attr), offset, casting)


def _glu_forward(module: nn.Module, x: torch.Tensor, *, glu: str, gate_up: bool = False,
                 chunk_tokens: int | None = None, last_unneeded_in_recompute: bool = False) -> torch.Tensor:
    mlp = functools.partial(_glu_mlp, glu=glu, gate_up=gate_up,
                            last_unneeded_in_recompute=last_unneeded_in_recompute)
    tokens = x.shape[:-1].numel()
    if chunk_tokens is None or tokens <= chunk_tokens:
        return mlp(module, x)
    if torch.is_grad_enabled():
        chunks = _KeptForRecompute.apply(x.reshape(tokens, x.shape[-1])).split(chunk_tokens)
        outputs = [checkpoint(mlp, module, chunk, use_reentrant=False) for chunk in chunks]
    else:
        outputs = [mlp(module, chunk) for chunk in x.reshape(tokens, x.shape[-1]).split(chunk_tokens)]
    return torch.cat(outputs).reshape(*x.shape[:-1], -1)


class _KeptForRecompute(torch.autograd.Function):
    """The identity, saving its input: the chunks' recomputation keeps the MLP's input until backward
    (held by the checkpoints, where autograd's saved-tensor hooks do not see it), and saving it here
    says so to what counts those hooks (the memory planner's `SavedBytes`). No memory of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _glu_mlp(module: nn.Module, x: torch.Tensor, *, glu: str, gate_up: bool = False,
             last_unneeded_in_recompute: bool = False) -> torch.Tensor:
    if gate_up:
        joined = module.gate_up_proj(x)
        gate, up = split_columns(joined, [joined.shape[-1] // 2] * 2)
    else:
        gate, up = module.gate_proj(x), module.up_proj(x)
    # gate and up exist for this product alone: their memory can take their gradients.
    h = getattr(kernels, glu)(gate, up, reuse_inputs=True)
    down = module.down_proj
    if last_unneeded_in_recompute and torch.is_grad_enabled() and not torch.is_autocast_enabled(h.device.type):
        if type(down) is nn.Linear:
            return _ProductSkippedInRecompute.apply(h, down.weight, down.bias)
        if getattr(down, "skips_unneeded_products", False):  # a float8 layer that trains
            return down(h, unneeded_in_recompute=True)
    return down(h)


def recomputing() -> bool:
    """Whether this forward runs inside backward: gradient checkpointing's recompute of a layer,
    for the tensors the layer keeps for its backward, which comes next."""
    return torch._C._current_graph_task_id() != -1


class _ProductSkippedInRecompute(torch.autograd.Function):
    """F.linear(h, W, b) for the last product of a decoder layer whose output nothing the layer
    keeps for backward reads (`PatchSpec.mlp_output_summed_only`): F.linear's values, and its
    gradients by the GEMMs autograd runs for it, keeping what it keeps (h where W trains, W where h
    does); a recompute gets an uninitialized output instead of the product."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.shape = h.shape
        if recomputing():
            return h.new_empty(*h.shape[:-1], weight.shape[0])
        return F.linear(h, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h, weight = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        dh = (dy @ weight).view(ctx.shape) if weight is not None else None
        dw = dy.t() @ h.reshape(-1, h.shape[-1]) if h is not None else None
        db = dy.sum(0) if ctx.needs_input_grad[2] else None
        return dh, dw, db


_PATCHED_FORWARDS = (_rms_norm_forward, _glu_forward)


class _RopeRedirect:
    """Stands in for a modeling file's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`.

    Calls `kernels.apply_rope` in the layout it supports (q, k [B, H, L, D], cos/sin [B or 1, L, D],
    the layout of every family in `PATCH_TABLE`; cos/sin [B or 1, L, R] with R < D turn the first R
    channels, a partial rotary embedding) and the original function for anything else.
    """

    def __init__(self, original: Callable):
        self.original = original
        self.models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        functools.update_wrapper(self, original)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        rotary = cos.shape[-1]
        if (
            args or set(kwargs) - {"unsqueeze_dim"} or unsqueeze_dim != 1
            or q.dim() != 4 or cos.dim() != 3 or rotary > q.shape[-1] or rotary % 2
        ):
            return self.original(q, k, cos, sin, *args, **kwargs)
        if rotary == q.shape[-1]:
            return kernels.apply_rope(q, k, cos, sin)
        # A partial rotary embedding: the first `rotary` channels turn, the others pass through.
        q_turned, k_turned = kernels.apply_rope(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat([q_turned, q[..., rotary:]], dim=-1), torch.cat([k_turned, k[..., rotary:]], dim=-1)

    def __repr__(self) -> str:
        return f"<ligertune RoPE redirect for {self.original!r}>"

