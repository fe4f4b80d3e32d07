"""Fast LoRA: peft's LoRA layers computing peft's values without paying for its generality.

peft's `lora.Linear.forward` computes, for each adapted layer on its own,

    y   = base(x)                                    the frozen layer, in the model dtype
    x_a = x.to(A.dtype)                              a float32 copy of x under a bf16 model
    y   = (y + B(A(dropout(x_a))) * s).to(y.dtype)   s = alpha / r, or alpha / sqrt(r) (rsLoRA)

and autograd keeps x_a for the gradient of A. Under a bf16 model peft's adapters are float32
(`get_peft_model` upcasts them, `autocast_adapter_dtype=True`), so every adapted layer keeps a float32
copy of its input: twice the bytes of the bf16 input, and five of them for the q, k, v, gate and up
projections, which read only two distinct tensors.

`patch_lora(model)` gives each of peft's LoRA Linear layers an instance-level forward that computes
the same y (to rounding, and rounding less where it differs):

- Layers that read one input (`SHARED_INPUTS`: q, k, v of an attention block; gate, up of an MLP)
  share one product. The first of them to run computes U = x_a cat(A_q, A_k, A_v)^T, one GEMM with
  r_q + r_k + r_v columns in the adapters' dtype, and takes its own columns; the others find theirs
  waiting for that very tensor x (checked by identity and version counter, so any other input is
  computed afresh).
- The autograd function of that product (`shared_lora_a`) saves x itself, not x_a: one bf16 tensor
  for the whole group, which the model usually keeps anyway. Backward casts it again (a no-op for
  adapters in x's dtype) and computes grad cat(A) = dU^T x_a and dx = dU cat(A), one GEMM each for
  the group.
- Where the adapters have the output's dtype (bf16 adapters over a bf16 model, which is what
  `ligertune train` builds with `kernels.lora`: `training.build.adapters_in_model_dtype`; float32
  over float32), B, the scaling and the sum are one GEMM,

      y = base(x).addmm_(U_i, B^T, alpha=s)     y = base(x) + s U_i B^T, in place on base(x)

  whose epilogue reads base(x) and writes y over it: one read and one write of the output, 4 bytes
  per element in bf16, where peft over float32 adapters writes a float32 product, scales it in
  place, adds base(x) into it and casts the sum back (~28 bytes per element). The sum is formed in
  the GEMM's float32 accumulator and rounded once; peft's path over bf16 adapters rounds B's
  product, its scaling and the sum. Autograd keeps U_i and B only and hands dy on to the base layer
  untouched (beta = 1); dU_i and dB are the GEMMs peft runs, with s applied to their small results.
  In place, because an out-of-place `torch.addmm` copies base(x) into a new output before a beta = 1
  GEMM (CUDA's addmm_out does, but for a 1-D bias); on base(x) itself, computed from x viewed as 2-D,
  because an in-place op on a view makes autograd copy the whole gradient (CopySlices). A LoRA bias
  b on B (peft's `lora_bias`) is added after, s b in a second pass.
- Adapters of another dtype (float32 over a bf16 model: peft's default, or a model patched by hand)
  take peft's operations in peft's order, the scaling and the sum done in place on the B product
  (autograd keeps the product's inputs, not the product), so y rounds as peft's does.

Over a quantized base (QLoRA) base(x) is the bitsandbytes layer's own product and the rest is as
above; where peft's rounding is kept (float32 adapters), it is that of peft's bitsandbytes layers,
which cast the adapter product to the output's dtype before the sum.

Where the adapters sum in place, a group's outputs are computed at once, at its first member's
call, and its gradient of x, the base layers' and the adapters', is summed in GEMMs' epilogues
where autograd would write each layer's and add them (7 additions of the input's size a decoder
layer; a layer alone is a group of one). Over plain frozen `nn.Linear` bases: each base product as
before, U, and the sums in place, from one autograd node (`_plain_outputs`, `_PlainProducts`); over
4-bit bases (`Nf4Siblings`) the same, the group's weights dequantized into one buffer in forward and
again in backward, or taken from the layer's recompute under checkpointing (`_dequantized_outputs`,
`_DequantizedProducts`). Over joined float8 layers
(`Float8Siblings`): one base GEMM over the joined weight and one adapter GEMM over the block-diagonal
B (`_joined_outputs`, `_JoinedProducts`), the output split by columns, its gradients taken back as
one.

With dropout 0 peft's `Identity` is not called. What is left to autograd: per layer, the columns of
U (tokens x r, for grad B) and the adapter weights; per group, x. The parameters and modules are
peft's own, untouched, so `save_pretrained`, `PeftModel.from_pretrained`, `merge_and_unload` and
`ligertune merge` see no difference (adapters saved in bf16 load as peft's float32 ones, exactly).

A layer keeps peft's forward where the shortcut would not compute peft's values: dropout > 0 (each
layer draws its own mask, so there is nothing to share), a LoRA variant (DoRA), several active
adapters; and, checked at every call, adapters disabled or merged, another adapter made active,
autocast, extra arguments (peft's `adapter_names`). Groups are formed only for the families of
`PATCH_TABLE`, whose modeling code is known to call q, k, v (gate, up) on one tensor; elsewhere each
layer is a group of one, which still keeps no float32 copy of its input.

Under gradient checkpointing a recomputed layer runs for the tensors it keeps for backward; where
the family's decoder layer only adds the MLP's output to the residual stream
(`PatchSpec.mlp_output_summed_only`), nothing keeps down_proj's output, and its recompute skips the
base product (`_SharedInput.base_unneeded_in_recompute`).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ligertune.models.columns import split_columns
from ligertune.models.patching import PATCH_TABLE, recomputing
from ligertune.models.unwrap import unwrap_model

SHARED_INPUTS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling layers that every family of `PATCH_TABLE` calls on one and the same tensor."""
COPIED = ("v_proj",)
"""Layers whose part of a joined output the fast LoRA forward copies out: attention keeps v for its
backward, and a column slice would keep q's and k's columns alive with it."""


