"""FP8 training (`train.precision: fp8`): the decoder's linear layers multiply in float8, the rest of
the step as in bf16. Layers whose weights train become `Float8TrainedLinear` (below; the default,
`kernels.float8_linear`), or go through torchao's float8 training; frozen layers (the base of LoRA, a
frozen model under Medusa heads) become `Float8FrozenLinear`.

Each of torchao's layers (`Float8Linear`) keeps its bf16 weight and, at every forward and
backward, casts its two operands to float8 with a scale computed from their current absolute
maximum (dynamic scaling: e4m3 for activations and weights, e5m2 for gradients), multiplies on the
GPU's float8 tensor cores (`torch._scaled_mm`, H100-class GPUs: compute capability 8.9 or newer)
and returns bf16. `fp8_scaling: tensorwise` takes one scale per tensor (the fastest);
`rowwise` one per row.

A frozen layer needs neither: its weight never changes, so `Float8FrozenLinear` casts it once, at
conversion, to e4m3 with a scale per output channel and frees the bf16 weight (half the bytes); its
weight has no gradient, so it runs two float8 GEMMs where torchao's `Float8Linear` runs three (it
computes the weight's gradient whether the weight trains or not) and keeps no activation for it.
Only the activations and the output gradients are cast at each call, a scale per token
(`ligertune.kernels.quantize_rows`, one pass each; layers that read the same activations, q, k and
v, share one cast). q, k and v of one attention block, and gate and up of one MLP, keep their
weights in one buffer each (`Float8Siblings`), each layer's its own rows of it, so that the fast LoRA
forward computes a group's base products as one GEMM (`ligertune.models.lora`): 4 float8 GEMMs a
decoder layer instead of 7, with as many casts, transposes and autograd nodes fewer:

    forward    y  = (q_x s_x) (q_W s_W)^T            scales s_x per token, s_W per output channel
    backward   dx = q(dy * s_W) s_dy  q_W            s_W folded into dy before its cast

`Float8TrainedLinear` multiplies as a frozen layer does, for a weight that trains: the weight is
cast at each use (it changes every step), and its gradient dy^T x is a GEMM in bf16 over x as it came,
or (`kernels.float8_weight_grad`) a float8 GEMM of dy in e5m2 and x in e4m3, one scale a tensor, both
cast transposed (the GEMM's inner side is the tokens). Its siblings (q, k, v; gate, up) multiply as
one, from weights cast as one where they lie (`Float8TrainedGroup`).

What stays in bf16: the embeddings, the norms, attention, the output projection (read by the fused
linear cross-entropy as one matrix) and the LoRA adapters (small: their GEMMs are not where the time
goes). Under LoRA the frozen base layers inside peft's LoRA layers are converted; the fast LoRA
forward calls them as it calls a plain base layer.

torchao is a dependency of the `fp8` extra (`pip install 'ligertune[fp8]'`): it is the library
PyTorch's own training stack (torchtitan) uses for float8, kept in step with torch's float8 GEMMs.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any

import torch
from torch import nn

from ligertune.errors import UserError
from ligertune.kernels import quantize_rows, quantize_transposed, transpose_float8
from ligertune.models.lora import OneInputParts, cat_rows, join_base_layers, split_joined
from ligertune.models.patching import recomputing
from ligertune.quiet import quiet_optional_libraries

EXTRA = "fp8"
"""The optional dependency group that brings torchao."""
SCALINGS = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
"""Float8 tensor cores: Ada (8.9) and Hopper (9.0) and later."""


def require_torchao() -> Any:
    """The `torchao.float8` module; a `UserError` naming the extra when torchao is missing."""
    quiet_optional_libraries()
    try:
        import torchao.float8
    except ImportError:
        raise UserError(f"train.precision: fp8 needs torchao (the `{EXTRA}` extra): "
                        f"pip install 'ligertune[{EXTRA}]'") from None
    return torchao.float8


def check_float8_device(device: torch.device) -> None:
    """Refuse a device without float8 tensor cores, naming it."""
    needs = (f"train.precision: fp8 needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}."
             f"{MIN_CAPABILITY[1]} or newer (H100, H200, L40S, RTX 4090)")
    if device.type != "cuda":
        raise UserError(f"{needs}; this run is on the {device.type.upper()}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(f"{needs}; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def convert_to_float8(model: nn.Module, scaling: str = "tensorwise", *, emulate: bool = False,
                      compiled: bool = False) -> int:
    """Replace the decoder's linear layers of `model` (every `nn.Linear` but the output projection,
    whose sides are multiples of 16 as float8 GEMMs need) by torchao's `Float8Linear`, in place;
    return how many. A GEMM whose inner side is the token count (the weight's gradient) pads it to
    a multiple of 16: packed rows hold any number of tokens.

    `compiled`: each layer's forward and backward through `torch.compile`, which fuses each cast
    (absolute maximum, scale, round) into a kernel or two; run eagerly, a cast is several passes over
    its tensor and a float8 step was measured slower than bf16 (docs/PERF.md). `emulate`: torchao's
    emulation (float8 rounding, high-precision matmuls), which runs anywhere: the tests' CPU path,
    not a speed."""
    if scaling not in SCALINGS:
        raise UserError(f"train.fp8_scaling: must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    float8 = require_torchao()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(scaling), emulate=emulate,
                                 pad_inner_dim=True)
    head = model.get_output_embeddings()
    converted = []

    def chosen(module: nn.Module, name: str) -> bool:
        take = (type(module) is nn.Linear and module is not head
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if take:
            converted.append(name)
        return take

    float8.convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    if compiled:
        for name in converted:
            model.get_submodule(name).compile(dynamic=True)
    return len(converted)


def _scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(a scale_a) (b scale_b) for float8 `a` (m, k) and `b` (k, n), scales (m, 1) and (1, n), or one
    for each tensor: on a GPU the float8 tensor cores' GEMM; elsewhere the same product of the same
    float8 values in float32 (torch's CPU float8 GEMM takes one scale per tensor in some releases)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


class _InputCast:
    """The float8 cast of the latest input, kept while that input lives unchanged: q, k and v (gate
    and up) read the same activations, and cast them once. It holds the input by a weak reference
    and lets the cast go with it."""

    def __init__(self):
        self._input: weakref.ref | None = None
        self._key: tuple = ()
        self._cast: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = x if x._base is None else x._base  # a view's version is its base's
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, owner._version)
        if self._input is not None and self._input() is owner and self._key == key:
            return self._cast
        self._cast = quantize_rows(x)
        self._input, self._key = weakref.ref(owner, self._forget), key
        return self._cast

    def _forget(self, reference: weakref.ref) -> None:
        if self._input is reference:  # not a later input's
            self._input, self._key, self._cast = None, (), None


_cast_input = _InputCast()


def _float8_product(x: torch.Tensor, layer: Float8FrozenLinear | Float8Siblings | _Float8Weight) -> torch.Tensor:
    """x W^T for a 2-D x over the layer's float8 weight: x cast with a scale per token."""
    q, scale = _cast_input(x)
    return _scaled_matmul(q, layer.weight.t(), scale[:, None], layer.weight_scale[None, :], x.dtype)


def _float8_input_grad(dy: torch.Tensor, layer: Float8FrozenLinear | Float8Siblings | _Float8Weight,
                       dtype: torch.dtype) -> torch.Tensor:
    """dy W in `dtype`: W's channel scales folded into dy before its cast."""
    q, scale = quantize_rows(dy, layer.weight_scale)
    # the second operand of a float8 GEMM is read column-major: W's transpose, laid out row-major
    return _scaled_matmul(q, transpose_float8(layer.weight).t(), scale[:, None], layer.unit_scale[None, :], dtype)


class _FrozenFloat8Matmul(torch.autograd.Function):
    """y = x W^T over a float8 weight (`Float8FrozenLinear`); the gradient of x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: Float8FrozenLinear) -> torch.Tensor:
        # Nothing of x is kept. The weight and its scales are the layer's own buffers, read from it
        # in the backward: through save_for_backward the memory planner's count of what a layer
        # saves (`training.memory.SavedBytes`) would take them for activations.
        ctx.layer, ctx.out_dtype = layer, x.dtype
        return _float8_product(x, layer)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _float8_input_grad(dy, ctx.layer, ctx.out_dtype), None


class Float8Siblings:
    """Float8 frozen layers that read one input (q, k, v; gate, up), or one such layer alone: their
    weights and scales concatenated into one buffer, each layer's `weight` and `weight_scale` a view
    of its rows (contiguous, so each layer still runs alone as before, at no extra memory).
    `product(x)` of a 2-D input is the product with every layer's weight at once: one float8 GEMM,
    with the layers' outputs side by side in the order of `layers`; `input_grad(dy)` the gradient of
    x for the gradient of that output, one float8 GEMM. Plain functions, without autograd: the fast
    LoRA forward's `_JoinedProducts` calls them. `copied`: for each layer, whether the fast LoRA
    forward copies its part out of the joined output (`lora.COPIED`)."""

    def __init__(self, layers: list[Float8FrozenLinear], copied: tuple[bool, ...] | None = None):
        self.layers = tuple(layers)
        self.copied = copied or (False,) * len(layers)
        self.sizes = [layer.out_features for layer in layers]
        self.weight = cat_rows([layer.weight for layer in layers])  # a layer alone keeps its own
        self.weight_scale = cat_rows([layer.weight_scale for layer in layers])
        self.unit_scale = layers[0].unit_scale
        for layer, weight, scale in zip(layers, self.weight.split(self.sizes), self.weight_scale.split(self.sizes)):
            layer.weight, layer.weight_scale, layer.siblings = weight, scale, self

    def accepts(self, x: torch.Tensor) -> bool:
        """Any input: it is cast to float8 at each call."""
        return True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return _float8_product(x, self)

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return _float8_input_grad(dy, self, dy.dtype)


class Float8FrozenLinear(nn.Module):
    """A frozen `nn.Linear` that multiplies in float8: its weight cast once to e4m3 with a scale per
    output channel (`weight`, `weight_scale`: buffers derived from the model's weights, not saved
    with it), its input cast at each call with a scale per token; see the module docstring."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        # the backward GEMM's scales for W: ones, W's channel scales being folded into dy
        self.register_buffer("unit_scale", scale.new_ones(self.in_features), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.siblings: Float8Siblings | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _FrozenFloat8Matmul.apply(x.reshape(-1, self.in_features), self)
        if self.bias is not None:
            y = y + self.bias
        # a 2-D input (the fast LoRA forward's) gets y itself: a view would take no in-place sum
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _float8_weight_grads(dy: torch.Tensor, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """dy^T x as float8 GEMMs, one for each block of `sizes` rows (each weight's gradient its own
    tensor), in dy's dtype: dy in e5m2 (a gradient's range), x in e4m3, each cast once with one scale
    for the tensor (the GEMMs' inner side, the tokens, padded with zeros to 16)."""
    q_dy, scale_dy = quantize_transposed(dy, torch.float8_e5m2)
    q_x, scale_x = quantize_transposed(x, torch.float8_e4m3fn)
    return [_scaled_matmul(rows, q_x.t(), scale_dy, scale_x, dy.dtype) for rows in q_dy.split(sizes)]


def _weight_grads(dy: torch.Tensor, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """dy^T x in dy's dtype, one GEMM for each block of `sizes` rows, each reading its columns of dy
    where they are: each weight's gradient its own tensor, which autograd takes as it is (it would
    copy a block of one joined product)."""
    starts = itertools.accumulate([0, *sizes[:-1]])
    return [dy[:, start:start + size].t() @ x for start, size in zip(starts, sizes)]


@dataclasses.dataclass
class _Float8Weight:
    """A weight cast to float8 for one use: e4m3 values, a scale per output channel, and the unit
    scales of the input-gradient GEMM (the channel scales folded into dy instead)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    unit_scale: torch.Tensor


class _TrainedFloat8Products(torch.autograd.Function):
    """Y = x cat(W_i)^T for weights that train (a `Float8TrainedGroup`): the product and the gradient
    of x as float8 GEMMs over the weights cast as one, at each use (they change every step); each
    weight's gradient dY_i^T x a GEMM in its dtype from x as it came, or with `weight_grad_in_float8`
    a float8 GEMM too, dY and x cast once for all. Without `product_needed` (a recompute whose output
    nothing reads: `patching._glu_mlp`) Y is left uninitialized."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Float8TrainedGroup, product_needed: bool,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x if any(ctx.needs_input_grad[3:]) else None)
        ctx.group = group  # the weights cast again for backward, or by the recompute: not kept
        if not product_needed:
            return x.new_empty(x.shape[0], sum(group.sizes))
        cast = group.cast_weights()
        if ctx.needs_input_grad[0] and recomputing():
            group.keep_for_backward(cast)
        return _float8_product(x, cast)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        group = ctx.group
        dx = _float8_input_grad(dy, group.kept_or_cast(), dy.dtype) if ctx.needs_input_grad[0] else None
        grads = [None] * len(group.layers)
        if x is not None:
            weight_grads = _float8_weight_grads if group.weight_grad_in_float8 else _weight_grads
            grads = weight_grads(dy, x, group.sizes)
            grads = [g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[3:])]
        return dx, None, None, *grads


class Float8TrainedGroup(OneInputParts):
    """Float8 layers whose weights train and that read one input (q, k and v; gate and up), or one
    such layer alone, multiplied as one: the first of them to run computes every layer's product in
    one float8 GEMM over their weights cast as one (`quantize_rows` of the several weights, each read
    where it is) and keeps the others' columns until they are asked for with the same input
    (`OneInputParts`); the group's backward is one autograd node, with one cast of the output
    gradients and one GEMM for the input's gradient (each weight's gradient its own GEMM). Where each
    layer alone ran its own, that is 3 (2) times fewer weight casts, input casts, float8 GEMMs and
    autograd nodes, and no sum of the input's gradients: some 400 launches fewer a 1B step (which
    measured no faster for it: its kernels set its pace, docs/PERF.md). The parameters stay each
    layer's own. `copied`: for each layer, whether its columns are copied out of the joined output
    (`lora.COPIED`).

    Under gradient checkpointing the recompute of the group's product runs right before the group's
    backward, and hands it the weights' cast (`keep_for_backward`): the weights are cast twice a
    step where they were cast three times."""

    def __init__(self, layers: list[Float8TrainedLinear], copied: tuple[bool, ...] | None = None):
        super().__init__()
        self.layers = tuple(layers)
        self.copied = copied or (False,) * len(layers)
        self.sizes = [layer.out_features for layer in layers]
        self.unit_scale = layers[0].unit_scale
        self._kept: tuple | None = None
        for layer in layers:
            layer.group = self

    @property
    def weight_grad_in_float8(self) -> bool:
        return self.layers[0].weight_grad_in_float8

    def output(self, layer: Float8TrainedLinear, x: torch.Tensor, unneeded_in_recompute: bool) -> torch.Tensor:
        """`layer`'s product with x, 2-D: its columns of the group's."""
        index = self.layers.index(layer)
        return self.take("output", index, x, lambda: self._outputs(x, unneeded_in_recompute))

    def _outputs(self, x: torch.Tensor, unneeded_in_recompute: bool) -> list[torch.Tensor]:
        needed = not (unneeded_in_recompute and recomputing())
        y = _TrainedFloat8Products.apply(x.reshape(-1, x.shape[-1]), self, needed,
                                         *(layer.weight for layer in self.layers))
        return [y] if len(self.layers) == 1 else split_joined(y, self.sizes, self.copied)

    def cast_weights(self) -> _Float8Weight:
        """The weights as they are now, in e4m3 with a scale per output channel, one above the other."""
        with torch.no_grad():
            weight, scale = quantize_rows([layer.weight.detach() for layer in self.layers])
        return _Float8Weight(weight, scale, self.unit_scale)

    def keep_for_backward(self, cast: _Float8Weight) -> None:
        """Keep a recompute's cast for the backward of the same backward pass (graph task)."""
        self._kept = (torch._C._current_graph_task_id(), self._versions(), cast)

    def kept_or_cast(self) -> _Float8Weight:
        """The cast that this backward's recompute kept, where the weights have not changed since;
        else a new one."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[:2] == (torch._C._current_graph_task_id(), self._versions()):
            return kept[2]
        return self.cast_weights()

    def _versions(self) -> tuple:
        return tuple((layer.weight.data_ptr(), layer.weight._version) for layer in self.layers)


class Float8TrainedLinear(nn.Linear):
    """An `nn.Linear` whose weight trains and whose products run in float8 (ligertune's layer for
    `train.precision: fp8` with `kernels.float8_linear`): at each use the weight is cast to e4m3 with
    a scale per output channel and the input (the output gradient) with a scale per token, as a
    frozen base's are (`Float8FrozenLinear`); the weight's gradient is a GEMM in the weight's dtype,
    or with `weight_grad_in_float8` (`kernels.float8_weight_grad`) a float8 GEMM of the output
    gradient in e5m2 and the input in e4m3, one scale for each tensor. Siblings that read one input
    multiply as one (`group`, a `Float8TrainedGroup`; the layer alone until `train_in_float8` joins
    them). The same parameters and state as the `nn.Linear` it replaces, so checkpoints and exports
    do not see it."""

    skips_unneeded_products = True
    """Takes `unneeded_in_recompute` (`patching._glu_mlp`)."""

    def __init__(self, linear: nn.Linear, *, weight_grad_in_float8: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight_grad_in_float8 = weight_grad_in_float8
        # the input-gradient GEMM's scales for W (its channel scales folded into dy): made once
        self.register_buffer("unit_scale", torch.ones(self.in_features, device=self.weight.device),
                             persistent=False)
        self.group = Float8TrainedGroup([self])

    def extra_repr(self) -> str:
        joined = len(self.group.layers)
        products = f"float8 products, one GEMM for {joined} layers" if joined > 1 else "float8 products"
        gradient = "float8" if self.weight_grad_in_float8 else str(self.weight.dtype).removeprefix("torch.")
        return f"{super().extra_repr()}, {products}, weight gradient in {gradient}"

    def forward(self, x: torch.Tensor, *, unneeded_in_recompute: bool = False) -> torch.Tensor:
        y = self.group.output(self, x, unneeded_in_recompute)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


def train_in_float8(model: nn.Module, *, weight_grad: bool = False) -> int:
    """Replace the decoder's linear layers of `model` whose weights train (every `nn.Linear` but the
    output projection, sides multiples of 16 as float8 GEMMs need) by `Float8TrainedLinear`, in
    place, keeping their parameters, and join each block's q, k and v, and gate and up, where they
    are bias-free and read one width (`Float8TrainedGroup`); return how many layers. `weight_grad`:
    their weights' gradients as float8 GEMMs too."""
    head = model.get_output_embeddings()
    chosen = [
        (parent, name, child)
        for parent in model.modules() for name, child in parent.named_children()
        if type(child) is nn.Linear and child is not head and child.weight.requires_grad
        and child.in_features % 16 == 0 and child.out_features % 16 == 0
    ]
    for parent, name, child in chosen:
        setattr(parent, name, Float8TrainedLinear(child, weight_grad_in_float8=weight_grad))
    join_base_layers(model, lambda layer: (isinstance(layer, Float8TrainedLinear) and layer.bias is None
                                           and len(layer.group.layers) == 1), Float8TrainedGroup)
    return len(chosen)


def freeze_to_float8(model: nn.Module) -> int:
    """Replace every frozen `nn.Linear` of the decoder (no trainable weight; not the output projection
    nor a layer tied to the embeddings; sides multiples of 16, as float8 GEMMs need) by a
    `Float8FrozenLinear`, in place, under LoRA's wrappers too; return how many. A layer that
    `lora.modules_to_save` copies keeps its original as it is: with the adapters off (a reference
    pass) the original runs again, and the output projection's is read as a matrix by the loss."""
    tied = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    chosen = [
        (parent, name, child)
        for parent in model.modules() for name, child in parent.named_children()
        if type(child) is nn.Linear and not child.weight.requires_grad and id(child.weight) not in tied
        and child.in_features % 16 == 0 and child.out_features % 16 == 0
        and type(parent).__name__ != "ModulesToSaveWrapper"  # peft's
    ]
    for parent, name, child in chosen:
        setattr(parent, name, Float8FrozenLinear(child))
    join_siblings(model)
    return len(chosen)


def join_siblings(model: nn.Module) -> int:
    """Join the float8 weights of each block's q, k and v, and of its gate and up (the layers that
    read one input: each a `Float8FrozenLinear`, or peft's LoRA layer over one), into one
    `Float8Siblings` where all are bias-free and read one width, and make every other bias-free
    float8 layer one alone (`lora.join_base_layers`); return how many groups of several were
    joined."""
    return join_base_layers(
        model, lambda layer: (isinstance(layer, Float8FrozenLinear) and layer.bias is None
                              and layer.siblings is None),
        Float8Siblings)


def float8_layers(model: nn.Module) -> int:
    """How many layers of `model` multiply in float8."""
    return sum(isinstance(m, (Float8FrozenLinear, Float8TrainedLinear))
               or (type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao."))
               for m in model.modules())
