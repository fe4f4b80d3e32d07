"""The problems of `ligertune bench kernels`: for one kernel at one shape, the inputs and the rows
that run on them.

Every implementation of a problem runs on the same inputs:

    ligertune          the public `ligertune.kernels` function (Triton on CUDA; on a CPU the
                       reference, or the Triton interpreter under LIGERTUNE_KERNELS=triton)
    torch eager        the usual PyTorch/transformers formulation; for the loss:
                       logits = h @ W.T in the input dtype, then float32 cross_entropy
    torch.compile      that same eager function through torch.compile (a failure is reported)
    liger              Liger-Kernel's op, when importable
    cce, cce exact     Cut Cross-Entropy's `linear_cross_entropy` with its default gradient
                       filtering, and with filtering off (exact gradients), when importable

and, for the fused loss only, ligertune with every option on (z-loss, label smoothing, token
weights; accuracy is always computed), ligertune with a 120 MiB logits budget, and the floor: the
three bare GEMMs of any linear + cross-entropy (h @ W.T, dlogits @ W, dlogits.T @ h). The fused
divergence (`divergence_problem`, distillation: the generalised JSD against a teacher) has the
same rows but the options one and cce, with Liger's `LigerFusedLinearJSD` as its peer and four GEMMs
as its floor (the teacher's logits too).

Each problem also carries its reference (`ligertune.kernels.reference`, which the runner calls on
the inputs cast to a higher precision) and the nominal work of one forward + backward, the same for
every row of a shape:

    fused loss:      6 N H V flops (forward logits 2NHV, the two backward products 4NHV), ignored
                     rows included: an implementation that skips them shows a higher rate
    divergence:      8 N H V flops (the teacher's and the student's logits, the two backward
                     products), ignored rows included, the teacher's hidden size being H
    rms_norm:        bytes of x, w, y (forward) + dy, x, w, dx, dw (backward)
    swiglu, geglu:   bytes of gate, up, y (forward) + dy, gate, up, dgate, dup (backward)
    rope:            bytes of q, k, cos, sin, q', k' (forward) + the same count backward
    lion:            bytes of one optimizer step, p, g, m read and p, m written, each row in its
                     own dtypes (`lion_bytes`); no backward

The Lion step (`lion_problem`) is the one problem whose rows share their inputs, in place (an 8B
model leaves no room for a copy per row), and whose error each row measures on a small sample
against the formula in float64; its rows are described there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ligertune.bench.shapes import SHAPE_DIMS

IGNORED_FRACTION = 0.1
"""Share of targets set to ignore_index, as prompt tokens of chat data would be (on the low side)."""

LOW_MEMORY_CHUNK_BYTES = 120 * 2**20
"""The low-memory setting: a logits buffer that keeps the loss's extra memory under 128 MiB."""
Z_LOSS_WEIGHT = 1e-4
LABEL_SMOOTHING = 0.1
RMS_EPS = 1e-6
JSD_BETA = 0.5
"""The divergence problem's beta: the symmetric Jensen-Shannon divergence, Liger's default."""
LIGERTUNE = "ligertune"
FLOOR = "3 GEMMs (floor)"
DIVERGENCE_FLOOR = "4 GEMMs (floor)"


@dataclass
class Impl:
    """One row: `run(inputs)` returns the outputs whose (sum with upstream gradients) is backpropagated.

    semantics: the reference the row is checked against ("plain" or "options").
    manual: `run` does all its work itself (the GEMM floor, an optimizer step): no backward; its
        error comes from the problem's `check`, if it has one.
    peer_on_cpu: a peer row that also runs on a CPU (other peer rows need CUDA).
    setup, teardown: called before the row's first call and after its last, outside the timing
        (building what the row needs once, such as an optimizer over the problem's tensors).
    bytes: the row's own nominal bytes, where its storage differs from the problem's.
    baseline: the row whose time this one's speed-up is taken against (default: the first row).
    """

    name: str
    run: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]] | None
    peer: str | None = None
    compiled: bool = False
    semantics: str = "plain"
    manual: bool = False
    peer_on_cpu: bool = False
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    bytes: float | None = None
    baseline: str | None = None


