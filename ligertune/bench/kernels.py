"""What `ligertune bench kernels` measures: each kernel forward + backward, against its peers.

For every kernel and shape, one set of inputs is drawn and every implementation runs on those same
inputs, in one process, one after the other:

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
three bare GEMMs of any linear + cross-entropy (h @ W.T, dlogits @ W, dlogits.T @ h).

Per row: median ms of forward + backward (`timing.measure`), throughput, extra peak memory, the
speed-up of ligertune over the row (row ms / ligertune ms: 1.5 means ligertune takes 1/1.5 of the
row's time), and the relative error ||a - b|| / ||b|| of every output and gradient against
`ligertune.kernels.reference` run on the same inputs cast to float32 (float64 on a CPU).

Throughput counts nominal work, the same for every row of a shape:

    fused loss:      6 N H V flops (forward logits 2NHV, the two backward products 4NHV), ignored
                     rows included: an implementation that skips them shows a higher rate
    rms_norm:        bytes of x, w, y (forward) + dy, x, w, dx, dw (backward)
    swiglu:          bytes of gate, up, y (forward) + dy, gate, up, dgate, dup (backward)
    rope:            bytes of q, k, cos, sin, q', k' (forward) + the same count backward
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ligertune.bench.peers import NOT_INSTALLED, Peer, find_peer
from ligertune.bench.timing import Timing, measure, synchronize
from ligertune.errors import UserError

KERNELS = ("flce", "rms_norm", "rope", "swiglu")

SHAPE_DIMS = {
    "flce": ("N", "H", "V"),
    "rms_norm": ("T", "H"),
    "rope": ("B", "L", "Hq", "Hk", "D"),
    "swiglu": ("T", "I"),
}
"""Names of each kernel's dimensions, in the order `--shapes` gives them."""

GPU_SHAPES = {
    # Llama-3-8B, a 2k-hidden model at twice the tokens, Qwen2.5-7B: tokens x hidden x vocabulary.
    "flce": [(8192, 4096, 128256), (16384, 2048, 128256), (4096, 3584, 152064)],
    # 4 x 4096 tokens of a Llama-3-8B layer.
    "rms_norm": [(16384, 4096)],
    "rope": [(4, 4096, 32, 8, 128)],
    "swiglu": [(16384, 14336)],
}
CPU_SHAPES = {
    # Odd sizes on purpose: no implementation may lean on powers of two.
    "flce": [(257, 192, 4099)],
    "rms_norm": [(1031, 768)],
    "rope": [(2, 255, 8, 2, 64)],
    "swiglu": [(1031, 1376)],
}

IGNORED_FRACTION = 0.1
"""Share of targets set to ignore_index, as prompt tokens of chat data would be (on the low side)."""

LOW_MEMORY_CHUNK_BYTES = 120 * 2**20
"""The low-memory setting: a logits buffer that keeps the loss's extra memory under 128 MiB."""
Z_LOSS_WEIGHT = 1e-4
LABEL_SMOOTHING = 0.1
RMS_EPS = 1e-6
LIGERTUNE = "ligertune"
FLOOR = "3 GEMMs (floor)"


# --------------------------------------------------------------------------------------------------
# Configuration and results


@dataclass
class KernelBenchConfig:
    """What to run: kernels, shapes (None: the defaults of the device), dtype, repeats."""

    kernels: tuple[str, ...] = KERNELS
    shapes: dict[str, list[tuple[int, ...]]] | None = None
    device: str = "auto"
    dtype: str | None = None
    repeats: int | None = None
    warmup: int | None = None
    compile: bool | None = None
    flush_l2: bool = False
    seed: int = 0