def join_base_layers(model: nn.Module, joinable, join) -> int:
    """Make the base layers of each block's `SHARED_INPUTS` groups (plain, or under peft's LoRA
    layers) one by `join(layers, copied)` where all are `joinable` and read one width on one device,
    `copied` telling for each whether `COPIED` names it; then every other joinable layer one alone,
    `join([layer])`. The fast LoRA forward runs each such group as one (`_SharedInput._outputs`). Returns
    how many groups of several were joined."""
    joined = 0
    for block in model.modules():
        for names in SHARED_INPUTS:
            layers = [getattr(child, "base_layer", child) for child in (getattr(block, n, None) for n in names)]
            if all(joinable(layer) for layer in layers) and len({(layer.in_features, layer.weight.device)
                                                                 for layer in layers}) == 1:
                join(layers, tuple(name in COPIED for name in names))
                joined += 1
    for layer in model.modules():
        if joinable(layer):
            join([layer])
    return joined


@dataclass
class LoraPatchReport:
    """What `patch_lora` changed."""

    modules: int = 0
    """LoRA Linear layers now running the fast forward."""
    shared: int = 0
    """Groups of two or more of them sharing one A product."""
    kept: Counter = field(default_factory=Counter)
    """Reason -> number of LoRA layers left on peft's forward."""

    def describe(self) -> str:
        """One line, e.g. `lora: 14 layers, 4 shared A products`."""
        text = f"lora: {self.modules} layers, {self.shared} shared A products"
        if self.kept:
            text += " (peft's forward: " + ", ".join(f"{n} with {why}" for why, n in self.kept.items()) + ")"
        return text


# --------------------------------------------------------------------------------------------------
# the shared A product


