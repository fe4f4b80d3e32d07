"""What `ligertune bench step` measures: whole training steps of a recipe's model, kernels on and off.

Every variant's model is built by `ligertune.training.build`, the builder `ligertune train` uses:
the recipe's model (`model.config` with random weights, or a pretrained one) in its dtype, with its
gradient checkpointing, its LoRA adapters when the recipe has `lora` (the peers then run HF + peft),
its base quantized when it has `model.quantization` (QLoRA: every variant alike, peers included),
and its AdamW (fused on CUDA). A synthetic batch of `train.micro_batch_size` rows of
`data.max_seq_len` random tokens then goes through one training step (forward, backward, gradient
clipping when `optim.max_grad_norm` is set, optimizer step), for each of:

    ligertune       patched by the recipe's `kernels` flags, loss through `CausalLMLoss` (fused
                    linear cross-entropy), packed attention; the batch laid out as `collate` lays
                    out packs (one [1, B * L] row, each sequence kept apart by cu_seqlens; being
                    of one length, they go through SDPA as rows)
    HF (sdpa)       the plain `transformers` model, sdpa attention, its own loss on the logits
                    (`model(input_ids, labels=input_ids)`)
    HF + Liger      the same with Liger-Kernel applied to the instance, when importable
                    (before the LoRA adapters wrap it)

Then the realistic case: chat conversations of mixed lengths (drawn at random, 20-60% of each
masked as prompt) with ligertune, packed best-fit (`pack` + `collate`, varlen attention) against
the same conversations in right-padded batches (`collate_padded`, the attention mask of the model),
each padded batch filled in data order up to the same token budget B * L. Only forward + backward
runs there (the count of optimizer steps is the recipe's choice, the same for both layouts), and
throughput counts real tokens only.

Warm-up steps are not timed. Per row: median step time, tokens per second, peak memory (CUDA:
`max_memory_allocated` over the timed steps: weights, gradients, optimizer state and activations)
and MFU: the step's model flops (`ligertune.flops`: 6 flops per token and weight for full
fine-tuning, 4 for a frozen weight, plus causal attention within each sequence; recomputation under
gradient checkpointing not counted) over the device's peak bf16 rate. The
peak is the data-sheet dense bf16 rate of known GPUs (989 TFLOP/s for the H100 SXM) and, as a
second reading, the rate of a large bf16 matmul measured once on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ligertune.bench.peers import NOT_INSTALLED, find_peer, versions
from ligertune.bench.results import describe_error
from ligertune.bench.timing import measure
from ligertune.devices import device_name, release_memory, resolve_device, resolve_dtype, synchronize
from ligertune.errors import UserError
from ligertune.flops import StepFlops, device_peak_tflops
from ligertune.recipe import Recipe
from ligertune.training.loss_weights import step_token_weights

LIGERTUNE = "ligertune"
HF = "HF (sdpa)"
HF_LIGER = "HF + Liger"
PACKED = "ligertune, packed chat"
PADDED = "ligertune, padded chat"


@dataclass
class StepBenchConfig:
    """How many steps, and what to run besides the synthetic ligertune-vs-HF rows."""

    steps: int = 5
    warmup: int = 2
    chat: bool = True
    peers: bool = True  # False: ligertune's rows only
    chat_micro_batches: int = 4
    peak_tflops: float | None = None
    measure_matmul: bool = True
    seed: int = 0


@dataclass
class StepRow:
    """One way of running the step; `tokens` are real (non-pad) tokens per timed pass."""

    name: str
    layout: str
    status: str = "ok"
    detail: str | None = None
    steps: int = 0
    tokens: int = 0
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gib: float | None = None
    flops: float | None = None
    mfu: float | None = None
    mfu_measured: float | None = None
    vs_ligertune: float | None = None
    checkpointing: str | None = None  # "off", "every layer", "auto: k of L layers"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepReport:
    recipe: str
    model: dict[str, Any]
    device: str
    device_type: str
    dtype: str
    micro_batch_size: int
    max_seq_len: int
    gradient_checkpointing: bool
    steps: int
    warmup: int
    peak_tflops: float | None
    matmul_tflops: float | None
    kernels: str
    note: str | None
    versions: dict[str, str | None]
    date: str
    rows: list[StepRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        data["rows"] = [row.to_dict() for row in self.rows]
        return data


# --------------------------------------------------------------------------------------------------
# Entry point


def run_step_bench(
    recipe: Recipe,
    config: StepBenchConfig,
    *,
    recipe_name: str = "",
    log: Callable[[str], None] = lambda _: None,
) -> StepReport:
    """Time the recipe's training step with ligertune, plain HF and HF + Liger, then packed vs padded chat."""
    device, dtype, report = _new_report(recipe, config, recipe_name, log)
    _StepBench(recipe, config, device, dtype, _tokenizer_vocab(recipe), report, log).run(peers=config.peers)
    _compare(report)
    packed = next((r for r in report.rows if r.name == PACKED and r.tokens_per_s), None)
    if packed is not None:
        for row in report.rows:
            if row.layout == "chat" and row.tokens_per_s:
                row.vs_ligertune = packed.tokens_per_s / row.tokens_per_s
    return report


