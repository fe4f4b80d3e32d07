"""`ligertune bench step` on a preference recipe (dpo, ipo, simpo, orpo, kto): pairs (KTO: examples)
per second.

The synthetic data is `pairs` pairs of random tokens, each a prompt of `prompt_len` tokens and two
answers of `answer_len` (`bench.synthetic.synthetic_pairs`; every answer token scored; with
`length_spread`, each length drawn around these), the same pairs for every variant; for KTO,
`pairs` examples, each a prompt, a completion and, as its mismatched completion, the next
example's (`synthetic_kto`), desirable and undesirable in turn:

    ligertune                 the trainer's step: the recipe's model and run (`build_run`), the
                              pairs packed as the recipe packs them (prompt once, then the chosen
                              and the rejected answer: `pack_preferences`), micro-batches of
                              `train.micro_batch_size` packs, each step `train_step(run, batches)`.
                              With `objective.reference: precomputed` (dpo, ipo and kto's default)
                              the reference pass of `train` (`compute_reference_logps`: a
                              micro-batch of packs a forward, no gradient) is timed on its own over
                              the same pairs (repeated to at least `REFERENCE_PASS_PACKS` packs a
                              pass, as `train` runs it once over all of its packs, then divided down
                              to the step's), and its time is added to the step's: it serves each
                              pair once, as the step does.
                              `live` scores the reference inside the step.
    TRL DPOTrainer            TRL's trainer on the same model (sdpa attention) and the same pairs as
                              a `datasets.Dataset` of token ids: sigmoid loss (ipo: its ipo loss),
                              the recipe's beta, gradient checkpointing as the recipe, fused AdamW,
                              bf16, `ceil(pairs / grad_accum_steps)` pairs a micro-batch, and its
                              reference: a frozen copy of the starting model (full fine-tuning)
                              or the adapters switched off (LoRA), scored in every step. Each pair
                              runs as two sequences, prompt + chosen and prompt + rejected.
                              For kto, TRL's KTOTrainer the same way: each example runs as prompt +
                              completion, and, for its KL estimate, prompt + mismatched completion.
    TRL DPOTrainer + Liger    the same with `use_liger_kernel` (Liger's RMSNorm, RoPE, SwiGLU; TRL
                              keeps its own chunked log-prob head)

TRL's steps run in `Trainer.train` on one GPU, as ligertune's (`one_device`: with several GPUs
visible, `Trainer` would otherwise spread each micro-batch over all of them); a callback synchronizes
the device at each step's start and end and times the steps after the warm-up ones. Its tokenization
of text is skipped (the pairs are token ids already), so the processing class only gives the pad
token. The peers report `skipped` for simpo and orpo (TRL trains them with other trainers) and `not
installed` without `trl` (and `datasets`, which it needs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from ligertune.bench.peers import NOT_INSTALLED, find_peer
from ligertune.bench.results import StepRow
from ligertune.bench.step import (
    LIGERTUNE,
    PLANNING_STEPS,
    StepBench,
    StepBenchConfig,
    _restored_module,
    checkpointing_of,
)
from ligertune.bench.synthetic import spread_lengths, synthetic_kto, synthetic_pairs
from ligertune.data import collate_preferences
from ligertune.data.preference import PreferencePack, pack_preferences
from ligertune.devices import synchronize
from ligertune.errors import UserError
from ligertune.flops import StepFlops
from ligertune.recipe import Recipe

TRL = "TRL DPOTrainer"
TRL_LIGER = "TRL DPOTrainer + Liger"
TRL_KTO = "TRL KTOTrainer"
TRL_KTO_LIGER = "TRL KTOTrainer + Liger"
TRL_LOSSES = {"dpo": "sigmoid", "ipo": "ipo", "kto": "kto"}
"""The objectives TRL's DPOTrainer (kto: KTOTrainer) runs, and its `loss_type` for each."""
REFERENCE_PASS_PACKS = 16
"""The fewest packs a timed reference pass runs over (`PreferenceStepBench._reference_ms`)."""