class _SharedLoraA(torch.autograd.Function):
    """U = x.to(dtype) @ cat(weights)^T, saving x (not its cast copy) for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        w = cat_rows(weights)
        ctx.save_for_backward(x, *weights)
        # F.linear, as nn.Linear, so that a group of one is peft's own product.
        return F.linear(x.to(w.dtype), w)

    @staticmethod
    def backward(ctx, du: torch.Tensor):
        x, *weights = ctx.saved_tensors
        w = cat_rows(weights)
        du = du.reshape(-1, du.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (du @ w).to(x.dtype).view(x.shape)
        # The cast copy exists again only for this product, not from forward to backward.
        return dx, *_adapter_grads(du, lambda: x.reshape(-1, x.shape[-1]).to(w.dtype), weights,
                                   ctx.needs_input_grad[1:])


def cat_rows(weights) -> torch.Tensor:
    """The matrices one above the other; one alone as it is (no copy)."""
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def _adapter_grads(du: torch.Tensor, x_of, weights, needs) -> list[torch.Tensor | None]:
    """The gradient of each A in `weights` (rows of cat(A)) where `needs` says so: dU^T x, one GEMM
    for all of them, x from `x_of()` (2-D, in the adapters' dtype) only when some are needed."""
    if not any(needs):
        return [None] * len(weights)
    parts = (du.t() @ x_of()).split([w.shape[0] for w in weights])
    return [g if need else None for g, need in zip(parts, needs)]


def shared_lora_a(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(x_a A_1^T, x_a A_2^T, ...) with x_a = x.to(A.dtype), computed as one GEMM over cat(A_i).

    The results are column slices of one [..., sum r_i] tensor. Autograd keeps x (in its own dtype)
    and the weights; backward is one GEMM for the weights' gradient and one for x's.
    """
    u = _SharedLoraA.apply(x, *weights)
    return u.split([w.shape[0] for w in weights], dim=-1)


class OneInputParts:
    """Parts computed at once for layers that read one input, handed out one by one: `take(kind,
    index, x, compute)` for a tensor x first computes every layer's part (`compute()`, in the layers'
    order) and keeps the others' until they are asked for with that same x (checked by identity and
    version counter, so any other input is computed afresh); the last one taken releases x. `kind`
    tells apart parts of different sorts computed from one x."""

    def __init__(self):
        self._release()

    def waiting_for(self, kind: str, index: int, x: torch.Tensor) -> bool:
        return (self._x is x and x._version == self._version and self._kind == kind
                and self._waiting[index] is not None)

    def take(self, kind: str, index: int, x: torch.Tensor, compute) -> torch.Tensor:
        if self.waiting_for(kind, index, x):
            part, self._waiting[index] = self._waiting[index], None
            if all(p is None for p in self._waiting):
                self._release()
            return part
        parts = list(compute())
        part, parts[index] = parts[index], None
        self._release()
        if len(parts) > 1:
            self._x, self._version, self._waiting, self._kind = x, x._version, parts, kind
        return part

    def _release(self) -> None:
        self._x, self._version, self._waiting, self._kind = None, -1, [], ""


class _SharedInput(OneInputParts):
    """LoRA layers of one block that read the same input, in the order of `SHARED_INPUTS`.

    `product(i, x)` returns layer i's x_a A_i^T; `output(i, x)` layer i's whole output, where the
    group's adapters sum in place over base layers it can run as one (`_outputs`; else None). The
    first call for a tensor x computes the parts of every layer of the group (`OneInputParts`).
    """

    def __init__(self, members: list[tuple[nn.Module, str]], *, base_unneeded_in_recompute: bool = False):
        super().__init__()
        self.members = members
        # A recompute under gradient checkpointing runs this group without its base products
        # (`patch_lora`: down_proj, where nothing after it keeps the layer's output): its outputs
        # are then s U_i B_i^T added to uninitialized memory, which nothing reads.
        self.base_unneeded_in_recompute = base_unneeded_in_recompute

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self.take("product", index, x,
                         lambda: shared_lora_a(x, [m.lora_A[a].weight for m, a in self.members]))

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        if self.waiting_for("output", index, x):
            return self.take("output", index, x, None)
        compute = self._outputs(x)
        return None if compute is None else self.take("output", index, x, compute)

    def _outputs(self, x: torch.Tensor):
        """What computes every member's whole output from x at once, or None where the group's
        adapters do not sum in place in x's dtype (`product` then serves the layers one by one): over
        joined base layers exactly these, in this order, that take x as it is: 4-bit ones
        (`Nf4Siblings`), each multiplied by its dequantized weight, `_dequantized_outputs`; float8
        ones (`Float8Siblings`) as one GEMM, with one scaling, `_joined_outputs`; over plain frozen
        `nn.Linear` layers of x's dtype, `_plain_outputs`."""
        lora = [(m.lora_A[a].weight, m.lora_B[a]) for m, a in self.members]
        if not all(a.dtype == x.dtype and b.weight.dtype == x.dtype and b.bias is None for a, b in lora):
            return None
        bases = [m.base_layer for m, _ in self.members]
        siblings = vars(bases[0]).get("siblings")  # no exception for a plain base
        if siblings is not None:
            if siblings.layers != tuple(bases) or not siblings.accepts(x):
                return None
            if hasattr(siblings, "weights"):  # weights made on demand
                return lambda: _dequantized_outputs(self.members, siblings, x, self._base_needed())
            if len({m.scaling[a] for m, a in self.members}) == 1:
                return lambda: _joined_outputs(self.members, siblings, x, self._base_needed())
            return None
        if all(type(b) is nn.Linear and b.weight.dtype == x.dtype and not b.weight.requires_grad for b in bases):
            return lambda: _plain_outputs(self.members, x, self._base_needed())
        return None

    def _base_needed(self) -> bool:
        return not (self.base_unneeded_in_recompute and recomputing())