@dataclass
class KernelRow:
    """One implementation of one kernel at one shape."""

    kernel: str
    shape: str
    dims: dict[str, int]
    impl: str
    status: str  # "ok", "not installed", "skipped", "failed"
    detail: str | None = None
    timing: Timing | None = None
    tflops: float | None = None
    gbps: float | None = None
    vs_ligertune: float | None = None
    errors: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "kernel": self.kernel,
            "shape": self.shape,
            "dims": self.dims,
            "impl": self.impl,
            "status": self.status,
            "detail": self.detail,
            "median_ms": None,
            "min_ms": None,
            "max_ms": None,
            "repeats": None,
            "extra_peak_mib": None,
            "tflops": self.tflops,
            "gbps": self.gbps,
            "vs_ligertune": self.vs_ligertune,
            "errors": self.errors,
        }
        if self.timing is not None:
            t = self.timing.to_dict()
            out.update({k: t[k] for k in ("median_ms", "min_ms", "max_ms", "repeats", "extra_peak_mib")})
        return out


@dataclass
class KernelReport:
    """Every row, with what a reader needs to trust them: device, dtype, path, versions, date."""

    device: str
    device_type: str
    kernel_path: str
    dtype: str
    reference_dtype: str
    repeats: int
    warmup: int
    note: str | None
    versions: dict[str, str | None]
    date: str
    rows: list[KernelRow]

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        data["rows"] = [row.to_dict() for row in self.rows]
        return data