@dataclass
class Problem:
    """One kernel at one shape: leaf inputs, upstream gradients, names of what is compared, work counts.

    copy_inputs: every row runs on its own copy of the inputs (False: all rows work in place on the
        one set, for an optimizer step over billions of parameters that leaves no room for a copy;
        the step's work does not depend on the values).
    check: `check(impl)` -> {name: relative error} for a manual row, measured by the problem itself
        (on a small sample of its own, when the inputs are too large to copy).
    """

    kernel: str
    dims: dict[str, int]
    inputs: dict[str, torch.Tensor]
    grad_outputs: tuple[torch.Tensor, ...] | None  # None: the single output is a scalar loss
    output_names: tuple[str, ...]
    reference: Callable[[dict[str, torch.Tensor], str], tuple[torch.Tensor, ...]] | None
    impls: list[Impl]
    flops: float | None = None
    bytes: float | None = None
    copy_inputs: bool = True
    check: Callable[[Impl], dict[str, float]] | None = None

    @property
    def leaves(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name, t in self.inputs.items() if t.requires_grad]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, *, gen, device, dtype, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
    return t.requires_grad_(grad)


def flce_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    n, h, v = dims["N"], dims["H"], dims["V"]
    gen = _generator(device, seed)
    # Logits of standard deviation ~2, about what a trained LM head gives.
    hidden = _randn((n, h), gen=gen, device=device, dtype=dtype, grad=True)
    weight = _randn((v, h), gen=gen, device=device, dtype=dtype, scale=2.0 / math.sqrt(h), grad=True)
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    ignored = torch.rand(n, generator=gen, device=device) < IGNORED_FRACTION
    targets = targets.masked_fill(ignored, -100)
    n_supervised = max(1, int((~ignored).sum().item()))
    # Step-normalized weights as the trainer passes them (sum reduction): about 1 / |T| each.
    token_weights = (0.5 + torch.rand(n, generator=gen, device=device)) / n_supervised
    inputs = {"hidden": hidden, "weight": weight, "targets": targets, "token_weights": token_weights}

    from ligertune import kernels
    from ligertune.kernels import LossOptions, reference

    path = kernels.active_path(device)
    options = LossOptions(z_loss_weight=Z_LOSS_WEIGHT, label_smoothing=LABEL_SMOOTHING, reduction="sum")

    def ours(x, **extra):
        return (kernels.fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **extra).loss,)

    def ours_options(x):
        return ours(x, token_weights=x["token_weights"], options=options)

    def ref(x, semantics):
        extra = dict(token_weights=x["token_weights"], options=options) if semantics == "options" else {}
        return (reference.fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **extra).loss,)

    def liger(x):
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return (LigerFusedLinearCrossEntropyLoss()(x["weight"], x["hidden"], x["targets"]),)

    def cce(x, **kwargs):
        from cut_cross_entropy import linear_cross_entropy

        return (linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **kwargs),)

    def eager(x):
        return (_eager_flce(x["hidden"], x["weight"], x["targets"]),)

    floor = GemmFloor(n_supervised, h, v, device, dtype, gen)
    impls = [
        Impl(f"{LIGERTUNE} ({path})", ours),
        Impl(f"{LIGERTUNE} +options", ours_options, semantics="options"),
        Impl(f"{LIGERTUNE} low-mem ({LOW_MEMORY_CHUNK_BYTES >> 20} MiB chunks)",
             lambda x: ours(x, options=LossOptions(chunk_bytes=LOW_MEMORY_CHUNK_BYTES))),
        Impl("torch eager", eager),
        Impl("torch.compile", eager, compiled=True),
        Impl("liger", liger, peer="liger"),
        Impl("cce", cce, peer="cce"),
        Impl("cce exact", lambda x: cce(x, filter_eps=None), peer="cce"),
        Impl(FLOOR, floor, manual=True),
    ]
    return Problem(
        "flce", dims, inputs, None, ("loss", "grad_hidden", "grad_weight"), ref, impls, flops=6.0 * n * h * v
    )