def _new_report(recipe: Recipe, config: StepBenchConfig, recipe_name: str,
                log: Callable[[str], None]) -> tuple[torch.device, torch.dtype, StepReport]:
    """The device, the dtype and an empty report for the recipe's step, with the peak rates."""
    import datetime

    if config.steps < 1 or config.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    device = resolve_device(recipe.train.device)
    dtype = resolve_dtype(recipe.model.dtype, device)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    peak = config.peak_tflops
    if peak is None and device.type == "cuda":
        peak = device_peak_tflops(device)
    matmul = None
    if device.type == "cuda" and config.measure_matmul:
        log("measuring a bf16 matmul for the achievable peak")
        matmul = matmul_tflops(device)
    report = StepReport(
        recipe=recipe_name, model={}, device=device_name(device), device_type=device.type,
        dtype=str(dtype).removeprefix("torch."), micro_batch_size=recipe.train.micro_batch_size,
        max_seq_len=recipe.data.max_seq_len, gradient_checkpointing=recipe.train.gradient_checkpointing,
        steps=config.steps, warmup=config.warmup, peak_tflops=peak, matmul_tflops=matmul, kernels="",
        note=None, versions=versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    if device.type != "cuda":
        report.note = "cpu: no GPU; a tiny model's step says nothing of GPU speed (no peak memory, no MFU)"
    return device, dtype, report


def _compare(report: StepReport) -> None:
    """Fill in each row's MFU and its speed against ligertune's synthetic row; synthetic rows first."""
    peak, matmul = report.peak_tflops, report.matmul_tflops
    base = next((r for r in report.rows if r.name == LIGERTUNE and r.tokens_per_s), None)
    for row in report.rows:
        if row.tokens_per_s and row.flops is not None and row.step_ms:
            rate = row.flops / (row.step_ms * 1e-3) / 1e12
            row.mfu = rate / peak if peak else None
            row.mfu_measured = rate / matmul if matmul else None
        if base is not None and row.tokens_per_s and row.layout == "synthetic":
            row.vs_ligertune = base.tokens_per_s / row.tokens_per_s
    report.rows.sort(key=lambda r: r.layout != "synthetic")


# --------------------------------------------------------------------------------------------------
# Under memory caps


@dataclass
class CapChoice:
    """What one variant runs at under one memory cap: its fastest setting that fits."""

    cap_gib: float
    name: str
    checkpointing: str | None
    tokens_per_s: float | None
    peak_mem_gib: float | None
    fits: bool
    vs_ligertune: float | None = None  # ligertune's tokens/s at this cap over this variant's


@dataclass
class CapReport:
    step: StepReport  # every measured row, each with its checkpointing
    caps: list[float]
    choices: list[CapChoice]

    def to_dict(self) -> dict[str, Any]:
        return {**self.step.to_dict(), "caps_gib": self.caps, "choices": [dataclasses.asdict(c) for c in self.choices]}


def run_memory_caps(
    recipe: Recipe,
    config: StepBenchConfig,
    caps: list[float],
    *,
    recipe_name: str = "",
    log: Callable[[str], None] = lambda _: None,
) -> CapReport:
    """Each variant at its best setting under each memory cap (GiB of peak allocated memory).

    The peers (HF and HF + Liger, with peft for LoRA recipes) run with gradient checkpointing off
    and on; under a cap each gets the faster of the two that fits. ligertune runs its own policy,
    `gradient_checkpointing: auto` with `memory_budget_gib` set to the cap, once per cap.
    """
    if not caps or any(c <= 0 for c in caps):
        raise UserError(f"--memory-cap: give one or more positive GiB figures, got {caps}")
    config = dataclasses.replace(config, chat=False)
    device, dtype, report = _new_report(recipe, config, recipe_name, log)
    vocab_size = _tokenizer_vocab(recipe)
    for checkpointing in (False, True) if config.peers else ():
        variant = _with_checkpointing(recipe, checkpointing, None)
        _StepBench(variant, config, device, dtype, vocab_size, report, log).run(ligertune=False)
    planned: dict[float, StepRow] = {}
    for cap in caps:
        variant = _with_checkpointing(recipe, "auto", cap)
        before = len(report.rows)
        _StepBench(variant, config, device, dtype, vocab_size, report, log).run(peers=False)
        if len(report.rows) > before:
            planned[cap] = report.rows[-1]
    _compare(report)
    choices = cap_choices([r for r in report.rows if r.name != LIGERTUNE], planned, caps)
    return CapReport(report, list(caps), choices)


def cap_choices(peer_rows: list[StepRow], planned: dict[float, StepRow], caps: list[float]) -> list[CapChoice]:
    """Per cap: ligertune's row planned for that cap, and each peer's fastest row whose peak fits
    (a row without a peak, on the CPU, fits any cap). ligertune's row is shown even over its cap."""
    choices = []
    for cap in caps:
        candidates = {LIGERTUNE: [planned[cap]] if cap in planned else []}
        for row in peer_rows:
            candidates.setdefault(row.name, []).append(row)
        ours = None
        for name, rows in candidates.items():
            measured = [r for r in rows if r.status == "ok" and r.tokens_per_s]
            fitting = [r for r in measured if r.peak_mem_gib is None or r.peak_mem_gib <= cap]
            best = max(fitting, key=lambda r: r.tokens_per_s, default=None)
            if best is None and name == LIGERTUNE and measured:
                best = measured[0]
            choice = CapChoice(cap, name, best.checkpointing if best else None, best.tokens_per_s if best else None,
                               best.peak_mem_gib if best else None, fits=any(best is r for r in fitting))
            if name == LIGERTUNE:
                ours = choice if choice.fits else None
            elif ours is not None and choice.fits:
                choice.vs_ligertune = ours.tokens_per_s / choice.tokens_per_s
            choices.append(choice)
    return choices


def _with_checkpointing(recipe: Recipe, checkpointing: bool | str, budget_gib: float | None) -> Recipe:
    train = dataclasses.replace(recipe.train, gradient_checkpointing=checkpointing, memory_budget_gib=budget_gib)
    return dataclasses.replace(recipe, train=train)


class _StepBench:
    """Builds each variant in turn (one model on the device at a time) and times it."""

    def __init__(self, recipe, config, device, dtype, vocab_size, report, log):
        self.recipe, self.config, self.device, self.dtype = recipe, config, device, dtype
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
        self.log(f"step: {name}")
        try:
            self.report.rows.extend(fn())
        except UserError:
            raise
        except Exception as err:  # one broken variant must not hide the others
            self.report.rows.append(StepRow(name, layout, status="failed", detail=describe_error(err)))
        finally:
            release_memory(self.device)

    # ---- building

    def _model(self, *, attention: str | None = None, kernels: bool = False, before_adapters=None):
        """The recipe's model as `ligertune train` builds it (LoRA included), in training mode."""
        from ligertune.models import unwrap_model
        from ligertune.training.build import build_model

        built = build_model(self.recipe, device=self.device, vocab_size=self.vocab_size, attention=attention,
                            kernels=kernels, before_adapters=before_adapters)
        model = built.module
        model.train()
        unwrap_model(model).config.use_cache = False
        if not self.report.model:
            self.report.model = model_summary(unwrap_model(model))
        return built

    def _optimizer(self, model):
        from ligertune.training.build import build_optimizer

        return build_optimizer(model, self.recipe.optim), [p for p in model.parameters() if p.requires_grad]

    def _finish_step(self, optimizer, params) -> None:
        max_norm = self.recipe.optim.max_grad_norm
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _synthetic_ids(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.config.seed)
        shape = (self.recipe.train.micro_batch_size, self.recipe.data.max_seq_len)
        return torch.randint(0, self.report.model["vocab_size"], shape, generator=gen)

    # ---- variants

    def _ligertune(self) -> list[StepRow]:
        from ligertune.data.batching import collate
        from ligertune.data.chat import TokenizedExample
        from ligertune.data.packing import packs_of_one
        from ligertune.models import unpatch_model
        from ligertune.training.build import build_head

        built = self._model(kernels=True)
        model = built.module
        k, loss = self.recipe.kernels, self.recipe.loss
        fused = "on" if k.fused_linear_cross_entropy else "off"
        self.report.kernels = f"{built.patches.describe()}; fused loss: {fused}"
        try:
            head = build_head(model, k, loss)
            optimizer, params = self._optimizer(model)
            ids = self._synthetic_ids()
            examples = [TokenizedExample(row.tolist(), row.tolist()) for row in ids]
            batch = collate(packs_of_one(examples)).to(self.device)
            weights = token_mean_weights(batch.targets, loss.ignore_index)

            def step():
                out = head(batch.input_ids, batch.position_ids, batch.targets, weights,
                           cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
                out.loss.backward()
                self._finish_step(optimizer, params)

            checkpointing = self._plan_checkpointing(model, step, optimizer)
            seq_lens = [ids.shape[1]] * ids.shape[0]
            rows = [self._time(LIGERTUNE, "synthetic", [step], ids.numel(), seq_lens, model)]
            rows[0].checkpointing = checkpointing
            del optimizer, params
            if self.config.chat:
                rows.extend(self._chat(head, model))
            return rows
        finally:
            unpatch_model(model)

    def _plan_checkpointing(self, model, step: Callable[[], None], optimizer) -> str:
        """What the recipe's `gradient_checkpointing` does to the model; for `auto`, the plan the
        trainer would make, on two untimed steps as the trainer makes it on its first two."""
        from ligertune.models import decoder_of
        from ligertune.training.memory import (
            CheckpointPlanner,
            device_allocator,
            fixed_offload,
            set_checkpointed,
        )

        cfg = self.recipe.train
        layers = decoder_of(model).layers
        if fixed_offload(cfg, layers, self.device):  # its hooks live as long as the model
            return "every layer, offloaded"
        if cfg.gradient_checkpointing != "auto":
            return "every layer" if cfg.gradient_checkpointing else "off"
        allocator = device_allocator(self.device)
        if allocator is None:
            set_checkpointed(layers, 0)
            return f"auto: 0 of {len(layers)} layers"
        budget = cfg.memory_budget_gib or 0.9 * torch.cuda.get_device_properties(self.device).total_memory / 2**30
        planner = CheckpointPlanner(model, layers, allocator, budget, offload=cfg.activation_offload,
                                    optimizer=optimizer)
        for _ in range(2):  # measured, then checked against the plan
            with planner.planning():
                step()
            if news := planner.pop_news():
                self.log(news)
        plan = planner.plan
        offloaded = ", offloaded" if plan.offload else ""
        return (f"auto: {plan.checkpointed} of {len(layers)} layers{offloaded} "
                f"(predicted {plan.predicted_peak_gib:.1f} GiB)")

    def _hf(self) -> list[StepRow]:
        model = self._model(attention="sdpa").module
        return [self._time_hf(self._peer_name(HF), model)]

    def _hf_liger(self) -> list[StepRow]:
        import liger_kernel.transformers as liger

        with contextlib.ExitStack() as restore:

            def apply_liger(model) -> None:
                # Liger also rebinds names in the model's modeling module (RoPE, norm and MLP
                # classes), for every later model of that family: put them back afterwards.
                restore.enter_context(_restored_module(type(model).__module__))
                liger._apply_liger_kernel_to_instance(model=model)

            model = self._model(attention="sdpa", before_adapters=apply_liger).module
            return [self._time_hf(self._peer_name(HF_LIGER), model)]

    def _peer_name(self, name: str) -> str:
        """A peer's row name, with `+ peft` when the recipe trains LoRA adapters."""
        return f"{name} + peft" if self.recipe.lora is not None else name

    def _time_hf(self, name: str, model) -> StepRow:
        optimizer, params = self._optimizer(model)
        ids = self._synthetic_ids().to(self.device)

        def step():
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            self._finish_step(optimizer, params)

        row = self._time(name, "synthetic", [step], ids.numel(), [ids.shape[1]] * ids.shape[0], model)
        row.checkpointing = "every layer" if self.recipe.train.gradient_checkpointing else "off"
        return row

    def _chat(self, head, model) -> list[StepRow]:
        """Packed vs padded micro-batches of the same synthetic conversations (forward + backward)."""
        from ligertune.data.batching import collate, collate_padded

        b, seq_len = self.recipe.train.micro_batch_size, self.recipe.data.max_seq_len
        ignore = self.recipe.loss.ignore_index
        examples = synthetic_conversations(
            self.config.chat_micro_batches * b * seq_len, seq_len, self.report.model["vocab_size"],
            self.config.seed,
        )
        examples, packs = whole_micro_batches(examples, seq_len, b)
        lengths = [len(e) for e in examples]
        packed = [collate(packs[i : i + b]).to(self.device) for i in range(0, len(packs), b)]
        padded = [collate_padded([examples[i] for i in group], pad_id=0).to(self.device)
                  for group in padded_groups(lengths, b * seq_len)]

        def packed_step(batch):
            def step():
                out = head(batch.input_ids, batch.position_ids, batch.targets,
                           token_mean_weights(batch.targets, ignore),
                           cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
                out.loss.backward()
            return step

        def padded_step(batch):
            def step():
                out = head(batch.input_ids, batch.position_ids, batch.targets,
                           token_mean_weights(batch.targets, ignore), attention_mask=batch.attention_mask)
                out.loss.backward()
            return step

        def clear():
            model.zero_grad(set_to_none=True)

        n_real = sum(lengths)
        rows = []
        layouts = ((PACKED, [packed_step(x) for x in packed]), (PADDED, [padded_step(x) for x in padded]))
        for name, steps in layouts:
            self.log(f"step: {name} ({len(steps)} micro-batches, {n_real} real tokens)")
            try:
                rows.append(self._time(name, "chat", steps, n_real, lengths, model, per_pass=True,
                                       clear=clear))
            except Exception as err:  # the other layout still runs
                rows.append(StepRow(name, "chat", status="failed", detail=describe_error(err)))
            finally:
                clear()
                release_memory(self.device)
        return rows

    # ---- timing

    def _time(self, name, layout, steps, tokens, seq_lens, model, *, per_pass=False, clear=None) -> StepRow:
        """Time `steps` (callables): `warmup` untimed passes, then `steps` timed ones.

        per_pass=False: each timed step is one call of the single callable; per_pass=True: each
        timed unit is one pass over all callables (the chat micro-batches), and warm-up runs every
        one of them once, so that every shape has been compiled before timing.
        """
        cfg = self.config
        n_warmup = 1 if per_pass else cfg.warmup
        n_timed = cfg.steps
        for _ in range(n_warmup):
            for step in steps:
                step()
                if clear:
                    clear()
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        times = []
        for _ in range(n_timed):
            start = time.perf_counter()
            for step in steps:
                step()
                if clear:
                    clear()
            synchronize(self.device)
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return StepRow(
            name, layout, steps=n_timed * (len(steps) if per_pass else 1), tokens=tokens, step_ms=ms,
            tokens_per_s=tokens / (ms * 1e-3), peak_mem_gib=peak,
            flops=StepFlops.of(model)(tokens, sum(n * n for n in seq_lens)),
        )


# --------------------------------------------------------------------------------------------------
# Data of the benchmark


def synthetic_conversations(total_tokens: int, max_len: int, vocab_size: int, seed: int) -> list:
    """Random-token conversations of mixed lengths adding up to about `total_tokens`.

    Lengths are log-normal (sigma 0.8, median max_len / 6, at least 8 and at most max_len), the
    long-tailed mix of chat data; the first 20-60% of each is masked as the prompt.
    """
    from ligertune.data.chat import IGNORE_INDEX, TokenizedExample

    rng = random.Random(f"ligertune-bench-chat:{seed}")
    median = max(8, max_len // 6)
    examples, total = [], 0
    while total < total_tokens:
        n = int(min(max_len, max(8, rng.lognormvariate(math.log(median), 0.8))))
        ids = [rng.randrange(vocab_size) for _ in range(n)]
        prompt = int(n * rng.uniform(0.2, 0.6))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        examples.append(TokenizedExample(ids, labels, origin=f"synthetic:{len(examples)}"))
        total += n
    return examples


def whole_micro_batches(examples: list, max_seq_len: int, micro_batch_size: int) -> tuple[list, list]:
    """(the conversations, their packs) that fill whole micro-batches: packing leaves the last pack
    partly filled where the conversations overflow, and a micro-batch of it would cost a whole one's
    fixed work for a few tokens (8% of a pass for a 1B model on an H100), which the trainer never
    pays (it carries packs over into the next epoch). Its conversations are left out (the packs'
    `example_indices` still count in `examples`)."""
    from ligertune.data.packing import pack

    packs = pack(examples, max_seq_len)
    packs = packs[: max(len(packs) // micro_batch_size, 1) * micro_batch_size]
    return [examples[i] for p in packs for i in p.example_indices], packs


def padded_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive conversations per padded batch, while rows * longest stays within `budget` tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def token_mean_weights(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The `token` normalization of a step of one micro-batch."""
    return step_token_weights([targets], None, "token", ignore_index=ignore_index)[0]


# --------------------------------------------------------------------------------------------------
# Model facts


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


# --------------------------------------------------------------------------------------------------
# Helpers


def _tokenizer_vocab(recipe: Recipe) -> int | None:
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