def _joined_outputs(members: list[tuple[nn.Module, str]], siblings, x: torch.Tensor,
                    base: bool = True) -> list[torch.Tensor]:
    """Every member's y_i = base_i(x) + s U_i B_i^T over joined float8 base layers
    (`Float8Siblings`):

        Y, U = base(x), x cat(A_i)^T                one GEMM each (`_JoinedProducts`)
        Y += s U cat_diag(B_i)^T                    in place, one GEMM

    then Y split by columns (`split_columns`). B's block-diagonal matrix multiplies zeros outside
    each layer's block: r_total instead of r_i products a column, a few microseconds on GEMMs this
    thin, for one GEMM (and one backward node) where there were several. The parts that
    `siblings.copied` names (v, which attention keeps for its backward) are copied out, so as not to
    keep the others' columns alive with them; q and k are read once, by RoPE, into new tensors, and
    gate and up are kept by SwiGLU, which writes their gradients over them. Without the `base`
    product (a recompute that discards the outputs) Y starts uninitialized."""
    y, u = _JoinedProducts.apply(x.reshape(-1, x.shape[-1]), siblings, base,
                                 *(m.lora_A[a].weight for m, a in members))
    blocks = torch.block_diag(*(m.lora_B[a].weight for m, a in members))
    first, adapter = members[0]
    y.addmm_(u, blocks.t(), alpha=first.scaling[adapter])
    return split_joined(y, siblings.sizes, siblings.copied)


def split_joined(y: torch.Tensor, sizes: list[int], copied: tuple[bool, ...]) -> list[torch.Tensor]:
    """The joined output of layers that read one input, split into each layer's columns (views,
    `split_columns`), the parts that `copied` names copied out (`COPIED`)."""
    parts = split_columns(y, sizes)
    return [part.contiguous() if copy else part for part, copy in zip(parts, copied)]