def _eager_flce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss as `transformers` computes it: logits in the input dtype, upcast, then cross-entropy."""
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


class GemmFloor:
    """The three products of any linear + cross-entropy, into preallocated outputs, without autograd:
    logits = h @ W.T, grad_h = dlogits @ W, grad_W = dlogits.T @ h; with `teacher`, a fourth for a
    distillation loss, the teacher's logits = ht @ Wt.T. Buffers are allocated by the first
    (warm-up) call, so that they count neither in the time nor in the extra memory.

    `n` is the number of supervised rows: an ignored row needs no logits, so the products the loss
    must do run over those rows alone (here the first `n` rows of h and ht, without a gather)."""

    def __init__(self, n: int, h: int, v: int, device: torch.device, dtype: torch.dtype,
                 gen: torch.Generator, *, teacher: bool = False):
        self.shapes = {"logits": (n, v), "dlogits": (n, v), "grad_h": (n, h), "grad_w": (v, h)}
        if teacher:
            self.shapes["teacher_logits"] = (n, v)
        self.device, self.dtype, self.gen = device, dtype, gen
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, x: dict[str, torch.Tensor]) -> tuple:
        if not self.buffers:
            self.buffers = {
                name: torch.empty(shape, device=self.device, dtype=self.dtype)
                for name, shape in self.shapes.items()
            }
            # Products of random data: zeros would run faster than real gradients do.
            self.buffers["dlogits"] = _randn(
                self.shapes["dlogits"], gen=self.gen, device=self.device, dtype=self.dtype, scale=1e-3
            )
        b = self.buffers
        n = self.shapes["logits"][0]
        hidden, weight = x["hidden"].detach()[:n], x["weight"].detach()
        if "teacher_logits" in b:
            teacher_hidden, teacher_weight = x["teacher_hidden"].detach()[:n], x["teacher_weight"].detach()
            torch.mm(teacher_hidden, teacher_weight.t(), out=b["teacher_logits"])
        torch.mm(hidden, weight.t(), out=b["logits"])
        torch.mm(b["dlogits"], weight, out=b["grad_h"])
        torch.mm(b["dlogits"].t(), hidden, out=b["grad_w"])
        return ()

    def release(self) -> None:
        self.buffers = {}


def kl_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    """`divergence_problem` with distillation's default divergence, the forward KL(P || Q) of the
    teacher's distribution P from the student's Q, which Liger's `LigerFusedLinearJSD` computes at
    jsd_beta 0."""
    return divergence_problem(dims, device, dtype, seed, divergence="forward_kl")


def divergence_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int, *,
                       divergence: str = "jsd") -> Problem:
    """Distillation's fused loss at the fused cross-entropy's shapes: the student's and a teacher's
    hidden states [N, H] and output layers [V, H] drawn as `flce_problem` draws them, 10% of the
    targets ignored, and the generalised JSD with beta `JSD_BETA` (or, with `divergence`
    "forward_kl", the forward KL) at temperature 1, averaged over the supervised rows.

    That is the quantity of Liger-Kernel's `LigerFusedLinearJSD(jsd_beta, temperature)` given the
    targets as its `shift_labels`: its kernel computes beta KL(P || M) + (1 - beta) KL(Q || M) with
    M = beta P + (1 - beta) Q, P the teacher's softmax and Q the student's, both of the logits over
    the temperature, not multiplied by its square, summed over the rows whose label is not
    ignore_index and divided by their count (`liger_kernel/ops/jsd.py`, `fused_linear_jsd.py`).
    Only at beta 0 and 1 do the two differ (Liger switches to a forward or reverse KL there).
    """
    n, h, v = dims["N"], dims["H"], dims["V"]
    gen = _generator(device, seed)
    hidden = _randn((n, h), gen=gen, device=device, dtype=dtype, grad=True)
    weight = _randn((v, h), gen=gen, device=device, dtype=dtype, scale=2.0 / math.sqrt(h), grad=True)
    teacher_hidden = _randn((n, h), gen=gen, device=device, dtype=dtype)
    teacher_weight = _randn((v, h), gen=gen, device=device, dtype=dtype, scale=2.0 / math.sqrt(h))
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    ignored = torch.rand(n, generator=gen, device=device) < IGNORED_FRACTION
    targets = targets.masked_fill(ignored, -100)
    n_supervised = max(1, int((~ignored).sum().item()))
    inputs = {"hidden": hidden, "weight": weight, "teacher_hidden": teacher_hidden,
              "teacher_weight": teacher_weight, "targets": targets}

    from ligertune import kernels
    from ligertune.kernels import DivergenceOptions, reference

    path = kernels.active_path(device)
    kl = divergence == "forward_kl"
    liger_beta = 0.0 if kl else JSD_BETA  # Liger's forward KL is its JSD at beta 0
    chosen = dict(divergence=divergence, beta=JSD_BETA, temperature=1.0, reduction="mean")
    options = DivergenceOptions(**chosen)
    low_memory = DivergenceOptions(**chosen, chunk_bytes=LOW_MEMORY_CHUNK_BYTES)

    def call(impl, x, opts=options):
        return (impl(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["targets"],
                     options=opts).loss,)

    def liger(x):
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss = LigerFusedLinearJSD(jsd_beta=liger_beta, temperature=1.0)
        return (loss(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["targets"]),)

    def eager(x):
        loss = _eager_kl if kl else _eager_jsd
        return (loss(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["targets"]),)

    impls = [
        Impl(f"{LIGERTUNE} ({path})", lambda x: call(kernels.fused_linear_divergence, x)),
        Impl(f"{LIGERTUNE} low-mem ({LOW_MEMORY_CHUNK_BYTES >> 20} MiB chunks)",
             lambda x: call(kernels.fused_linear_divergence, x, low_memory)),
        Impl("torch eager", eager),
        Impl("torch.compile", eager, compiled=True),
        Impl("liger", liger, peer="liger"),
        Impl(DIVERGENCE_FLOOR, GemmFloor(n_supervised, h, v, device, dtype, gen, teacher=True), manual=True),
    ]
    return Problem(
        "kl" if kl else "divergence", dims, inputs, None, ("loss", "grad_hidden", "grad_weight"),
        lambda x, _: call(reference.fused_linear_divergence, x), impls, flops=8.0 * n * h * v,
    )


def _eager_jsd(hidden, weight, teacher_hidden, teacher_weight, targets, beta: float = JSD_BETA
               ) -> torch.Tensor:
    """The generalised JSD as a plain PyTorch distillation loss computes it (the form of TRL's GKD
    trainer): both logits in the input dtype, upcast, log-softmax, log M as a logsumexp, the two KL
    terms by `kl_div`, averaged over the supervised rows."""
    log_q = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    log_p = torch.log_softmax((teacher_hidden @ teacher_weight.t()).float(), dim=-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    kl_p = F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(dim=-1)
    kl_q = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(dim=-1)
    supervised = targets != -100
    return ((beta * kl_p + (1.0 - beta) * kl_q) * supervised).sum() / supervised.sum().clamp(min=1)


def _eager_kl(hidden, weight, teacher_hidden, teacher_weight, targets) -> torch.Tensor:
    """The forward KL(P || Q) as a plain PyTorch distillation loss computes it: both logits in the
    input dtype, upcast, log-softmax, `kl_div`, averaged over the supervised rows."""
    log_q = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    log_p = torch.log_softmax((teacher_hidden @ teacher_weight.t()).float(), dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1)
    supervised = targets != -100
    return (kl * supervised).sum() / supervised.sum().clamp(min=1)


def rms_norm_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    t, h = dims["T"], dims["H"]
    gen = _generator(device, seed)
    x = _randn((t, h), gen=gen, device=device, dtype=dtype, grad=True)
    w = (1.0 + 0.1 * torch.randn(h, generator=gen, device=device)).to(dtype).requires_grad_(True)
    dy = _randn((t, h), gen=gen, device=device, dtype=dtype)
    inputs = {"x": x, "weight": w}

    from ligertune import kernels
    from ligertune.kernels import reference

    def liger(z):
        from liger_kernel.transformers.functional import liger_rms_norm

        return (liger_rms_norm(z["x"], z["weight"], RMS_EPS),)

    def ours(z):
        return (kernels.rms_norm(z["x"], z["weight"], RMS_EPS),)

    impls = [
        Impl(f"{LIGERTUNE} ({kernels.active_path(device)})", ours),
        Impl("torch eager", lambda z: (_eager_rms_norm(z["x"], z["weight"]),)),
        Impl("torch.compile", lambda z: (_eager_rms_norm(z["x"], z["weight"]),), compiled=True),
        Impl("liger", liger, peer="liger"),
    ]
    e = x.element_size()
    n_bytes = (5 * t * h + 3 * h) * e
    return Problem(
        "rms_norm", dims, inputs, (dy,), ("y", "grad_x", "grad_weight"),
        lambda z, _: (reference.rms_norm(z["x"], z["weight"], RMS_EPS),), impls, bytes=n_bytes,
    )


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`: normalize in float32, round to the input dtype, then scale."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return weight * normed.to(x.dtype)


def _glu_problem(glu: str, dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int
                 ) -> Problem:
    """SwiGLU's or GeGLU's unit act(gate) * up over [T, I] (`glu`: "swiglu" | "geglu")."""
    t, i = dims["T"], dims["I"]
    gen = _generator(device, seed)
    gate = _randn((t, i), gen=gen, device=device, dtype=dtype, grad=True)
    up = _randn((t, i), gen=gen, device=device, dtype=dtype, grad=True)
    dy = _randn((t, i), gen=gen, device=device, dtype=dtype)

    from ligertune import kernels
    from ligertune.kernels import reference

    activation = F.silu if glu == "swiglu" else functools.partial(F.gelu, approximate="tanh")

    def eager(z):
        return (activation(z["gate"]) * z["up"],)

    def liger(z):
        from liger_kernel.transformers import functional

        return (getattr(functional, f"liger_{glu}")(z["gate"], z["up"]),)

    impls = [
        Impl(f"{LIGERTUNE} ({kernels.active_path(device)})",
             lambda z: (getattr(kernels, glu)(z["gate"], z["up"]),)),
        Impl("torch eager", eager),
        Impl("torch.compile", eager, compiled=True),
        Impl("liger", liger, peer="liger"),
    ]
    return Problem(
        glu, dims, {"gate": gate, "up": up}, (dy,), ("y", "grad_gate", "grad_up"),
        lambda z, _: (getattr(reference, glu)(z["gate"], z["up"]),), impls,
        bytes=8 * t * i * gate.element_size(),
    )


swiglu_problem = functools.partial(_glu_problem, "swiglu")
geglu_problem = functools.partial(_glu_problem, "geglu")


def rope_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    b, seq, hq, hk, d = (dims[k] for k in SHAPE_DIMS["rope"])
    gen = _generator(device, seed)
    # q and k as `transformers` hands them over: projections viewed [B, L, H, D], then transposed.
    q = _randn((b, seq, hq, d), gen=gen, device=device, dtype=dtype, grad=True)
    k = _randn((b, seq, hk, d), gen=gen, device=device, dtype=dtype, grad=True)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos = emb.cos().to(dtype)[None].expand(b, seq, d).contiguous()
    sin = emb.sin().to(dtype)[None].expand(b, seq, d).contiguous()
    dq = _randn((b, hq, seq, d), gen=gen, device=device, dtype=dtype)
    dk = _randn((b, hk, seq, d), gen=gen, device=device, dtype=dtype)
    inputs = {"q": q, "k": k, "cos": cos, "sin": sin}

    from ligertune import kernels
    from ligertune.kernels import reference

    def heads_first(z):
        return z["q"].transpose(1, 2), z["k"].transpose(1, 2), z["cos"], z["sin"]

    def liger(z):
        from liger_kernel.transformers.functional import liger_rope

        return tuple(liger_rope(*heads_first(z)))

    def ours(z):
        return tuple(kernels.apply_rope(*heads_first(z)))

    impls = [
        Impl(f"{LIGERTUNE} ({kernels.active_path(device)})", ours),
        Impl("torch eager", lambda z: _eager_rope(*heads_first(z))),
        Impl("torch.compile", lambda z: _eager_rope(*heads_first(z)), compiled=True),
        Impl("liger", liger, peer="liger"),
    ]
    e = q.element_size()
    n_bytes = (4 * (q.numel() + k.numel()) + 4 * cos.numel()) * e
    return Problem(
        "rope", dims, inputs, (dq, dk), ("q", "k", "grad_q", "grad_k"),
        lambda z, _: tuple(reference.apply_rope(*heads_first(z))), impls, bytes=n_bytes,
    )


def _eager_rope(q, k, cos, sin):
    """`apply_rotary_pos_emb` of `transformers`: q * cos + rotate_half(q) * sin, cos unsqueezed on heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --------------------------------------------------------------------------------------------------