@dataclass(frozen=True)
class PairShape:
    """The synthetic pairs (KTO: examples) of one step: `prompt_len` and `answer_len` each pair's, or
    with a `spread` the middle of the lengths drawn (`synthetic.spread_lengths`)."""

    pairs: int
    prompt_len: int
    answer_len: int
    spread: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens of the longest pair as ligertune lays it out: the prompt once, then both answers
        (KTO: the completion and the mismatched one)."""
        prompt, answer = (spread_lengths(n, self.spread)[1] for n in (self.prompt_len, self.answer_len))
        return prompt + 2 * answer


def check_pair_options(recipe: Recipe, config: StepBenchConfig) -> None:
    """The pair options (and `--epochs`) belong to preference recipes."""
    names = ("pairs", "prompt_len", "answer_len", "length_spread", "epochs")
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(config, name) is not None]
    if not recipe.objective.preference and given:
        raise UserError(f"{', '.join(given)}: these are for preference pairs; the recipe's objective is sft")
    if config.epochs is not None and config.epochs < 1:
        raise UserError(f"--epochs must be at least 1; got {config.epochs}")


def pair_shape(recipe: Recipe, config: StepBenchConfig) -> PairShape:
    """`--pairs` (default: `micro_batch_size` x `grad_accum_steps`, a pack a pair), `--prompt-len`
    (default: half of `data.max_seq_len`) and `--answer-len` (default: a quarter), checked: a pair
    must fit one pack."""
    train, max_len = recipe.train, recipe.data.max_seq_len
    shape = PairShape(
        pairs=config.pairs if config.pairs is not None else train.micro_batch_size * train.grad_accum_steps,
        prompt_len=config.prompt_len if config.prompt_len is not None else max_len // 2,
        answer_len=config.answer_len if config.answer_len is not None else max_len // 4,
        spread=config.length_spread or 0.0,
    )
    if min(shape.pairs, shape.prompt_len, shape.answer_len) < 1:
        raise UserError(f"--pairs, --prompt-len and --answer-len must be at least 1; got {shape.pairs}, "
                        f"{shape.prompt_len}, {shape.answer_len}")
    if not 0.0 <= shape.spread < 1.0:
        raise UserError(f"--length-spread must be at least 0 and below 1; got {shape.spread}")
    if shape.tokens > max_len:
        longest = f", the longest drawn at --length-spread {shape.spread}" if shape.spread else ""
        raise UserError(f"--prompt-len {shape.prompt_len} and two answers of --answer-len {shape.answer_len} "
                        f"make {shape.tokens} tokens{longest}, more than data.max_seq_len={max_len}: a pair "
                        "packs whole")
    return shape


def pair_flops(model, packs: list[PreferencePack], *, reference: float) -> float:
    """The model flops of a step over `packs` (`ligertune.flops`: each segment's queries times its
    keys for attention): the training forward and backward, KTO's forward without gradient over
    the mismatched completions, and the reference's forward over the packs, `reference` times (0:
    none; 1: each step's own; 1/E: a precomputed pass spread over E epochs)."""
    from ligertune.training.step import squared_lengths

    batch = collate_preferences([dataclasses.replace(p, reference_logps=None) for p in packs])
    trained, mismatched = batch.kto_parts()
    f = StepFlops.of(model)

    def forward(part) -> float:  # 2 flops per weight and token, a third of the attention term
        attention = f.layers * f.heads * f.head_dim * squared_lengths(part)
        return 2.0 * f.matmul_params * part.num_tokens + 2.0 * attention

    flops = f(trained.num_tokens, squared_lengths(trained))
    if mismatched is not None:  # KTO's pass over its mismatched completions
        flops += forward(mismatched)
    if reference:  # each pack whole, KTO's too (`compute_reference_logps`)
        flops += reference * forward(batch)
    return flops