class _JoinedProducts(torch.autograd.Function):
    """(Y, U) = (base(x), x cat(A)^T) for a 2-D x over joined base layers, and in backward the two
    gradients of x as one: the base's (`siblings.input_grad`), then dU cat(A) added in that GEMM's
    epilogue (`addmm_`), where two autograd nodes would each write one and a third pass add them.
    Keeps x (as `shared_lora_a` does) and A; the base keeps nothing. The adapters have x's dtype
    (`_SharedInput._outputs`). Without `base` (a recompute whose outputs nothing reads) Y is left
    uninitialized."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, siblings, base: bool, *weights: torch.Tensor):
        a = cat_rows(weights)
        ctx.siblings = siblings
        ctx.save_for_backward(x, *weights)
        y = siblings.product(x) if base else x.new_empty(x.shape[0], sum(siblings.sizes))
        return y, F.linear(x, a)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, du: torch.Tensor):
        x, *weights = ctx.saved_tensors
        a = cat_rows(weights)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.siblings.input_grad(dy).addmm_(du, a)
        return dx, None, None, *_adapter_grads(du, lambda: x, weights, ctx.needs_input_grad[3:])


def _plain_outputs(members: list[tuple[nn.Module, str]], x: torch.Tensor, base: bool = True) -> list[torch.Tensor]:
    """Every member's y_i = base_i(x) + s_i U_i B_i^T over plain frozen `nn.Linear` base layers:

        y_i, U = x W_i^T + b_i, x cat(A_i)^T        one GEMM each (`_PlainProducts`)
        y_i += s_i U_i B_i^T                        in place, one GEMM each

    the base products and U from one autograd node, whose backward sums the gradient of x over
    them in GEMMs; without the `base` products (a recompute that discards the outputs) each y_i
    starts uninitialized."""
    bases = [m.base_layer for m, _ in members]
    biases = [b.bias for b in bases if b.bias is not None]
    adapters = [m.lora_A[a].weight for m, a in members]
    *outputs, u = _PlainProducts.apply(x.reshape(-1, x.shape[-1]), [b.bias is not None for b in bases], base,
                                       *(b.weight for b in bases), *biases, *adapters)
    return _add_adapters(members, outputs, u)


def _dequantized_outputs(members: list[tuple[nn.Module, str]], siblings,
                         x: torch.Tensor, base: bool = True) -> list[torch.Tensor]:
    """Every member's y_i = base_i(x) + s_i U_i B_i^T over joined base layers whose weights are
    made on demand (`Nf4Siblings.weights`), as `_plain_outputs` computes them over plain layers
    (`_DequantizedProducts`)."""
    *outputs, u = _DequantizedProducts.apply(x.reshape(-1, x.shape[-1]), siblings, base,
                                             *(m.lora_A[a].weight for m, a in members))
    return _add_adapters(members, outputs, u)


def _add_adapters(members: list[tuple[nn.Module, str]], outputs, u: torch.Tensor) -> list[torch.Tensor]:
    """y_i += s_i U_i B_i^T in place, U_i the columns of U for member i."""
    parts = u.split([m.lora_A[a].weight.shape[0] for m, a in members], dim=-1)
    return [y.addmm_(part, m.lora_B[a].weight.t(), alpha=m.scaling[a])
            for y, part, (m, a) in zip(outputs, parts, members)]


def _summed_input_grad(dys, weights, du: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """dx = sum_i dy_i W_i + dU A: the first product, then each other added in a GEMM's epilogue
    (`addmm_`), where autograd would write each and add them."""
    dx = dys[0] @ weights[0]
    for dy, w in zip(dys[1:], weights[1:]):
        dx.addmm_(dy, w)
    return dx.addmm_(du, a)


class _PlainProducts(torch.autograd.Function):
    """(y_1, ..., y_k, U) = (x W_1^T + b_1, ..., x cat(A)^T) for a 2-D x and frozen weights W_i, and
    in backward the gradient of x over all of them as one (`_summed_input_grad`). Keeps x, the
    weights (as `F.linear` does) and A. The adapters have x's dtype. Without `base` (a recompute
    whose outputs nothing reads) the y_i are left uninitialized."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, has_bias: list[bool], base: bool, *tensors: torch.Tensor):
        k = len(has_bias)
        weights, rest = tensors[:k], tensors[k:]
        biases = iter(rest[: sum(has_bias)])
        adapters = rest[sum(has_bias):]
        ctx.k = k
        ctx.save_for_backward(x, *weights, *adapters)
        if base:
            outputs = [F.linear(x, w, next(biases) if bias else None) for w, bias in zip(weights, has_bias)]
        else:
            outputs = [x.new_empty(x.shape[0], w.shape[0]) for w in weights]
        return (*outputs, F.linear(x, cat_rows(adapters)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *saved = ctx.saved_tensors
        weights, adapters = saved[: ctx.k], saved[ctx.k:]
        dys, du = grads[: ctx.k], grads[ctx.k]
        dx = _summed_input_grad(dys, weights, du, cat_rows(adapters)) if ctx.needs_input_grad[0] else None
        n_frozen = len(ctx.needs_input_grad) - 3 - len(adapters)
        return (dx, None, None, *([None] * n_frozen),
                *_adapter_grads(du, lambda: x, adapters, ctx.needs_input_grad[3 + n_frozen:]))


class _DequantizedProducts(torch.autograd.Function):
    """`_PlainProducts` (bias-free) over joined base layers whose weights are made on demand
    (`siblings.weights(dtype)`: `Nf4Siblings`, dequantized). A step's forward keeps nothing of the
    base: backward makes the weights again. A forward recomputed under gradient checkpointing runs
    inside backward, right before the backward of the same product, and hands it the weights it
    made (`siblings.recomputed`; not as saved tensors, which the recompute must save as the step's
    forward did): one layer's weights live at a time, made twice a step instead of three times.
    Without `base` (a recompute whose outputs nothing reads) no weight is made and the outputs are
    left uninitialized."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, siblings, base: bool, *adapters: torch.Tensor):
        ctx.siblings = siblings
        ctx.save_for_backward(x, *adapters)
        if base:
            weights = siblings.weights(x.dtype)
            if ctx.needs_input_grad[0] and recomputing():
                siblings.recomputed = weights
            outputs = [F.linear(x, w) for w in weights]
        else:
            outputs = [x.new_empty(x.shape[0], n) for n in siblings.sizes]
        return (*outputs, F.linear(x, cat_rows(adapters)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *adapters = ctx.saved_tensors
        dys, du = grads[:-1], grads[-1]
        dx = None
        if ctx.needs_input_grad[0]:
            weights, ctx.siblings.recomputed = ctx.siblings.recomputed, None
            if weights is None or weights[0].dtype != dys[0].dtype:
                weights = ctx.siblings.weights(dys[0].dtype)
            dx = _summed_input_grad(dys, weights, du, cat_rows(adapters))
        return dx, None, None, *_adapter_grads(du, lambda: x, adapters, ctx.needs_input_grad[3:])


# --------------------------------------------------------------------------------------------------
# the layer forward


def _fast_lora_forward(
    module: nn.Module, x: torch.Tensor, *args, group: _SharedInput, index: int, adapter: str,
    cast_before_sum: bool, **kwargs
) -> torch.Tensor:
    if args or kwargs or not _fast_now(module, x, adapter):
        return type(module).forward(module, x, *args, **kwargs)
    joined = group.output(index, x)
    if joined is not None:  # the whole group's outputs at once (`_SharedInput._outputs`)
        return joined.view(*x.shape[:-1], joined.shape[-1])
    # 2-D from the start, so that the in-place sum below acts on the base output itself, not on a
    # view of it (autograd would then copy the whole gradient through CopySlices); a view for the
    # contiguous activations of a decoder layer, as F.linear makes one itself.
    result = module.base_layer(x.reshape(-1, x.shape[-1]))
    u = group.product(index, x)
    u = u.reshape(-1, u.shape[-1])  # a view: the columns of U, rows r_total apart
    lora_b = module.lora_B[adapter]
    scale = module.scaling[adapter]
    if lora_b.weight.dtype == result.dtype == u.dtype:
        # y = base(x) + s U_i B^T in one GEMM whose epilogue reads base(x) and writes y over it; autograd
        # keeps U_i and B, and passes dy through to base(x) unchanged.
        if result._is_view():  # a custom Function's view (torchao's float8 matmul) takes no in-place op
            out = torch.addmm(result, u, lora_b.weight.t(), alpha=scale)
        else:
            out = result.addmm_(u, lora_b.weight.t(), alpha=scale)
        if lora_b.bias is not None:  # lora_bias: s (U_i B^T + b)
            out = out.add_(lora_b.bias, alpha=scale)
    else:
        # Adapters of another dtype (float32 over a 16-bit model): peft's operations in peft's order,
        # the scaling and the sum in place where the product has the sum's dtype.
        delta = lora_b(u).mul_(scale)
        if cast_before_sum:  # peft's bitsandbytes layers round the product to the output's dtype first
            out = result + delta.to(result.dtype)
        elif delta.dtype == torch.promote_types(delta.dtype, result.dtype):
            out = delta.add_(result)
        else:
            out = result + delta
        out = out.to(result.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def _fast_now(module: nn.Module, x: torch.Tensor, adapter: str) -> bool:
    """Whether peft's forward would now compute base(x) + s B(A(x)) with exactly this adapter."""
    return (
        not module.disable_adapters
        and not module.merged
        and list(module.active_adapters) == [adapter]
        and _kept_reason(module, adapter) is None
        and getattr(module, "cast_input_dtype_enabled", True)
        and not torch.is_autocast_enabled(x.device.type)
        and not x.is_inference()  # no version counter to key the shared product on
    )


def _kept_reason(module: nn.Module, adapter: str) -> str | None:
    """Why this layer must keep peft's forward for `adapter`, or None."""
    if adapter not in module.lora_A:
        return "another adapter active"
    if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
        return "a LoRA variant (DoRA, ...)"
    if not isinstance(module.lora_dropout[adapter], nn.Identity):
        return "dropout > 0"
    return None


# --------------------------------------------------------------------------------------------------
# apply / revert


def patch_lora(model: nn.Module) -> LoraPatchReport:
    """Give every LoRA Linear layer of a peft model the fast forward; see the module docstring.

    peft's LoRA layers over bitsandbytes' 4-bit and 8-bit layers (QLoRA) are covered as plain ones;
    other types (embeddings) keep peft's forward.
    Patching twice is harmless; `unpatch_lora` reverts.
    """
    layer_types = _lora_linear_types()
    unpatch_lora(model)
    base = unwrap_model(model)
    spec = PATCH_TABLE.get(getattr(getattr(base, "config", None), "model_type", None))
    share = spec is not None
    report = LoraPatchReport()
    ready: dict[str, tuple[nn.Module, str]] = {}
    for name, module in base.named_modules():
        if type(module) not in layer_types:
            continue
        active = list(module.active_adapters)
        reason = "several active adapters" if len(active) != 1 else _kept_reason(module, active[0])
        if reason is not None:
            report.kept[reason] += 1
        else:
            ready[name] = (module, active[0])

    groups: list[list[tuple[nn.Module, str]]] = []
    grouped: set[str] = set()
    for name in ready:
        parent, _, leaf = name.rpartition(".")
        names = next((g for g in SHARED_INPUTS if leaf in g), None) if share else None
        if names is None or name in grouped:
            continue
        siblings = [n for n in (f"{parent}.{s}" if parent else s for s in names) if n in ready]
        if len(siblings) > 1 and _can_share([ready[n] for n in siblings]):
            groups.append([ready[n] for n in siblings])
            grouped.update(siblings)
    groups += [[ready[n]] for n in ready if n not in grouped]

    # down_proj's output, in a family whose layers only add it to the residual stream, is discarded
    # by a recompute (which is run for the tensors the layer keeps for backward, none after it).
    unneeded = {id(module) for name, (module, _) in ready.items()
                if share and spec.mlp_output_summed_only and name.rpartition(".")[2] == "down_proj"}
    for members in groups:
        group = _SharedInput(members, base_unneeded_in_recompute=all(id(m) in unneeded for m, _ in members))
        for index, (module, adapter) in enumerate(members):
            module.forward = functools.partial(_fast_lora_forward, module, group=group, index=index,
                                               adapter=adapter, cast_before_sum=layer_types[type(module)])
        report.modules += len(members)
        report.shared += len(members) > 1
    return report


def _lora_linear_types() -> dict[type, bool]:
    """peft's LoRA Linear classes that the fast forward runs -> whether peft's forward of that class
    casts the adapter product to the output's dtype before the sum: its layers over bitsandbytes'
    4-bit and 8-bit bases do (present where bitsandbytes is installed), its plain Linear sums first."""
    from peft.tuners.lora.layer import Linear

    types = {Linear: False}
    try:
        from peft.tuners.lora import bnb  # imports bitsandbytes, an extra
    except ImportError:
        return types
    for name in ("Linear4bit", "Linear8bitLt"):
        if hasattr(bnb, name):
            types[getattr(bnb, name)] = True
    return types


def _can_share(members: list[tuple[nn.Module, str]]) -> bool:
    """One GEMM needs one adapter name, one weight dtype and device, and one input width."""
    weights = [m.lora_A[a].weight for m, a in members]
    return (
        len({a for _, a in members}) == 1
        and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1
    )


def cast_adapters(model: nn.Module, dtype: torch.dtype) -> None:
    """Every LoRA weight and LoRA bias of a peft model in `dtype`. peft makes an adapter in its base
    layer's dtype only where that is a float: over bitsandbytes' 8-bit layers (int8 weights) it
    makes float32 ones, whatever `autocast_adapter_dtype` says."""
    for name, param in unwrap_model(model).named_parameters():
        if (".lora_A." in name or ".lora_B." in name) and param.dtype != dtype:
            param.data = param.data.to(dtype)


def unpatch_lora(model: nn.Module) -> None:
    """Put peft's forward back on every layer that `patch_lora` changed."""
    for module in unwrap_model(model).modules():
        if _is_fast(module):
            del module.forward


def is_lora_patched(model: nn.Module) -> bool:
    """Whether any LoRA layer of the model runs the fast forward."""
    return any(_is_fast(m) for m in unwrap_model(model).modules())


def _is_fast(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _fast_lora_forward