# The Lion optimizer step


LION_HYPERPARAMETERS = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}
"""Every row takes one step with these (Lion's usual scale); the time does not depend on them."""

REFERENCE_GROUP_ELEMENTS = 2**28
"""The foreach twin is called on groups of tensors of at most this many elements (a larger tensor
alone): on 16-bit parameters it makes four float32 temporaries of its input's size (parameter and
gradient copies, the update, the NaN carrier), 4 GiB a group instead of 128 GB for an 8B model."""

LION_PROBE_SHAPES = ((37, 41), (4099,), (7,))
"""The sample on which every row's error is measured: odd sizes, one tensor longer than a block."""

_SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def lion_shapes(dims: dict[str, int]) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama-style decoder of L layers, hidden size H, MLP width I and
    vocabulary V: the embedding [V, H]; per layer the q and o projections [H, H], k and v [H/4, H]
    (grouped-query attention with a quarter of the heads for K and V, as Llama 3's 8 of 32), gate and
    up [I, H], down [H, I] and two norms [H]; the final norm; and with E = 2 an untied output layer
    [V, H]. Llama-3.2-1B is 16x2048x8192x128256x1 (1.24e9 parameters), Llama-3.1-8B
    32x4096x14336x128256x2 (8.03e9)."""
    layers, hidden, width, vocab, embeddings = (dims[k] for k in ("L", "H", "I", "V", "E"))
    kv = max(1, hidden // 4)
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
             (width, hidden), (width, hidden), (hidden, width), (hidden,), (hidden,)]
    return [(vocab, hidden), *layer * layers, (hidden,), *[(vocab, hidden)] * (embeddings - 1)]


def lion_bytes(n: int, param_dtype: torch.dtype, momentum_dtype: torch.dtype) -> int:
    """Bytes one step must move over n elements: p, g, m read once, p and m written once,
    n (2 s_p + s_g + 2 s_m) (docs/kernels.md): 14 n for bf16 p and g with a float32 m."""
    s_p = torch.empty((), dtype=param_dtype).element_size()
    s_m = torch.empty((), dtype=momentum_dtype).element_size()
    return n * (3 * s_p + 2 * s_m)


class LionRow:
    """One way of taking the step. `make(params, grads, moments)` returns the step over those lists,
    having built once what it needs (groups, an optimizer); `setup` builds it on the problem's
    tensors (after `prepare`, e.g. drawing the momentum it keeps), `run` takes it."""

    def __init__(self, make: Callable, tensors: tuple[list, list, list], momentum_dtype: torch.dtype,
                 prepare: Callable[[], None] | None = None):
        self.make, self.tensors, self.momentum_dtype, self.prepare = make, tensors, momentum_dtype, prepare
        self.step: Callable[[], object] | None = None

    def setup(self) -> None:
        if self.prepare is not None:
            self.prepare()
        self.step = self.make(*self.tensors)

    def teardown(self) -> None:
        self.step = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple:
        self.step()
        return ()


def lion_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    """One Lion step over the parameters of `lion_shapes(dims)`, in place, per row:

        ligertune, m fp32          `ligertune.kernels.lion_step` with the float32 momentum that
                                   `ligertune.training.lion.Lion` keeps
        torch foreach, m fp32      its pure-torch twin, `reference.lion_step` (torch._foreach_* ops),
                                   on groups of `REFERENCE_GROUP_ELEMENTS`
        ligertune, m <dtype>       ligertune with the momentum in the parameters' dtype (16-bit
                                   parameters only): the layout of the rows below
        lion-pytorch [foreach | triton], m <dtype>
                                   lion-pytorch's `Lion` (a loop of torch ops per tensor), its
                                   `lion_pytorch.foreach.Lion`, and `Lion(use_triton=True)` (one
                                   Triton launch per tensor, CUDA only), each with its own momentum
                                   layout, the parameters' dtype; when importable

    The momentum of the rows that keep it in a 16-bit dtype is laid in the first bytes of the
    float32 one (an 8B model leaves no room for a second), redrawn before each such row. Each row's
    bytes are `lion_bytes` in its own dtypes, and its speed-up is taken against the ligertune row
    with the same momentum. Errors: each row steps a small sample (`LION_PROBE_SHAPES`) once,
    against the formula in float64 (`param`, `momentum`).
    """
    gen = _generator(device, seed)
    shapes = lion_shapes(dims)
    params = [_randn(s, gen=gen, device=device, dtype=dtype, scale=0.02) for s in shapes]
    grads = [_randn(s, gen=gen, device=device, dtype=dtype, scale=1e-3) for s in shapes]
    moments = [_randn(s, gen=gen, device=device, dtype=torch.float32, scale=1e-3) for s in shapes]
    low = moments if dtype == torch.float32 else [_reinterpret(m, dtype) for m in moments]
    n = sum(p.numel() for p in params)

    def redraw_low() -> None:
        for m in low:
            m.normal_(0.0, 1e-3, generator=gen)

    from ligertune import kernels

    path = kernels.active_path(device)
    wide, narrow = _SHORT_DTYPES[torch.float32], _SHORT_DTYPES[dtype]
    ours = f"{LIGERTUNE} ({path}), m {wide}"
    ours_low = f"{LIGERTUNE} ({path}), m {narrow}" if dtype != torch.float32 else ours
    specs = [
        (ours, _ligertune_lion, moments, None, None),
        (f"torch foreach, m {wide}", _foreach_lion, moments, None, None),
    ]
    if dtype != torch.float32:
        specs.append((ours_low, _ligertune_lion, low, redraw_low, None))
    for variant, suffix in (("plain", ""), ("foreach", " foreach"), ("triton", " triton")):
        specs.append((f"lion-pytorch{suffix}, m {narrow}", _lion_pytorch(variant), low, redraw_low, variant))

    impls = []
    for name, make, momenta, prepare, variant in specs:
        row = LionRow(make, (params, grads, momenta), momenta[0].dtype, prepare)
        impls.append(Impl(
            name, row, manual=True, setup=row.setup, teardown=row.teardown,
            bytes=lion_bytes(n, dtype, row.momentum_dtype),
            baseline=ours_low if row.momentum_dtype == dtype else ours,
            peer="lion" if variant else None, peer_on_cpu=variant in ("plain", "foreach"),
        ))
    return Problem(
        "lion", dims, {}, None, ("param", "momentum"), None, impls,
        bytes=lion_bytes(n, dtype, torch.float32), copy_inputs=False,
        check=lambda impl: _lion_errors(impl.run, device, dtype, seed),
    )


def _reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `t`'s shape in `dtype` over the first bytes of `t`'s memory (a narrower dtype)."""
    return t.view(-1).view(dtype)[: t.numel()].view(t.shape)


