"""What `ligertune bench step` measures: whole training steps of a recipe's model, kernels on and off.

Every variant's model is built by `ligertune.training.build`, the builder `ligertune train` uses:
the recipe's model (`model.config` with random weights, or a pretrained one) in its dtype, with its
gradient checkpointing, its LoRA adapters when the recipe has `lora` (the peers then run HF + peft)
and its base quantized when it has `model.quantization` (QLoRA: every variant alike, peers
included). A synthetic micro-batch of `train.micro_batch_size` conversations of `data.max_seq_len`
random tokens (`bench.synthetic`) then goes through whole training steps, for each of:

    ligertune       the trainer's own step: the model patched by the recipe's `kernels` flags, the
                    run around it from `build_run` (loss head, objective, optimizer, schedule,
                    gradient checkpointing with `auto`'s planner and activation offload), and each
                    step `training.step.train_step(run, [batch])`, what `ligertune train` runs
    HF (sdpa)       the plain `transformers` model, sdpa attention, in a plain step of its own: its
                    loss on the logits (`model(input_ids, labels=input_ids)`), backward, clipping
                    as `optim.clip` says, the recipe's optimizer
    HF + Liger      the same with Liger-Kernel applied to the instance, when importable
                    (before the LoRA adapters wrap it)

A preference recipe (`objective.name` dpo, ipo, simpo or orpo) is timed in pairs instead, against
TRL's `DPOTrainer` (`bench.preference`).

Then the realistic case: chat conversations of mixed lengths (`bench.synthetic`) through the
trainer's forward and backward (`training.step.forward_backward`), packed as the recipe packs
(varlen attention) against the same conversations in right-padded batches (`collate_padded`, the
attention mask of the model), each padded batch filled in data order up to the same token budget
B * L. Only forward + backward runs there (the count of optimizer steps is the recipe's choice,
the same for both layouts), and throughput counts real tokens only.

Warm-up steps are not timed; nor, under `gradient_checkpointing: auto`, the planner's first two
steps, on which the trainer makes its plan. Per row: median step time, tokens per second, peak
memory (CUDA: `max_memory_allocated` over the timed steps: weights, gradients, optimizer state and
activations) and MFU: the step's model flops (`ligertune.flops`) over the device's peak bf16 rate,
the data sheet's (989 TFLOP/s for the H100 SXM) and, as a second reading, that of a large bf16
matmul measured once on the device.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ligertune.bench.peers import NOT_INSTALLED, find_peer, versions
from ligertune.bench.results import StepReport, StepRow, describe_error
from ligertune.bench.synthetic import (
    padded_groups,
    synthetic_batch,
    synthetic_conversations,
    synthetic_ids,
    whole_micro_batches,
)
from ligertune.bench.timing import measure
from ligertune.devices import cap_device_memory, device_name, release_memory, resolve_dtype, synchronize
from ligertune.errors import UserError
from ligertune.flops import StepFlops, device_peak_tflops
from ligertune.recipe import Recipe

if TYPE_CHECKING:
    from ligertune.training import Run

LIGERTUNE = "ligertune"
HF = "HF (sdpa)"
HF_LIGER = "HF + Liger"
PACKED = "ligertune, packed chat"
PADDED = "ligertune, padded chat"

PLANNING_STEPS = 2
"""Under `gradient_checkpointing: auto`, the trainer's planner measures its first step and corrects
the plan on its second (`training.memory.CheckpointPlanner`): the bench runs both before timing."""


@dataclass
class StepBenchConfig:
    """How many steps, and what to run besides the synthetic ligertune-vs-HF rows."""

    steps: int = 5
    warmup: int = 2
    chat: bool = True
    peers: bool = True  # False: ligertune's rows only
    chat_micro_batches: int = 4
    peak_tflops: float | None = None
    device_memory_gib: float | None = None  # cap the CUDA allocator: run as a card of this size would
    measure_matmul: bool = True
    seed: int = 0
    # Preference recipes: the synthetic pairs (None: `bench.preference.pair_shape`'s defaults)
    pairs: int | None = None
    prompt_len: int | None = None
    answer_len: int | None = None
    length_spread: float | None = None  # each prompt's and answer's length drawn within this fraction
    epochs: int | None = None  # the run's epochs, over which the precomputed reference pass is spread


# --------------------------------------------------------------------------------------------------
# Entry point


def run_step_bench(
    recipe: Recipe,
    config: StepBenchConfig,
    *,
    recipe_name: str = "",
    log: Callable[[str], None] = lambda _: None,
) -> StepReport:
    """Time the recipe's training step with ligertune, plain HF and HF + Liger, then packed vs padded chat;
    a preference recipe's in pairs, with ligertune, TRL and TRL + Liger (`bench.preference`)."""
    bench = step_bench_for(recipe, config)
    device, report = new_report(recipe, config, recipe_name, log)
    bench(recipe, config, device, tokenizer_vocab(recipe), report, log).run(peers=config.peers)
    compare(report)
    return report