class PreferenceStepBench(StepBench):
    """`StepBench` for a preference recipe: ligertune's step and TRL's, in pairs per second."""

    @property
    def epochs(self) -> int:
        """The epochs over which the reference pass is spread (`--epochs`, 1 unless given)."""
        return self.config.epochs or 1

    def run(self, *, ligertune: bool = True, peers: bool = True) -> None:
        self.shape = pair_shape(self.recipe, self.config)
        if ligertune:
            self._guarded(LIGERTUNE, "synthetic", self._ligertune)
        if peers:
            self._peers()

    def _pairs(self):
        shape = self.shape
        vocab = self.report.model["vocab_size"]
        make = synthetic_kto if self.recipe.objective.name == "kto" else synthetic_pairs
        return make(shape.pairs, shape.prompt_len, shape.answer_len, vocab, self.config.seed, shape.spread)

    def _packs(self) -> list[PreferencePack]:
        data = self.recipe.data
        units = self._pairs()
        packs = pack_preferences(units, data.max_seq_len, packing=data.packing)
        size = self.recipe.train.micro_batch_size
        self.report.pairs = {
            "objective": self.recipe.objective.name, "pairs": self.shape.pairs,
            "prompt_len": self.shape.prompt_len, "answer_len": self.shape.answer_len,
            "length_spread": self.shape.spread, "seed": self.config.seed, "packs": len(packs),
            "micro_batches": math.ceil(len(packs) / size),
            "drawn": [[unit.prompt_len, *unit.answer_lens] for unit in units] if self.shape.spread else None,
            "epochs": self.epochs,
        }
        return packs

    # ---- ligertune: the trainer's step, and the reference pass of `train`

    def _ligertune(self) -> list[StepRow]:
        from ligertune.models import unpatch_model
        from ligertune.objectives.reference import compute_reference_logps
        from ligertune.training.build import build_reference_model, build_run
        from ligertune.training.memory import CheckpointPlanner
        from ligertune.training.step import train_step

        recipe, cfg = self.recipe, self.config
        built = self._model(kernels=True)
        model = built.module
        try:
            reference_model = build_reference_model(recipe, device=self.device,
                                                    vocab_size=self.report.model["vocab_size"], dtype=None)
            run = build_run(recipe, model, device=self.device, reference_model=reference_model,
                            total_steps=PLANNING_STEPS + cfg.warmup + cfg.steps)
            fused = "on" if run.head.fused else "off"
            self.report.kernels = f"{built.patches.describe()}; fused loss: {fused}"
            packs = self._packs()
            mode, size = recipe.objective.reference_mode, recipe.train.micro_batch_size
            if mode == "precomputed":  # as `train` does before its first step (and warming the kernels up)
                compute_reference_logps(run.engine, packs, self.device, packs_per_forward=size)
            batches = [collate_preferences(packs[i : i + size]).to(self.device)
                       for i in range(0, len(packs), size)]
            if isinstance(run.checkpointing, CheckpointPlanner):
                for _ in range(PLANNING_STEPS):
                    if news := train_step(run, batches).news:
                        self.log(news)
            tokens = sum(len(p) for p in packs)
            row = self._time(LIGERTUNE, "synthetic", [lambda: train_step(run, batches)], tokens, [], model,
                             flops=pair_flops(model, packs, reference=self._reference_share(mode)))
            if mode == "precomputed":
                row.reference_ms = self._reference_ms(run, packs)
                row.reference_epochs = self.epochs
                if self.device.type == "cuda":  # the reference pass's peak too
                    row.peak_mem_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
            spread = f", spread over {self.epochs} epochs" if self.epochs > 1 else ""
            row.reference = {"precomputed": f"precomputed, its pass timed (ref ms: passes of at least "
                                            f"{REFERENCE_PASS_PACKS} packs, per the step's){spread}",
                             "live": "live, in the step"}.get(mode, "none")
            row.checkpointing = checkpointing_of(run)
            return [finish_pair_row(row, self.shape.pairs)]
        finally:
            unpatch_model(model)

    def _reference_share(self, mode: str) -> float:
        """The reference forwards a step counts: a precomputed pass serves every epoch once run."""
        return {"precomputed": 1.0 / self.epochs, "live": 1.0}.get(mode, 0.0)

    def _reference_ms(self, run, packs: list[PreferencePack]) -> float:
        """Median time of `train`'s reference pass, per the step's packs (`steps` timed passes).

        `train` runs the pass once over all its packs, so the pass's start (the first pack collated
        while the device waits) and its end (every value read back) come once a run, not once a step:
        each timed pass runs over the step's packs repeated to at least `REFERENCE_PASS_PACKS`, and
        its time is divided by the repeats.
        """
        from ligertune.objectives.reference import compute_reference_logps

        repeats = -(-REFERENCE_PASS_PACKS // len(packs))
        copies = [dataclasses.replace(p, reference_logps=None) for p in packs * repeats]
        times, size = [], self.recipe.train.micro_batch_size
        for _ in range(self.config.steps):
            synchronize(self.device)
            start = time.perf_counter()
            compute_reference_logps(run.engine, copies, self.device, packs_per_forward=size)
            synchronize(self.device)
            times.append((time.perf_counter() - start) * 1e3 / repeats)
        return statistics.median(times)

    # ---- TRL

    def _trl_micro_batch(self) -> int:
        """TRL's pairs (KTO: examples) a micro-batch: the step's over `grad_accum_steps`."""
        return math.ceil(self.shape.pairs / self.recipe.train.grad_accum_steps)

    def _peers(self) -> None:
        trl = find_peer("trl")
        objective = self.recipe.objective.name
        loss = TRL_LOSSES.get(objective)
        kto = objective == "kto"
        for name, liger in ((TRL_KTO if kto else TRL, False), (TRL_KTO_LIGER if kto else TRL_LIGER, True)):
            name = self._peer_name(name)
            liger_peer = find_peer("liger") if liger else None
            if not trl.available:
                status = "not installed" if trl.unavailable == NOT_INSTALLED else "failed"
                self.report.rows.append(StepRow(name, "synthetic", status=status, detail=trl.unavailable))
            elif loss is None:
                detail = f"TRL trains {objective} with another trainer"
                self.report.rows.append(StepRow(name, "synthetic", status="skipped", detail=detail))
            elif kto and self._trl_micro_batch() < 2:
                detail = "TRL's KTO estimates its KL term within a micro-batch: it needs 2 examples or more a micro-batch"
                self.report.rows.append(StepRow(name, "synthetic", status="skipped", detail=detail))
            elif liger_peer is not None and not liger_peer.available:
                status = "not installed" if liger_peer.unavailable == NOT_INSTALLED else "failed"
                self.report.rows.append(StepRow(name, "synthetic", status=status,
                                                detail=f"liger-kernel: {liger_peer.unavailable}"))
            elif liger and self.device.type != "cuda":
                self.report.rows.append(StepRow(name, "synthetic", status="skipped",
                                                detail="liger-kernel needs CUDA"))
            else:
                self._guarded(name, "synthetic",
                              lambda name=name, liger=liger: [self._trl(name, liger, loss)])

    def _trl(self, name: str, liger: bool, loss: str) -> StepRow:
        import datasets
        import transformers
        import trl

        from ligertune.models import load_tokenizer, unwrap_model

        recipe, cfg, optim = self.recipe, self.config, self.recipe.optim
        with contextlib.ExitStack() as stack:
            # TRL's and transformers' deprecation notices (`use_liger_kernel`, argument names) are not results
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore", FutureWarning)
            model = self._model(attention="sdpa").module
            if liger:  # Liger rebinds names in the modeling module: put them back afterwards
                stack.enter_context(_restored_module(type(unwrap_model(model)).__module__))
            reference = None if recipe.lora is not None else copy.deepcopy(model).requires_grad_(False).eval()
            units = self._pairs()
            packs = self._packs()
            total = cfg.warmup + cfg.steps
            kto = recipe.objective.name == "kto"
            columns = ({"prompt_ids": [], "completion_ids": [], "KL_completion_ids": [], "label": []} if kto
                       else {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []})
            for unit in units * total:
                (first_start, first_end), (second_start, second_end) = unit.answer_spans
                first, second = unit.input_ids[first_start:first_end], unit.input_ids[second_start:second_end]
                columns["prompt_ids"].append(unit.input_ids[:unit.prompt_len])
                if kto:  # the completion, and the mismatched one for the KL estimate
                    columns["completion_ids"].append(first)
                    columns["KL_completion_ids"].append(second)
                    columns["label"].append(unit.desirable)
                else:
                    columns["chosen_ids"].append(first)
                    columns["rejected_ids"].append(second)
            objective = recipe.objective
            common = dict(
                output_dir=stack.enter_context(tempfile.TemporaryDirectory()),
                per_device_train_batch_size=self._trl_micro_batch(),
                gradient_accumulation_steps=recipe.train.grad_accum_steps,
                max_steps=total, learning_rate=optim.lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_epsilon=optim.eps,
                optim="adamw_torch_fused" if self.device.type == "cuda" else "adamw_torch",
                max_grad_norm=optim.max_grad_norm or 0.0, lr_scheduler_type="constant",
                bf16=next(model.parameters()).dtype == torch.bfloat16, use_cpu=self.device.type == "cpu",
                gradient_checkpointing=bool(recipe.train.gradient_checkpointing), beta=objective.beta,
                max_length=None, use_liger_kernel=liger, seed=recipe.train.seed, report_to="none",
                save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            )
            if kto:
                args = trl.KTOConfig(**common, loss_type=loss, desirable_weight=objective.desirable_weight,
                                     undesirable_weight=objective.undesirable_weight)
            else:
                args = trl.DPOConfig(**common, loss_type=[loss], label_smoothing=objective.label_smoothing)
            one_device(args)
            clock = StepClock(self.device, cfg.warmup)
            trainer = _pretokenized(trl.KTOTrainer if kto else trl.DPOTrainer)(
                model=model, ref_model=reference, args=args, callbacks=[clock],
                train_dataset=datasets.Dataset.from_dict(columns),
                processing_class=load_tokenizer(recipe.model),
            )
            trainer.remove_callback(transformers.PrinterCallback)
            trainer.train()
            ms = statistics.median(clock.times)
            peak = None
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            row = StepRow(name, "synthetic", steps=len(clock.times), tokens=sum(len(p) for p in packs),
                          step_ms=ms, peak_mem_gib=peak, flops=pair_flops(model, packs, reference=1.0),
                          checkpointing="every layer" if recipe.train.gradient_checkpointing else "off",
                          reference="frozen copy, in the step" if reference is not None else
                          "adapters off, in the step")
            return finish_pair_row(row, self.shape.pairs)


def finish_pair_row(row: StepRow, pairs: int) -> StepRow:
    """A preference row's rates: its pairs over the step's time plus its share of the reference pass."""
    seconds = row.time_ms * 1e-3
    row.pairs = pairs
    row.pairs_per_s = pairs / seconds
    row.tokens_per_s = row.tokens / seconds
    return row


class StepClock(TrainerCallback):
    """Times a `transformers.Trainer`'s optimizer steps after the first `warmup`, the device
    synchronized at each step's start and end; resets CUDA's peak memory before the first timed one."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        if state.global_step == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        if state.global_step > self.warmup:
            self.times.append((time.perf_counter() - self.start) * 1e3)


def one_device(args) -> None:
    """Keep a `transformers.TrainingArguments`' trainer on one GPU, as the other rows run: with several
    GPUs visible to one process, `Trainer` would spread each micro-batch over all of them
    (`nn.DataParallel`, the micro-batch times the GPUs), and TRL's KTOTrainer refuses to start. Raises
    if this version of transformers does not let it (the row then fails, saying so)."""
    if args.n_gpu > 1:  # read first: it sets the count from the GPUs visible, once
        args._n_gpu = 1
    if args.n_gpu != 1 and args.device.type == "cuda":
        raise RuntimeError(f"transformers' Trainer would spread over {args.n_gpu} GPUs; "
                           "make one visible with CUDA_VISIBLE_DEVICES")


def _pretokenized(trainer: type) -> type:
    """TRL's `DPOTrainer` (or `KTOTrainer`) taking the data as token ids (`prompt_ids`, `chosen_ids`,
    `rejected_ids`; KTO: `prompt_ids`, `completion_ids`, `KL_completion_ids`, `label`): its
    preparation of text (prompt extraction, EOS, tokenization, KTO's mismatched completions) is
    skipped; all else is TRL's."""

    class Pretokenized(trainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    Pretokenized.__name__ = f"Pretokenized{trainer.__name__}"
    return Pretokenized