# --------------------------------------------------------------------------------------------------
# Shapes


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`flce:8192x4096x128256` -> ("flce", (8192, 4096, 128256)); `UserError` for anything else."""
    kernel, sep, dims = text.partition(":")
    kernel = kernel.strip().replace("-", "_")
    if not sep or kernel not in SHAPE_DIMS:
        raise UserError(
            f"--shapes {text!r}: expected KERNEL:AxBx..., KERNEL one of {', '.join(KERNELS)} "
            f"(e.g. flce:8192x4096x128256)"
        )
    names = SHAPE_DIMS[kernel]
    parts = [p for p in re.split(r"[x,]", dims.strip()) if p]
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--shapes {text!r}: {kernel} takes {'x'.join(names)}, positive integers")
    values = tuple(int(p) for p in parts)
    if kernel == "rope" and values[4] % 2:
        raise UserError(f"--shapes {text!r}: the rope head dimension D must be even")
    if kernel == "rope" and values[2] % values[3]:
        raise UserError(f"--shapes {text!r}: Hq must be a multiple of Hk (grouped-query attention)")
    return kernel, values


def shape_label(kernel: str, values: tuple[int, ...]) -> str:
    return "-".join(f"{n}{v}" for n, v in zip(SHAPE_DIMS[kernel], values))


# --------------------------------------------------------------------------------------------------
# Problems: inputs and the implementations that run on them


@dataclass
class Impl:
    """One row: `run(inputs)` returns the outputs whose (sum with upstream gradients) is backpropagated.

    semantics: the reference the row is checked against ("plain" or "options").
    manual: `run` does all its work itself (the GEMM floor): no backward, no error.
    """

    name: str
    run: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]] | None
    peer: str | None = None
    compiled: bool = False
    semantics: str = "plain"
    manual: bool = False


@dataclass
class Problem:
    """One kernel at one shape: leaf inputs, upstream gradients, names of what is compared, work counts."""

    kernel: str
    dims: dict[str, int]
    inputs: dict[str, torch.Tensor]
    grad_outputs: tuple[torch.Tensor, ...] | None  # None: the single output is a scalar loss
    output_names: tuple[str, ...]
    reference: Callable[[dict[str, torch.Tensor], str], tuple[torch.Tensor, ...]]
    impls: list[Impl]
    flops: float | None = None
    bytes: float | None = None

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
    from ligertune.kernels import reference

    path = kernels.active_path(device)

    def ours(x, **options):
        return (kernels.fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **options).loss,)

    options = dict(z_loss_weight=Z_LOSS_WEIGHT, label_smoothing=LABEL_SMOOTHING, reduction="sum")

    def ours_options(x):
        return ours(x, token_weights=x["token_weights"], **options)

    def ref(x, semantics):
        extra = dict(token_weights=x["token_weights"], **options) if semantics == "options" else {}
        return (reference.fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **extra).loss,)

    def liger(x):
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return (LigerFusedLinearCrossEntropyLoss()(x["weight"], x["hidden"], x["targets"]),)

    def cce(x, **kwargs):
        from cut_cross_entropy import linear_cross_entropy

        return (linear_cross_entropy(x["hidden"], x["weight"], x["targets"], **kwargs),)

    def eager(x):
        return (_eager_flce(x["hidden"], x["weight"], x["targets"]),)

    floor = _GemmFloor(n, h, v, device, dtype, gen)
    impls = [
        Impl(f"{LIGERTUNE} ({path})", ours),
        Impl(f"{LIGERTUNE} +options", ours_options, semantics="options"),
        Impl(f"{LIGERTUNE} low-mem ({LOW_MEMORY_CHUNK_BYTES >> 20} MiB chunks)",
             lambda x: ours(x, chunk_bytes=LOW_MEMORY_CHUNK_BYTES)),
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


class _GemmFloor:
    """The three products of any linear + cross-entropy, into preallocated outputs, without autograd:
    logits = h @ W.T, grad_h = dlogits @ W, grad_W = dlogits.T @ h. Buffers are allocated by the
    first (warm-up) call, so that they count neither in the time nor in the extra memory."""

    def __init__(self, n: int, h: int, v: int, device: torch.device, dtype: torch.dtype,
                 gen: torch.Generator):
        self.shapes = {"logits": (n, v), "dlogits": (n, v), "grad_h": (n, h), "grad_w": (v, h)}
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
        hidden, weight = x["hidden"].detach(), x["weight"].detach()
        torch.mm(hidden, weight.t(), out=b["logits"])
        torch.mm(b["dlogits"], weight, out=b["grad_h"])
        torch.mm(b["dlogits"].t(), hidden, out=b["grad_w"])
        return ()

    def release(self) -> None:
        self.buffers = {}


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


def swiglu_problem(dims: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    t, i = dims["T"], dims["I"]
    gen = _generator(device, seed)
    gate = _randn((t, i), gen=gen, device=device, dtype=dtype, grad=True)
    up = _randn((t, i), gen=gen, device=device, dtype=dtype, grad=True)
    dy = _randn((t, i), gen=gen, device=device, dtype=dtype)

    from ligertune import kernels
    from ligertune.kernels import reference

    def liger(z):
        from liger_kernel.transformers.functional import liger_swiglu

        return (liger_swiglu(z["gate"], z["up"]),)

    impls = [
        Impl(f"{LIGERTUNE} ({kernels.active_path(device)})", lambda z: (kernels.swiglu(z["gate"], z["up"]),)),
        Impl("torch eager", lambda z: (F.silu(z["gate"]) * z["up"],)),
        Impl("torch.compile", lambda z: (F.silu(z["gate"]) * z["up"],), compiled=True),
        Impl("liger", liger, peer="liger"),
    ]
    return Problem(
        "swiglu", dims, {"gate": gate, "up": up}, (dy,), ("y", "grad_gate", "grad_up"),
        lambda z, _: (reference.swiglu(z["gate"], z["up"]),), impls, bytes=8 * t * i * gate.element_size(),
    )


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


PROBLEMS = {
    "flce": flce_problem, "rms_norm": rms_norm_problem, "rope": rope_problem, "swiglu": swiglu_problem,
}


# --------------------------------------------------------------------------------------------------
# Running


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda; got {name!r}")
    return torch.device(name)


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"--dtype must be one of bfloat16, float16, float32; got {name!r}")
    return DTYPES[name]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def path_note(device: torch.device) -> str | None:
    """The line shown above the tables off CUDA: which path ran and what the numbers are worth."""
    if device.type == "cuda":
        return None
    from ligertune.kernels import active_path

    path = active_path(device)
    if path == "triton":
        interp = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        how = ("in the Triton interpreter (TRITON_INTERPRET=1)" if interp
               else "without TRITON_INTERPRET=1 (expect failures)")
        return (f"cpu: no GPU; ligertune runs its Triton kernels {how}, small shapes; "
                "timings say nothing of GPU speed")
    return ("cpu: no GPU; ligertune runs its pure-torch reference path (LIGERTUNE_KERNELS=triton with "
            "TRITON_INTERPRET=1 runs the Triton kernels in the interpreter), small shapes; timings say "
            "nothing of GPU speed")


def run_kernel_bench(config: KernelBenchConfig, log: Callable[[str], None] = lambda _: None) -> KernelReport:
    """Run every requested kernel at every shape; one `KernelRow` per implementation."""
    import datetime

    from ligertune.bench.peers import versions
    from ligertune.kernels import active_path

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    try:
        active_path(device)
    except ValueError as err:  # a bad LIGERTUNE_KERNELS value is the user's to fix
        raise UserError(str(err)) from None
    on_cuda = device.type == "cuda"
    ref_dtype = torch.float32 if on_cuda else torch.float64
    repeats = config.repeats or (10 if on_cuda else 3)
    warmup = config.warmup if config.warmup is not None else (2 if on_cuda else 1)
    use_compile = on_cuda if config.compile is None else config.compile
    defaults = GPU_SHAPES if on_cuda else CPU_SHAPES
    unknown = [k for k in config.kernels if k not in KERNELS]
    if unknown:
        raise UserError(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")

    peers = {key: find_peer(key) for key in ("liger", "cce")}
    rows: list[KernelRow] = []
    for kernel in config.kernels:
        shapes = (config.shapes or {}).get(kernel) or defaults[kernel]
        for values in shapes:
            dims = dict(zip(SHAPE_DIMS[kernel], values))
            label = shape_label(kernel, values)
            log(f"{kernel} {label}: drawing inputs")
            problem = PROBLEMS[kernel](dims, device, dtype, config.seed)
            rows.extend(_run_problem(problem, label, peers, device, ref_dtype, repeats, warmup,
                                     use_compile, config.flush_l2, log))
            del problem
            _release(device)

    return KernelReport(
        device=device_name(device),
        device_type=device.type,
        kernel_path=active_path(device),
        dtype=str(dtype).removeprefix("torch."),
        reference_dtype=str(ref_dtype).removeprefix("torch."),
        repeats=repeats,
        warmup=warmup,
        note=path_note(device),
        versions=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rows=rows,
    )


def _run_problem(problem, label, peers, device, ref_dtype, repeats, warmup, use_compile, flush_l2, log):
    references: dict[str, tuple[torch.Tensor, ...]] = {}
    rows = []
    base_ms = None
    for index, impl in enumerate(problem.impls):
        row = KernelRow(problem.kernel, label, problem.dims, impl.name, "ok")
        rows.append(row)
        skip = _skip_reason(impl, peers, device, use_compile)
        if skip:
            row.status, row.detail = skip
            continue
        log(f"{problem.kernel} {label}: {impl.name}")
        run = impl.run
        try:
            if impl.compiled:
                run = torch.compile(impl.run, dynamic=False)
            # Every row gets its own copy of the inputs, and the error check another one: some
            # implementations write into their inputs or into the upstream gradient (in place), which
            # must reach neither the next row nor the comparison with the reference.
            work = _fresh_copy(problem)
            row.timing = measure(
                _step(work, run, impl.manual), device=device, warmup=warmup, repeats=repeats,
                flush_l2=flush_l2, before_each=lambda: _drop_grads(work),
            )
            del work
            if not impl.manual:
                if impl.semantics not in references:
                    references[impl.semantics] = _reference_results(problem, impl.semantics, ref_dtype)
                row.errors = _errors(_fresh_copy(problem), run, references[impl.semantics])
        except Exception as err:  # one broken row must not hide the others
            row.status = "failed"
            row.detail = describe_error(err)
            row.timing = None
        finally:
            if isinstance(impl.run, _GemmFloor):
                impl.run.release()
            if impl.compiled:
                _reset_compile()
            _release(device)
        if row.timing is None:
            continue
        ms = row.timing.median_ms
        if problem.flops:
            row.tflops = problem.flops / (ms * 1e-3) / 1e12
        if problem.bytes:
            row.gbps = problem.bytes / (ms * 1e-3) / 1e9
        if index == 0:  # the first row is ligertune's default: the one the others are compared with
            base_ms = ms
        if base_ms is not None:
            row.vs_ligertune = ms / base_ms
    return rows


def _skip_reason(impl: Impl, peers: dict[str, Peer], device: torch.device, use_compile: bool):
    if impl.peer is not None:
        peer = peers[impl.peer]
        if not peer.available:
            return ("not installed" if peer.unavailable == NOT_INSTALLED else "failed"), peer.unavailable
        if device.type != "cuda":
            return "skipped", f"{peer.distribution} needs CUDA"
    if impl.compiled and not use_compile:
        return "skipped", "torch.compile is off (--compile to run it)"
    return None


def _step(problem: Problem, run, manual: bool) -> Callable[[], None]:
    """Forward and backward once; gradients land in the leaves' `.grad`."""

    def step():
        outputs = run(problem.inputs)
        if manual:
            return
        if problem.grad_outputs is None:
            outputs[0].backward()
        else:
            torch.autograd.backward(outputs, problem.grad_outputs)

    return step