def _ligertune_lion(params, grads, moments):
    from ligertune import kernels

    return lambda: kernels.lion_step(params, grads, moments, **LION_HYPERPARAMETERS)


def _foreach_lion(params, grads, moments):
    from ligertune.kernels import reference

    groups, size = [([], [], [])], 0
    for p, g, m in zip(params, grads, moments):
        if size and size + p.numel() > REFERENCE_GROUP_ELEMENTS:
            groups.append(([], [], []))
            size = 0
        for members, t in zip(groups[-1], (p, g, m)):
            members.append(t)
        size += p.numel()

    def step():
        for ps, gs, ms in groups:
            reference.lion_step(ps, gs, ms, **LION_HYPERPARAMETERS)

    return step


def _lion_pytorch(variant: str):
    """`make` for lion-pytorch's optimizer: parameters that share the tensors' memory, their
    gradients set, and its state seeded with the momenta (as it would create them, in the
    parameters' dtype, but with values)."""

    def make(params, grads, moments):
        if variant == "foreach":
            from lion_pytorch.foreach import Lion
        else:
            from lion_pytorch import Lion
        leaves = [torch.nn.Parameter(p) for p in params]  # same memory as `p`
        for leaf, g in zip(leaves, grads):
            leaf.grad = g
        hp = LION_HYPERPARAMETERS
        options = {"use_triton": True} if variant == "triton" else {}
        optimizer = Lion(leaves, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]),
                         weight_decay=hp["weight_decay"], **options)
        for leaf, m in zip(leaves, moments):
            optimizer.state[leaf]["exp_avg"] = m
        return optimizer.step

    return make