def step_bench_for(recipe: Recipe, config: StepBenchConfig) -> type[StepBench]:
    """The bench of the recipe's objective (`StepBench`, or `PreferenceStepBench` in pairs), its
    options checked."""
    from ligertune.bench.preference import PreferenceStepBench, check_pair_options

    if recipe.objective.name == "distill":
        raise UserError("objective.name: bench step times sft and preference steps; a distillation step is not "
                        "timed yet (`ligertune bench kernels` times its fused divergence)")
    check_pair_options(recipe, config)
    return PreferenceStepBench if recipe.objective.preference else StepBench


def new_report(recipe: Recipe, config: StepBenchConfig, recipe_name: str,
               log: Callable[[str], None]) -> tuple[torch.device, StepReport]:
    """The device (the trainer's, `build_device`) and an empty report for the recipe's step, with
    the peak rates."""
    from ligertune.training.build import build_device

    if config.steps < 1 or config.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    device = build_device(recipe.train)
    if config.device_memory_gib is not None:
        cap_device_memory(device, config.device_memory_gib)
    peak = config.peak_tflops
    if peak is None and device.type == "cuda":
        peak = device_peak_tflops(device)
    matmul = None
    if device.type == "cuda" and config.measure_matmul:
        log("measuring a bf16 matmul for the achievable peak")
        matmul = matmul_tflops(device)
    report = StepReport(
        recipe=recipe_name, model={}, device=device_name(device), device_type=device.type,
        dtype=str(resolve_dtype(recipe.model.dtype, device)).removeprefix("torch."),
        micro_batch_size=recipe.train.micro_batch_size, max_seq_len=recipe.data.max_seq_len,
        gradient_checkpointing=recipe.train.gradient_checkpointing, steps=config.steps, warmup=config.warmup,
        peak_tflops=peak, matmul_tflops=matmul, kernels="", note=None, versions=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    if config.device_memory_gib is not None:
        report.note = f"the device's memory capped at {config.device_memory_gib:g} GiB (--device-memory)"
    if device.type != "cuda":
        report.note = "cpu: no GPU; a tiny model's step says nothing of GPU speed (no peak memory, no MFU)"
    return device, report


def compare(report: StepReport) -> None:
    """Fill in each row's MFU and its speed-up: synthetic rows against ligertune's, chat rows
    against the packed one; synthetic rows first. A preference row's time includes its share of the
    reference pass (`StepRow.time_ms`), and its speed-up is in pairs/s."""
    peak, matmul = report.peak_tflops, report.matmul_tflops
    for row in report.rows:
        if row.tokens_per_s and row.flops is not None and row.step_ms:
            rate = row.flops / (row.time_ms * 1e-3) / 1e12
            row.mfu = rate / peak if peak else None
            row.mfu_measured = rate / matmul if matmul else None
    bases = {layout: next((r for r in report.rows if r.name == name and r.tokens_per_s), None)
             for layout, name in (("synthetic", LIGERTUNE), ("chat", PACKED))}
    for row in report.rows:
        base = bases.get(row.layout)
        if base is not None and base.pairs_per_s and row.pairs_per_s:
            row.vs_ligertune = base.pairs_per_s / row.pairs_per_s
        elif base is not None and row.tokens_per_s:
            row.vs_ligertune = base.tokens_per_s / row.tokens_per_s
    report.rows.sort(key=lambda r: r.layout != "synthetic")


def checkpointing_of(run: Run) -> str:
    """What the run's gradient checkpointing recomputes, as the `checkpointing` column says it:
    "off", "every layer[, offloaded]", or "auto: k of L layers" (what `auto` decided)."""
    from ligertune.models import decoder_of
    from ligertune.training.memory import CheckpointPlanner

    policy = run.checkpointing
    if isinstance(policy, CheckpointPlanner):
        plan = policy.plan  # made on the planning steps
        offloaded = ", offloaded" if plan.offload else ""
        return (f"auto: {plan.checkpointed} of {plan.layers} layers{offloaded} "
                f"(predicted {plan.predicted_peak_gib:.1f} GiB)")
    if policy is None:
        return "off"
    if run.recipe.train.gradient_checkpointing == "auto":  # no device memory to plan with (a CPU)
        return f"auto: {policy} of {len(decoder_of(run.model).layers)} layers"
    return "every layer, offloaded" if run.offload is not None else "every layer"


# --------------------------------------------------------------------------------------------------
# The variants


class StepBench:
    """Builds each variant of a recipe's step in turn (one model on the device at a time), times it
    and adds its rows to `report`."""

    def __init__(self, recipe: Recipe, config: StepBenchConfig, device: torch.device, vocab_size: int | None,
                 report: StepReport, log: Callable[[str], None]):
        self.recipe, self.config, self.device = recipe, config, device
        self.vocab_size, self.report, self.log = vocab_size, report, log

    def run(self, *, ligertune: bool = True, peers: bool = True) -> None:
        if ligertune:
            self._guarded(LIGERTUNE, "synthetic", self._ligertune)
        if peers:
            self._peers()

    def _peers(self) -> None:
        self._guarded(self._peer_name(HF), "synthetic", self._hf)
        peer = find_peer("liger")
        if not peer.available:
            status = "not installed" if peer.unavailable == NOT_INSTALLED else "failed"
            self.report.rows.append(
                StepRow(self._peer_name(HF_LIGER), "synthetic", status=status, detail=peer.unavailable)
            )
        elif self.device.type != "cuda":
            self.report.rows.append(
                StepRow(self._peer_name(HF_LIGER), "synthetic", status="skipped", detail="liger-kernel needs CUDA")
            )
        else:
            self._guarded(self._peer_name(HF_LIGER), "synthetic", self._hf_liger)

    def _guarded(self, name: str, layout: str, fn: Callable[[], list[StepRow]]) -> None:
        # What an earlier variant left allocated would count in this one's peak: say so when it is not 0.
        left = torch.cuda.memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        self.log(f"step: {name}" + (f" ({left:.2f} GiB left allocated before it)" if left >= 0.01 else ""))
        try:
            self.report.rows.extend(fn())
        except UserError:
            raise
        except Exception as err:  # one broken variant must not hide the others
            self.report.rows.append(StepRow(name, layout, status="failed", detail=describe_error(err)))
        finally:
            release_memory(self.device)

    def _model(self, *, attention: str | None = None, kernels: bool = False, before_adapters=None):
        """The recipe's model as `ligertune train` builds it (LoRA included), in training mode; a peer's
        (`kernels=False`) with every matmul in `model.dtype` (`train.precision: fp8` is ligertune's)."""
        from ligertune.models import unwrap_model
        from ligertune.training.build import build_model

        recipe = self.recipe if kernels else self.recipe.in_model_dtype()
        built = build_model(recipe, device=self.device, vocab_size=self.vocab_size, attention=attention,
                            kernels=kernels, before_adapters=before_adapters)
        model = built.module
        model.train()
        unwrap_model(model).config.use_cache = False
        if not self.report.model:
            self.report.model = model_summary(unwrap_model(model))
        return built

    def _synthetic_ids(self) -> torch.Tensor:
        return synthetic_ids(self.recipe, self.report.model["vocab_size"], self.config.seed)

    # ---- ligertune: the trainer's step

    def _ligertune(self) -> list[StepRow]:
        from ligertune.models import unpatch_model
        from ligertune.training.build import build_run, describe_float8
        from ligertune.training.memory import CheckpointPlanner
        from ligertune.training.step import train_step

        built = self._model(kernels=True)
        model = built.module
        try:
            cfg = self.config
            run = build_run(self.recipe, model, device=self.device,
                            total_steps=PLANNING_STEPS + cfg.warmup + cfg.steps)  # the most the row takes
            fused = "on" if run.head.fused else "off"
            self.report.kernels = f"{built.patches.describe()}; fused loss: {fused}"
            if self.recipe.train.precision == "fp8":
                self.report.kernels += f"; fp8: {describe_float8(self.recipe, model)}"
            ids = self._synthetic_ids()
            batch = synthetic_batch(ids, self.recipe.model.attention).to(self.device)
            if isinstance(run.checkpointing, CheckpointPlanner):
                for _ in range(PLANNING_STEPS):
                    if news := train_step(run, [batch]).news:
                        self.log(news)
            row = self._time(LIGERTUNE, "synthetic", [lambda: train_step(run, [batch])], ids.numel(),
                             [ids.shape[1]] * ids.shape[0], model)
            row.checkpointing = checkpointing_of(run)
            rows = [row]
            if cfg.chat:
                rows.extend(self._chat(run))
            return rows
        finally:
            unpatch_model(model)

    def _chat(self, run: Run) -> list[StepRow]:
        """Packed vs padded micro-batches of the same synthetic conversations, each through the
        trainer's forward and backward (its gradients then dropped)."""
        from ligertune.data import collate, collate_padded
        from ligertune.training.step import forward_backward

        b, seq_len = self.recipe.train.micro_batch_size, self.recipe.data.max_seq_len
        examples = synthetic_conversations(
            self.config.chat_micro_batches * b * seq_len, seq_len, self.report.model["vocab_size"],
            self.config.seed,
        )
        examples, packs = whole_micro_batches(examples, self.recipe.data, b)
        lengths = [len(e) for e in examples]
        packed = [collate(packs[i : i + b]).to(self.device) for i in range(0, len(packs), b)]
        padded = [collate_padded([examples[i] for i in group], pad_id=0).to(self.device)
                  for group in padded_groups(lengths, b * seq_len)]

        def micro_batch(batch) -> Callable[[], None]:
            def step() -> None:
                forward_backward(run, [batch], backward=True)
                run.model.zero_grad(set_to_none=True)
            return step

        n_real = sum(lengths)
        rows = []
        for name, batches in ((PACKED, packed), (PADDED, padded)):
            self.log(f"step: {name} ({len(batches)} micro-batches, {n_real} real tokens)")
            try:
                rows.append(self._time(name, "chat", [micro_batch(x) for x in batches], n_real, lengths,
                                       run.model, per_pass=True))
            except Exception as err:  # the other layout still runs
                rows.append(StepRow(name, "chat", status="failed", detail=describe_error(err)))
            finally:
                run.model.zero_grad(set_to_none=True)
                release_memory(self.device)
        return rows

    # ---- the peers: a plain step of their own

    def _hf(self) -> list[StepRow]:
        model = self._model(attention="sdpa").module
        return [self._time_peer(self._peer_name(HF), model)]

    def _hf_liger(self) -> list[StepRow]:
        import liger_kernel.transformers as liger

        with contextlib.ExitStack() as restore:

            def apply_liger(model) -> None:
                # Liger also rebinds names in the model's modeling module (RoPE, norm and MLP
                # classes), for every later model of that family: put them back afterwards.
                restore.enter_context(_restored_module(type(model).__module__))
                liger._apply_liger_kernel_to_instance(model=model)

            model = self._model(attention="sdpa", before_adapters=apply_liger).module
            return [self._time_peer(self._peer_name(HF_LIGER), model)]

    def _peer_name(self, name: str) -> str:
        """A peer's row name, with `+ peft` when the recipe trains LoRA adapters."""
        return f"{name} + peft" if self.recipe.lora is not None else name

    def _time_peer(self, name: str, model) -> StepRow:
        """The model's own loss, backward, clipping as `optim.clip` says (torch's `clip_grad_norm_`
        for `global`; per tensor, one foreach norm and scale), the recipe's optimizer."""
        from ligertune.training.build import build_optimizer
        from ligertune.training.clipping import clip_gradients

        optim = self.recipe.optim
        optimizer = build_optimizer(model, optim)
        params = [p for p in model.parameters() if p.requires_grad]
        ids = self._synthetic_ids().to(self.device)

        def step() -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            if optim.max_grad_norm:
                clip_gradients(params, optim.max_grad_norm, optim.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        row = self._time(name, "synthetic", [step], ids.numel(), [ids.shape[1]] * ids.shape[0], model)
        row.checkpointing = "every layer" if self.recipe.train.gradient_checkpointing else "off"
        return row

    # ---- timing

    def _time(self, name: str, layout: str, steps: list[Callable[[], Any]], tokens: int, seq_lens: list[int],
              model, *, per_pass: bool = False, flops: float | None = None) -> StepRow:
        """Time `steps` (callables): `warmup` untimed passes, then `steps` timed ones.

        per_pass=False: each timed step is one call of the single callable; per_pass=True: each
        timed unit is one pass over all callables (the chat micro-batches), and warm-up runs every
        one of them once, so that every shape has been compiled before timing. `flops`, when given,
        replaces the model flops of `tokens` in sequences of `seq_lens`.
        """
        cfg = self.config
        for _ in range(1 if per_pass else cfg.warmup):
            for step in steps:
                step()
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        times = []
        for _ in range(cfg.steps):
            start = time.perf_counter()
            for step in steps:
                step()
            synchronize(self.device)
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved(self.device) / 2**30 if cuda else None
        return StepRow(
            name, layout, steps=cfg.steps * (len(steps) if per_pass else 1), tokens=tokens, step_ms=ms,
            tokens_per_s=tokens / (ms * 1e-3), peak_mem_gib=peak, peak_reserved_gib=reserved,
            flops=flops if flops is not None else StepFlops.of(model)(tokens, sum(n * n for n in seq_lens)),
        )


# --------------------------------------------------------------------------------------------------
# Model and device facts


def model_summary(model) -> dict[str, Any]:
    from ligertune.models.quantize import parameter_count, quantization_of

    cfg, flops = model.config, StepFlops.of(model)
    return {
        "type": type(model).__name__,
        "params": parameter_count(model),  # a quantized weight as the matrix it stands for
        "quantization": quantization_of(model),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "matmul_params": flops.matmul_params,
        "trained_matmul_params": flops.trained_matmul_params,
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "layers": flops.layers,
        "heads": flops.heads,
        "head_dim": flops.head_dim,
    }


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 TFLOP/s of an n x n x n matmul on random data (median of 10 after 3 warm-ups)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    timing = measure(lambda: torch.mm(a, b, out=out), device=device, warmup=3, repeats=10, memory=False)
    return 2.0 * n**3 / (timing.median_ms * 1e-3) / 1e12


def tokenizer_vocab(recipe: Recipe) -> int | None:
    """The tokenizer's size when the model's config does not give a vocabulary (a `tiny-*` preset)."""
    from ligertune.models import PRESETS

    spec = recipe.model.config
    fields = PRESETS.get(spec, {}) if isinstance(spec, str) else (spec or {})
    if spec is None or "vocab_size" in fields:
        return None
    from ligertune.models import load_tokenizer

    return len(load_tokenizer(recipe.model))


@contextlib.contextmanager
def _restored_module(name: str) -> Iterator[None]:
    """Put a module's globals back as they were on exit (names rebound by a monkey patch)."""
    module = importlib.import_module(name)
    saved = dict(vars(module))
    try:
        yield
    finally:
        current = vars(module)
        for key in [k for k in current if k not in saved]:
            del current[key]
        for key, value in saved.items():
            if current.get(key) is not value:
                setattr(module, key, value)