def _fresh_copy(problem: Problem) -> Problem:
    """The problem with its own copies of the inputs (leaves again) and of the upstream gradients."""
    inputs = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in problem.inputs.items()}
    grad_outputs = None if problem.grad_outputs is None else tuple(g.clone() for g in problem.grad_outputs)
    return dataclasses.replace(problem, inputs=inputs, grad_outputs=grad_outputs)


def _drop_grads(problem: Problem) -> None:
    for _, t in problem.leaves:
        t.grad = None


def _results(run, inputs: dict[str, torch.Tensor], grad_outputs) -> tuple[torch.Tensor, ...]:
    """(outputs..., gradient of every leaf) of one forward + backward on `inputs`."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    for t in leaves:  # a timed call before may have left its gradients, which backward would add to
        t.grad = None
    outputs = run(inputs)
    if grad_outputs is None:
        outputs[0].backward()
    else:
        # A fresh copy: some implementations write their input gradient into the upstream one.
        torch.autograd.backward(outputs, [g.clone() for g in grad_outputs])
    grads = tuple(t.grad for t in leaves)
    for t in leaves:
        t.grad = None
    return tuple(o.detach() for o in outputs) + grads


def _reference_results(problem: Problem, semantics: str, ref_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    def upcast(name: str, t: torch.Tensor) -> torch.Tensor:
        # Token weights keep float32, as the kernels take them; integer targets stay integers.
        if not t.is_floating_point() or name == "token_weights":
            return t
        return t.detach().to(ref_dtype).requires_grad_(t.requires_grad)

    inputs = {name: upcast(name, t) for name, t in problem.inputs.items()}
    grad_outputs = None
    if problem.grad_outputs is not None:
        grad_outputs = tuple(g.to(ref_dtype) for g in problem.grad_outputs)
    return _results(lambda x: problem.reference(x, semantics), inputs, grad_outputs)


def _errors(problem: Problem, run, reference: tuple[torch.Tensor, ...]) -> dict[str, float]:
    got = _results(run, problem.inputs, problem.grad_outputs)
    return {name: relative_error(a, b) for name, a, b in zip(problem.output_names, got, reference)}


def relative_error(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 24) -> float:
    """||a - b|| / ||b|| over whole tensors, accumulated in float64 a chunk at a time (bounded memory).

    NaN when `a` holds a NaN or an infinity (a broken result must not pass as a small error); 0 when
    both are zero; infinity when only `b` is.
    """
    if a is None or b is None:
        return math.nan
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.numel() != b.numel():
        raise ValueError(f"cannot compare {a.numel()} elements with {b.numel()}")
    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    for start in range(0, b.numel(), chunk):
        a_c = a[start : start + chunk].to(b.device, torch.float64)
        b_c = b[start : start + chunk].to(torch.float64)
        num += (a_c - b_c).square().sum()
        den += b_c.square().sum()
    num, den = num.item(), den.item()
    if not math.isfinite(num):
        return math.nan
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def describe_error(err: BaseException) -> str:
    """One line for a row that failed: the exception's type and first line ("out of memory" for OOM)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return "out of memory"
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}"[:300]


def _reset_compile() -> None:
    try:
        torch._dynamo.reset()
    except Exception:  # resetting is tidiness, never a reason to fail
        pass


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