def _lion_errors(row: LionRow, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, float]:
    """The row's step on a fresh sample, against c = b1 m + (1 - b1) g,
    p' = p (1 - lr wd) - lr sign(c), m' = b2 m + (1 - b2) g computed in float64."""
    from ligertune.numerics import relative_error

    gen = _generator(device, seed + 1)
    params = [_randn(s, gen=gen, device=device, dtype=dtype, scale=0.02) for s in LION_PROBE_SHAPES]
    grads = [_randn(s, gen=gen, device=device, dtype=dtype, scale=1e-3) for s in LION_PROBE_SHAPES]
    moments = [_randn(s, gen=gen, device=device, dtype=row.momentum_dtype, scale=1e-3) for s in LION_PROBE_SHAPES]
    p, g, m = (torch.cat([t.double().reshape(-1) for t in ts]) for ts in (params, grads, moments))
    hp = LION_HYPERPARAMETERS
    c = hp["beta1"] * m + (1 - hp["beta1"]) * g
    want_p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * torch.sign(c)
    want_m = hp["beta2"] * m + (1 - hp["beta2"]) * g
    row.make(params, grads, moments)()
    got_p, got_m = (torch.cat([t.reshape(-1) for t in ts]) for ts in (params, moments))
    return {"param": relative_error(got_p, want_p), "momentum": relative_error(got_m, want_m)}


PROBLEMS = {
    "flce": flce_problem, "divergence": divergence_problem, "kl": kl_problem, "rms_norm": rms_norm_problem,
    "rope": rope_problem, "swiglu": swiglu_problem, "geglu": geglu_problem,
    "lion": lion_problem,
}
