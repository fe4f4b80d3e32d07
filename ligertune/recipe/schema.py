"""The recipe schema: every section a recipe may have, each field with its type, default and meaning,
and the checks of values and of combinations across sections.

This file is the reference a reader opens to learn what a recipe can say (docs/recipe.md is printed
from it by `python -m ligertune.recipe`). A recipe is plain YAML with one mapping per section
(`model`, `data`, `kernels`, `objective`, `loss`, `lora`, `optim`, `train`, `distributed`, `output`). Each
section's `check()` returns `(key, message)` pairs; `ligertune.recipe.convert` collects them all with
their key paths, so one run of `ligertune validate` shows everything that is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ligertune.errors import UserError

# Every integer of a recipe fits in 64 bits: torch and the C code below it take nothing larger.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# Bounds past which a value is surely a typo and would fail late: an epoch count that overflows the
# step count, adapters that cannot be allocated, a sample list that does not fit in memory.
MAX_EPOCHS = 1e6
MAX_LORA_RANK = 65536
MAX_SAMPLES = 100_000_000
MAX_MICRO_BATCH = 65536
MAX_GRAD_ACCUM = 1_000_000
MAX_THREADS = 4096
# The label of untrained tokens: the data pipeline writes it (`ligertune.data` takes it from here, the
# upstream end of the data flow) and `loss.ignore_index` must name it.
IGNORE_INDEX = -100


def _field(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A dataclass field that carries its documentation (shown by `docs/recipe.md` and `recipes show`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


# --------------------------------------------------------------------------------------------------
# Sections

DEFAULT_BETAS = {"adamw": (0.9, 0.999), "lion": (0.9, 0.99)}
"""`optim.betas` when the recipe gives none: torch's AdamW default, and the Lion paper's."""


@dataclass
class ModelConfig:
    """Which model to train and how to run it."""

    name_or_path: str | None = _field(
        None, "Hub id or local directory of a pretrained model (config, weights, tokenizer)."
    )
    config: str | dict | None = _field(
        None,
        "Build the model from a config with random weights instead: a preset name "
        "(see `ligertune.models.PRESETS`) or a mapping of config fields with `model_type`.",
    )
    tokenizer: str | None = _field(
        None, "Hub id or local directory of the tokenizer; defaults to `name_or_path`."
    )
    chat_template: str | None = _field(
        None,
        "The chat template conversations are rendered with, in place of the tokenizer's own (a base "
        "model's often has none): `chatml` or `llama3` (built in; their markers must be special tokens "
        "of the vocabulary), a .jinja file (resolved next to the recipe), or Jinja text. Saved with the "
        "run's tokenizer, so `chat` and `merge` use it too.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _field(
        "auto", "Parameter dtype: `auto` is bfloat16 on a GPU and float32 on a CPU."
    )
    quantization: Literal["nf4", "int8"] | None = _field(
        None,
        "QLoRA: store the decoder's linear layers in 4-bit NF4 (`nf4`) or LLM.int8() (`int8`) through "
        "bitsandbytes and train LoRA adapters over them (needs `lora`, one process, and the extra: "
        "pip install 'ligertune[qlora]'). Embeddings, norms and the output projection stay in `dtype`.",
    )
    attention: Literal["packed", "sdpa", "eager"] = _field(
        "packed",
        "`packed`: conversations in a pack attend only to themselves (varlen attention on CUDA, "
        "a block-diagonal mask on CPU). `sdpa`/`eager`: the model's own attention, for padded batches.",
    )
    trust_remote_code: bool = _field(False, "Allow model code from the hub (off by default).")

    def check(self) -> list[tuple[str, str]]:
        if (self.name_or_path is None) == (self.config is None):
            return [("", "give exactly one of `name_or_path` (pretrained) or `config` (random init)")]
        if isinstance(self.config, dict) and "model_type" not in self.config:
            return [("config", "a config mapping needs `model_type` (e.g. llama)")]
        return []


@dataclass
class DataSource:
    """One data source of several; `weight` or `samples` sets its share."""

    path: str = _field(doc="Local .jsonl/.json/.parquet file, a pattern of them (`shards/*.jsonl`), or a hub "
                           "dataset name.")
    format: Literal["auto", "messages", "sharegpt", "prompt_completion", "paired", "paired_conversations",
                    "unpaired"] = _field(
        "auto", "Record format (see `data.format`); `auto` takes `data.format`."
    )
    split: str = _field("train", "Split to read when `path` is a hub dataset.")
    weight: float | None = _field(None, "Relative share of this source (repeated or subsampled to its share).")
    samples: int | None = _field(
        None, f"Exact number of conversations to take from this source (at most {MAX_SAMPLES:,})."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.weight is not None and self.samples is not None:
            problems.append(("", "give `weight` or `samples`, not both"))
        if self.weight is not None and self.weight <= 0:
            problems.append(("weight", f"must be > 0, got {self.weight}"))
        if self.samples is not None and not 0 < self.samples <= MAX_SAMPLES:
            problems.append(("samples", f"must be in [1, {MAX_SAMPLES:,}], got {self.samples}"))
        return problems


@dataclass
class DataConfig:
    """Chat data, how it is rendered, masked, truncated and packed."""

    path: str | None = _field(None, "One source: local .jsonl/.json/.parquet file, a pattern of them "
                                    "(`shards/*.jsonl`, read in name order), or a hub dataset name.")
    sources: list[DataSource] = _field(doc="Several sources, each with a weight or a sample count.", factory=list)
    format: Literal["auto", "messages", "sharegpt", "prompt_completion", "paired", "paired_conversations",
                    "unpaired"] = _field(
        "auto",
        "Record format. Chat data for `objective.name` sft, distill and medusa: OpenAI `messages`, "
        "ShareGPT `conversations`, or `prompt_completion`. Preference data for dpo, ipo, simpo, orpo and "
        "kto (docs/data.md): `paired` "
        "(`prompt`, `chosen`, `rejected`), `paired_conversations` (`chosen` and `rejected` whole "
        "conversations, TRL style), `unpaired` (`prompt`, `completion`, `label` true/false: KTO). `auto` "
        "detects it from each source's first record, among the formats of the objective.",
    )
    split: str = _field("train", "Split to read when `path` is a hub dataset.")
    max_seq_len: int = _field(2048, "Tokens per pack (and the longest conversation kept).")
    packing: bool = _field(True, "Pack several conversations per sequence (best-fit decreasing).")
    truncation: Literal["drop_turns", "drop"] = _field(
        "drop_turns",
        "Too-long conversations: `drop_turns` removes trailing turns until it fits (keeping a "
        "trained turn), `drop` drops the conversation. Both are counted and reported.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = _field(
        "assistant", "Which tokens carry loss: every assistant turn, only the last one, or all."
    )
    on_bad_record: Literal["error", "skip"] = _field(
        "error", "A malformed record stops with its file and line (`error`) or is skipped and counted."
    )
    eval_path: str | None = _field(None, "Held-out data for evaluation (a file, pattern or hub dataset, as "
                                         "`path`).")
    eval_fraction: float = _field(
        0.0, "Share of the training conversations held out for evaluation when `eval_path` is unset."
    )
    system_prompt: str | None = _field(
        None, "A system message put first in every conversation (and preference prompt) that has none, "
              "held-out data included: the system prompt the model learns under. `chat` on the run uses it "
              "unless given `--system`.")
    num_workers: int | None = _field(None, "Processes for tokenization; default: all cores.")
    cache_dir: str | None = _field(
        "~/.cache/ligertune", "Where tokenized data is cached (keyed by data, tokenizer, settings); null disables."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if (self.path is None) == (not self.sources):
            problems.append(("", "give exactly one of `path` (one source) or `sources` (several)"))
        if self.max_seq_len < 8:
            problems.append(("max_seq_len", f"must be >= 8, got {self.max_seq_len}"))
        if not 0.0 <= self.eval_fraction < 1.0:
            problems.append(("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}"))
        if self.eval_path is not None and self.eval_fraction > 0:
            problems.append(("eval_fraction", "give `eval_path` or `eval_fraction`, not both"))
        if self.num_workers is not None and self.num_workers < 1:
            problems.append(("num_workers", f"must be >= 1, got {self.num_workers}"))
        if self.sources and any(s.weight is not None for s in self.sources) and any(
            s.samples is not None for s in self.sources
        ):
            problems.append(("sources", "use `weight` on every source or `samples` on every source, not a mix"))
        return problems


@dataclass
class KernelsConfig:
    """Which layers are replaced by ligertune's kernels."""

    rms_norm: bool = _field(True, "RMSNorm layers.")
    rope: bool = _field(True, "Rotary position embedding applied to q and k.")
    swiglu: bool = _field(
        True, "The gated MLP's unit: SwiGLU (SiLU), or GeGLU for Gemma's tanh GELU (`gelu_pytorch_tanh`)."
    )
    fused_linear_cross_entropy: bool = _field(
        True, "Output projection + cross-entropy fused: the [tokens, vocab] logits are never stored."
    )
    loss_chunk_mib: int = _field(1024, "Memory budget of the fused loss for its chunk of logits, in MiB.")
    mlp_chunk_tokens: int | None = _field(
        None,
        "With `swiglu`: run each MLP over chunks of this many tokens, each chunk recomputed in backward, "
        "so that its [tokens, intermediate_size] products are one chunk's at a time, never kept (for "
        "long conversations, where they are a layer's largest tensors; docs/memory.md). Costs one more "
        "forward of the MLP. null: the MLP runs whole.",
    )
    float8_linear: bool = _field(
        True,
        "With `train.precision: fp8` over weights that train (a full fine-tune): ligertune's float8 "
        "layers. Each product and the input's gradient are float8 GEMMs, the weight cast at each use "
        "with a scale per output channel and the input with a scale per token (one Triton pass each); "
        "the weight's gradient is a bf16 GEMM; no torchao needed, and `mlp_chunk_tokens` works "
        "(docs/fp8.md). `false`: torchao's float8 training (`train.fp8_scaling`), compiled.",
    )
    float8_weight_grad: bool = _field(
        False,
        "With `float8_linear`: the weights' gradients as float8 GEMMs too, the output gradient in e5m2 "
        "and the input in e4m3, one scale for each tensor (cast transposed, one Triton pass each). "
        "`false`: bf16 GEMMs (docs/fp8.md).",
    )
    lora: bool = _field(
        True,
        "With `lora`: the LoRA layers compute peft's values without its per-layer overhead: one GEMM "
        "for the A projections of layers that read one input (q, k, v; gate, up), the input kept for "
        "backward in the model dtype instead of a float32 copy per layer, and the adapters kept in "
        "the model dtype (bf16 over a bf16 model; peft upcasts them to float32) so that "
        "y = base(x) + s (x A^T) B^T is one GEMM adding into the base output, rounded once "
        "(docs/kernels.md). Their updates stay exact through `optim.master_weights`. The same over a "
        "quantized base (`model.quantization`, QLoRA). With `lora.dropout` > 0 peft's own forward runs "
        "and the adapters stay float32; `false`: peft's forward and float32 adapters throughout.",
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.loss_chunk_mib < 1:
            problems.append(("loss_chunk_mib", f"must be >= 1, got {self.loss_chunk_mib}"))
        if self.mlp_chunk_tokens is not None:
            if self.mlp_chunk_tokens < 1:
                problems.append(("mlp_chunk_tokens", f"must be >= 1 or null, got {self.mlp_chunk_tokens}"))
            elif not self.swiglu:
                problems.append(("mlp_chunk_tokens", "chunks the gated MLPs' kernel: needs `swiglu: true`"))
        return problems


SFT_FORMATS = ("messages", "sharegpt", "prompt_completion")
"""`data.format` values of chat data, read by supervised fine-tuning."""
PREFERENCE_FORMATS = ("paired", "paired_conversations", "unpaired")
"""`data.format` values of preference data (`ligertune.data.preference`)."""
PAIRED_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
"""Objectives that compare a chosen with a rejected answer to one prompt: they need pairs."""
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
"""Objectives whose reward is measured against a frozen reference model's log-probabilities."""
PREFERENCE_OBJECTIVES = (*PAIRED_OBJECTIVES, "kto")
"""Objectives that train on preference data (`data.format`: paired or unpaired answers)."""
CHAT_OBJECTIVES = ("sft", "distill", "medusa")
"""Objectives that train on chat data (`data.format`: messages, sharegpt, prompt_completion)."""
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
"""`objective.loss` of distillation (`ligertune.kernels.fused_linear_divergence`)."""
MEDUSA_DECAY = 0.8
"""Medusa's head weights when the recipe gives none: lambda_k = 0.8^k for head k = 1..K (the paper's)."""
MEDUSA_BACKBONES = ("frozen", "lora", "full")
"""`objective.backbone` of Medusa: the model under the heads frozen (Medusa-1), or trained with them."""
OBJECTIVE_DEFAULTS = {
    "beta": {"dpo": 0.1, "ipo": 0.1, "kto": 0.1, "simpo": 2.0, "distill": 0.5},
    "gamma": {"simpo": 1.0},
    "orpo_lambda": {"orpo": 0.1},
}
"""`objective.beta`, `gamma` and `orpo_lambda` when the recipe gives none, per objective (filled in
when loaded); an objective missing from a row does not read that key."""
# Which objectives read each key besides `name`; a key set away from its default for another
# objective is a recipe problem (it would be silently ignored).
OBJECTIVE_KEYS = {
    "beta": ("dpo", "ipo", "simpo", "kto", "distill"),
    "label_smoothing": ("dpo",),
    "gamma": ("simpo",),
    "orpo_lambda": ("orpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "reference": ("dpo", "ipo", "simpo", "orpo", "kto"),
    "teacher": ("distill",),
    "loss": ("distill",),
    "temperature": ("distill",),
    "alpha": ("distill",),
    "teacher_quantization": ("distill",),
    "heads": ("medusa",),
    "head_layers": ("medusa",),
    "head_weights": ("medusa",),
    "backbone": ("medusa",),
    "lm_weight": ("medusa",),
}


@dataclass
class ObjectiveConfig:
    """What a step optimises: supervised fine-tuning (`sft`, the default), a preference objective,
    distillation from a teacher model (`distill`, on chat data), or Medusa heads (`medusa`, on chat
    data).

    Notation: x a prompt, y_w the chosen answer, y_l the rejected one, pi the trained model,
    pi_ref the reference model (`reference`), log pi(y|x) the sum of log-probabilities of an
    answer's scored tokens, h = log pi(y_w|x)/pi_ref(y_w|x) - log pi(y_l|x)/pi_ref(y_l|x), sigma the
    logistic function. Every loss is averaged over the pairs (KTO: the examples) of an optimizer step,
    whatever the batching, as supervised fine-tuning averages over tokens.
    """

    name: Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto", "distill", "medusa"] = _field(
        "sft",
        "`sft`: cross-entropy on the trained tokens of chat data (the `loss` section). `distill`: on "
        "the same chat data and tokens, the divergence of the trained model (the student) from a "
        "frozen `teacher`, mixed with the student's own cross-entropy by `alpha` (docs/distill.md). "
        "`medusa`: on the same chat data, `heads` extra output heads on the model's last hidden state, "
        "head k learning the token k + 1 places ahead, for speculative decoding (Cai et al. 2024, "
        "Medusa; docs/medusa.md); the model frozen under them (`backbone`). "
        "On preference "
        "data (`data.format`): `dpo` -log sigma(beta h) (Rafailov et al. 2023, DPO, eq. 7); `ipo` "
        "(h - 1/(2 beta))^2 (Azar et al. 2023, IPO, eq. 17); `simpo` -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma), "
        "reference-free, |y| the answer's scored tokens (Meng et al. 2024, SimPO, eq. 6); `orpo` "
        "NLL(y_w) - orpo_lambda log sigma(log odds(y_w|x) - log odds(y_l|x)), odds(y|x) = P/(1-P) with "
        "P the per-token mean probability exp(log pi(y|x)/|y|), reference-free (Hong et al. 2024, ORPO, "
        "eq. 6-7); `kto` on answers labelled desirable or undesirable, 1 - sigma(beta (r - z0)) "
        "weighted by `desirable_weight` for a desirable answer and 1 - sigma(beta (z0 - r)) weighted by "
        "`undesirable_weight` for an undesirable one, r = log pi(y|x)/pi_ref(y|x), z0 the step's "
        "KL(pi || pi_ref) estimate from mismatched prompt/answer pairs, clamped at 0, no gradient "
        "(Ethayarajh et al. 2024, KTO, eq. 8).",
    )
    beta: float | None = _field(
        None,
        "`dpo`, `kto`: the temperature of the implicit reward beta log pi/pi_ref, i.e. the strength of "
        "the KL penalty that keeps pi near pi_ref (larger: closer); `ipo`: the regularisation tau, "
        "the target margin being 1/(2 beta); `simpo`: the scale of the length-normalised reward. "
        "null: 0.1 for dpo, ipo and kto (the papers' and TRL's default), 2.0 for simpo (the SimPO "
        "paper's settings are 2.0 to 2.5; TRL's CPOTrainer defaults to 0.1); filled in when loaded. "
        "Must be > 0. ORPO's weight is `orpo_lambda`, not this. `distill` with `loss: jsd`: the "
        "weight of the teacher in the mixture M = beta P_teacher + (1 - beta) P_student of the "
        "generalised Jensen-Shannon divergence (0.5: the symmetric one), in (0, 1); null: 0.5.",
    )
    label_smoothing: float = _field(
        0.0,
        "`dpo` only: the probability eps that a pair's preference is flipped (conservative DPO, "
        "Mitchell 2023; TRL's `label_smoothing`): the loss becomes -(1-eps) log sigma(beta h) - "
        "eps log sigma(-beta h). In [0, 0.5); 0 is plain DPO. (`loss.label_smoothing` is the "
        "cross-entropy's, for sft.)",
    )
    gamma: float | None = _field(
        None,
        "`simpo` only: the target reward margin gamma, in reward units (the paper's gamma, TRL's "
        "`simpo_gamma`; the SimPO repository's `gamma_beta_ratio` is gamma / beta). null: 1.0, "
        "so gamma / beta = 0.5 with the default beta 2.0, the ratio SimPO's authors suggest "
        "starting from (the paper's settings span 0.3 to 1.6); filled in when loaded. Must be >= 0.",
    )
    orpo_lambda: float | None = _field(
        None,
        "`orpo` only: lambda, the weight of the odds-ratio term beside the chosen answer's NLL (TRL "
        "calls it `beta`; it is a weight, not a temperature like DPO's beta, hence its own key). "
        "null: 0.1, the paper's and TRL's value; filled in when loaded. Must be > 0 (0 is `sft` on "
        "the chosen answers).",
    )
    desirable_weight: float = _field(
        1.0,
        "`kto` only: lambda_D, the weight of a desirable answer's loss (TRL's `desirable_weight`). "
        "The KTO paper advises lambda_D n_D / (lambda_U n_U) in [1, 4/3], n_D and n_U the counts of "
        "desirable and undesirable answers: with unbalanced data, lower the weight of the more "
        "frequent kind. Must be > 0.",
    )
    undesirable_weight: float = _field(
        1.0, "`kto` only: lambda_U, the weight of an undesirable answer's loss (see `desirable_weight`). "
        "Must be > 0."
    )
    reference: Literal["auto", "precomputed", "live", "none"] = _field(
        "auto",
        "Where the reference log-probabilities log pi_ref(y|x) of dpo, ipo and kto come from: the "
        "starting model, frozen (with `lora`, the same weights with the adapters off). "
        "`precomputed`: one pass of it over the training and held-out answers before the first step, "
        "kept in `data.cache_dir` keyed by model and data (a repeated run reads them back) and in the "
        "run's folder (for `--resume`); no second model in memory. `live`: scored again at every "
        "micro-batch, with the adapters off (`lora`) or by a frozen copy of the model held in memory "
        "(full fine-tuning): no pass before the first step, one extra forward per micro-batch; for "
        "runs that see a small part of a large dataset. `none`: no reference, for the reference-free "
        "simpo and orpo. `auto`: `precomputed` for dpo, ipo and kto, `none` for simpo and orpo. Other "
        "combinations are refused: dpo, ipo and kto are defined against a reference, and simpo and "
        "orpo never read one.",
    )

    teacher: str | None = _field(
        None,
        "`distill` only, required: the teacher model, a local folder or a hub id, loaded as "
        "`model.name_or_path` is. It must share the student's tokenizer vocabulary; it runs frozen "
        "on the same packs, in `model.dtype` (or quantised: `teacher_quantization`). A relative "
        "path resolves next to the recipe.",
    )
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = _field(
        "forward_kl",
        "`distill` only: the divergence D of the student's next-token distribution Q from the "
        "teacher's P, both at `temperature`, per trained token. `forward_kl`: KL(P || Q), "
        "mass-covering (Hinton et al. 2015); `reverse_kl`: KL(Q || P), mode-seeking (Gu et al. 2024, "
        "MiniLLM); `jsd`: beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q "
        "(Agarwal et al. 2024, GKD).",
    )
    temperature: float = _field(
        1.0,
        "`distill` only: tau > 0; P and Q are the softmax of the logits over tau (above 1: softer, "
        "the teacher's ranking of unlikely tokens weighs more). D is not multiplied by tau^2.",
    )
    alpha: float = _field(
        0.0,
        "`distill` only: the weight of the student's own next-token cross-entropy on the data; the "
        "loss per trained token is (1 - alpha) D + alpha CE, normalised as `loss.normalization` says. "
        "In [0, 1]: 0 is pure distillation, 1 is `sft`.",
    )
    teacher_quantization: Literal["nf4"] | None = _field(
        None,
        "`distill` only: `nf4` loads the teacher's linear layers in 4 bits (bitsandbytes, CUDA), a "
        "quarter of its bf16 memory; null: the teacher in `model.dtype`.",
    )

    heads: int = _field(
        4,
        "`medusa` only: K, the number of heads. Head k (k = 1..K) reads the last hidden state at "
        "position t and predicts the token at t + k + 1, k places after the model's own next token; "
        "each head starts as a copy of the model's output layer. At most 16.",
    )
    head_layers: int = _field(
        1,
        "`medusa` only: residual blocks h + SiLU(A h + b) before each head's output layer (the "
        "paper's 1), each starting as the identity (A and b zero). 0: the output layer alone.",
    )
    head_weights: list[float] | None = _field(
        None,
        "`medusa` only: lambda_1..lambda_K, the weight of each head's loss in the step's loss "
        "sum_k lambda_k L_k (each L_k normalised over that head's own targets as `loss.normalization` "
        "says). null: 0.8^k (the paper's: farther heads are less accurate and weigh less); filled in "
        "when loaded. K numbers >= 0, at least one > 0.",
    )
    backbone: Literal["frozen", "lora", "full"] = _field(
        "frozen",
        "`medusa` only: what trains under the heads. `frozen`: the heads alone (Medusa-1); the model "
        "runs without gradient and stays bit for bit the starting one, and a run saves only the "
        "heads. `lora` (needs a `lora` section) or `full`: the model trains with them (Medusa-2), on "
        "its own next-token loss weighted by `lm_weight` beside the heads'.",
    )
    lm_weight: float = _field(
        1.0,
        "`medusa` with `backbone: lora` or `full`: the weight of the model's own next-token "
        "cross-entropy in the step's loss, lm_weight L_LM + sum_k lambda_k L_k. Medusa-2 keeps the "
        "model's answers by weighing the heads lightly against it (the paper's small lambda_0; e.g. "
        "`head_weights` of 0.2 x 0.8^k). >= 0; with `backbone: frozen` the model's loss is reported, "
        "never trained, and this key is refused.",
    )

    def __post_init__(self) -> None:
        for key, defaults in OBJECTIVE_DEFAULTS.items():
            if getattr(self, key) is None and self.name in defaults:
                setattr(self, key, defaults[self.name])
        if self.name == "medusa" and self.head_weights is None and type(self.heads) is int and 0 < self.heads <= 16:
            self.head_weights = [round(MEDUSA_DECAY ** k, 12) for k in range(1, self.heads + 1)]  # 0.64, not 0.6400000000000001

    @property
    def preference(self) -> bool:
        """Whether this objective trains on preference data (dpo, ipo, simpo, orpo, kto)."""
        return self.name in PREFERENCE_OBJECTIVES

    @property
    def units(self) -> str:
        """What one trained example is called: conversations (chat data), examples (kto) or pairs."""
        return "conversations" if not self.preference else "examples" if self.name == "kto" else "pairs"

    @property
    def uses_reference(self) -> bool:
        """Whether the step needs the frozen reference model's log-probabilities (`reference`)."""
        return self.reference_mode != "none"

    @property
    def reference_mode(self) -> str:
        """`precomputed`, `live` or `none`: `reference` with `auto` decided by the objective."""
        if self.reference != "auto":
            return self.reference
        return "precomputed" if self.name in REFERENCE_OBJECTIVES else "none"

    def check(self) -> list[tuple[str, str]]:
        problems = []
        unset = {f.name: f.default for f in dataclasses.fields(self)}
        for key, readers in OBJECTIVE_KEYS.items():
            value = getattr(self, key)
            if self.name not in readers and value != unset[key]:
                hint = " (orpo's weight is `orpo_lambda`)" if key == "beta" and self.name == "orpo" else ""
                problems.append((key, f"applies to {_names(readers, 'and')} only, and objective.name is "
                                 f"{self.name}: remove it{hint}"))
        reads = {key: self.name in readers for key, readers in OBJECTIVE_KEYS.items()}
        # Ranges are checked where the key applies (elsewhere it is refused above).
        if reads["beta"] and self.name == "distill":
            if self.loss == "jsd" and not 0.0 < self.beta < 1.0:
                problems.append(("beta", f"must lie in (0, 1), got {self.beta} (at 0 or 1 the mixture is one "
                                 "of the two distributions and the divergence is 0: use forward_kl or reverse_kl)"))
            elif self.loss != "jsd" and self.beta != OBJECTIVE_DEFAULTS["beta"]["distill"]:
                problems.append(("beta", f"applies to `loss: jsd` only, and objective.loss is {self.loss}: "
                                 "remove it"))
        elif reads["beta"] and not self.beta > 0:
            problems.append(("beta", f"must be > 0, got {self.beta}"))
        if self.name == "distill":
            if not self.teacher:
                problems.append(("teacher", "distill needs a teacher model: a local folder or a hub id"))
            if not self.temperature > 0:
                problems.append(("temperature", f"must be > 0, got {self.temperature}"))
            if not 0.0 <= self.alpha <= 1.0:
                problems.append(("alpha", f"must lie in [0, 1], got {self.alpha}"))
        if self.name == "medusa":
            problems += self._medusa_problems()
        if reads["label_smoothing"] and not 0.0 <= self.label_smoothing < 0.5:
            problems.append(("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing} "
                             "(at 0.5 a pair says nothing; past it the preference is reversed)"))
        if reads["gamma"] and self.gamma < 0:
            problems.append(("gamma", f"must be >= 0, got {self.gamma}"))
        if reads["orpo_lambda"] and not self.orpo_lambda > 0:
            problems.append(("orpo_lambda", f"must be > 0, got {self.orpo_lambda} (0 is `sft` on the chosen "
                             "answers: set objective.name: sft)"))
        for key in ("desirable_weight", "undesirable_weight"):
            if reads[key] and not getattr(self, key) > 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        if self.name in REFERENCE_OBJECTIVES and self.reference == "none":
            problems.append(("reference", f"{self.name} measures its reward against a reference model: use "
                             "`precomputed`, `live` (or `auto`), or a reference-free objective (simpo, orpo)"))
        if self.name in ("simpo", "orpo") and self.reference in ("precomputed", "live"):
            problems.append(("reference", f"{self.name} is reference-free and never reads a reference model: "
                             "use `none` (or `auto`), or an objective that uses one (dpo, ipo, kto)"))
        return problems


    def _medusa_problems(self) -> list[tuple[str, str]]:
        problems = []
        if not 1 <= self.heads <= 16:
            problems.append(("heads", f"must be 1 to 16, got {self.heads}"))
        if self.head_layers < 0:
            problems.append(("head_layers", f"must be >= 0, got {self.head_layers}"))
        weights = self.head_weights or []
        if self.head_weights is not None and 1 <= self.heads <= 16 and len(weights) != self.heads:
            problems.append(("head_weights", f"needs one weight per head ({self.heads}), got {len(weights)}"))
        elif self.head_weights is not None and (not all(math.isfinite(w) and w >= 0 for w in weights)
                                                or not any(w > 0 for w in weights)):
            problems.append(("head_weights", f"must be numbers >= 0, at least one > 0, got {self.head_weights}"))
        if not (math.isfinite(self.lm_weight) and self.lm_weight >= 0):
            problems.append(("lm_weight", f"must be >= 0, got {self.lm_weight}"))
        elif self.backbone == "frozen" and self.lm_weight != 1.0:
            problems.append(("lm_weight", "applies to `backbone: lora` or `full` only (a frozen model's loss "
                             "is reported, never trained): remove it, or train the backbone"))
        return problems

    @property
    def trains_backbone(self) -> bool:
        """Whether the model itself trains (every objective but Medusa heads over a frozen model)."""
        return not (self.name == "medusa" and self.backbone == "frozen")


def objective_data_problem(name: str, fmt: str) -> str | None:
    """Why the objective `name` cannot train on records of format `fmt`, or None when it can (`auto`
    is decided when the data is read: `check_objective_data`).

    KTO reads paired data too: each pair gives two examples, the chosen answer desirable and the
    rejected one undesirable (`ligertune.data.preference.unpair`).
    """
    if fmt == "auto":
        return None
    if name in CHAT_OBJECTIVES and fmt in PREFERENCE_FORMATS:
        return (f"{fmt} is preference data, which objective.name {name} does not read: use a chat format "
                f"({', '.join(SFT_FORMATS)}), or a preference objective (objective.name: dpo, ipo, simpo, "
                "orpo, kto)")
    if name in PREFERENCE_OBJECTIVES and fmt in SFT_FORMATS:
        return (f"{fmt} is chat data for supervised fine-tuning; objective.name {name} reads preference "
                f"data: use {_names(_formats_of(name))}, or objective.name: sft")
    if name in PAIRED_OBJECTIVES and fmt == "unpaired":
        return (f"unpaired answers (one answer with a label) cannot train {name}, which compares a chosen "
                "with a rejected answer: use paired data, or objective.name: kto")
    return None


def check_objective_data(objective: ObjectiveConfig, detected_format: str, *, where: str = "data") -> None:
    """Refuse, in one line, data detected (`data.format: auto`) as a format the objective cannot read;
    `where` names the source (a file, or `data.sources[1]`)."""
    problem = objective_data_problem(objective.name, detected_format)
    if problem is not None:
        raise UserError(f"{where}: the records are {problem}")


def _formats_of(name: str) -> tuple[str, ...]:
    if name in CHAT_OBJECTIVES:
        return SFT_FORMATS
    return PREFERENCE_FORMATS if name == "kto" else ("paired", "paired_conversations")


def _names(items: tuple[str, ...], conjunction: str = "or") -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


@dataclass
class LossConfig:
    """The training objective, defined over one optimizer step (see docs/loss.md)."""

    normalization: Literal["token", "sequence", "sum"] = _field(
        "token",
        "`token`: mean over every supervised token of the step; `sequence`: mean over conversations "
        "of each conversation's token mean; `sum`: plain sum.",
    )
    z_loss_weight: float = _field(0.0, "Weight of the z-loss (log Z)^2 term; 0 disables it.")
    label_smoothing: float = _field(0.0, "Label smoothing epsilon, in [0, 1).")
    ignore_index: int = _field(
        IGNORE_INDEX, f"Label value that carries no loss: {IGNORE_INDEX}, the value the data pipeline writes."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.z_loss_weight < 0:
            problems.append(("z_loss_weight", f"must be >= 0, got {self.z_loss_weight}"))
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(("label_smoothing", f"must be in [0, 1), got {self.label_smoothing}"))
        if self.ignore_index != IGNORE_INDEX:
            problems.append(("ignore_index", f"must be {IGNORE_INDEX}, the label the data pipeline gives "
                             f"untrained tokens; got {self.ignore_index}"))
        return problems


@dataclass
class LoraConfig:
    """LoRA adapters through peft; the base model is frozen (and still patched)."""

    r: int = _field(16, f"Adapter rank, 1 to {MAX_LORA_RANK}.")
    alpha: float = _field(32, "Scaling numerator: adapters are scaled by alpha / r.")
    dropout: float = _field(0.0, "Dropout on the adapter input.")
    target_modules: str | list[str] = _field(
        "all-linear", "Module names to adapt (each must match a module: `q_proj` matches every `...q_proj`), "
        "a pattern matched against whole names (`.*\\.[qv]_proj`), or `all-linear` (every linear layer but "
        "the output)."
    )
    bias: Literal["none", "all", "lora_only"] = _field("none", "Which biases are trained.")
    modules_to_save: list[str] | None = _field(None, "Modules trained in full besides the adapters.")
    use_rslora: bool = _field(False, "Rank-stabilized scaling alpha / sqrt(r).")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not 1 <= self.r <= MAX_LORA_RANK:
            problems.append(("r", f"must be in [1, {MAX_LORA_RANK}], got {self.r}"))
        if not 0.0 <= self.dropout < 1.0:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        return problems


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["adamw", "lion"] = _field(
        "adamw",
        "`adamw`: torch's AdamW (fused on CUDA). `lion`: the sign of a momentum (Chen et al. 2023), one "
        "float32 state per parameter where AdamW keeps two; wants a 3-10x smaller `lr` and 3-10x larger "
        "`weight_decay` than AdamW (see docs/optim.md).",
    )
    lr: float = _field(2e-5, "Peak learning rate.")
    betas: list[float] | None = _field(
        None, "(beta1, beta2); null: [0.9, 0.999] for AdamW, [0.9, 0.99] for Lion (filled in when loaded)."
    )
    eps: float = _field(1e-8, "AdamW epsilon (Lion has none).")
    weight_decay: float = _field(0.0, "Decoupled weight decay (not applied to norms and biases).")
    master_weights: bool = _field(
        True,
        "Step bfloat16/float16 trainable parameters through a float32 copy with float32 optimizer states, "
        "rounded into the parameter after each step: 4 more bytes per such parameter, and AdamW's "
        "states in 8 bytes instead of 4. `false`: torch's behaviour, where a bf16 weight does not move "
        "for steps below its spacing and AdamW's bf16 states lose `eps` and the second moment's decay "
        "(docs/optim.md). Float32 parameters (FSDP on CUDA, LoRA adapters without `kernels.lora`) are "
        "unaffected; LoRA adapters under `kernels.lora` have the model's dtype and get a master copy.",
    )
    schedule: Literal["cosine", "linear", "constant"] = _field("cosine", "Decay after warmup.")
    warmup_steps: int = _field(
        0, "Linear warmup from 0 to `lr`, in optimizer steps. A warmup longer than the run (a smoke run "
        "with `--max-steps`) is cut to the run's length, with a warning: the learning rate then rises "
        "over the whole run and never decays."
    )
    warmup_ratio: float = _field(
        0.0, "Linear warmup as a share of the run's optimizer steps, in [0, 1), rounded up to whole steps: "
        "it scales with `train.max_steps` (and `--max-steps`). Give this or `warmup_steps`, not both."
    )
    min_lr_ratio: float = _field(0.0, "Final learning rate as a fraction of `lr` (cosine, linear).")
    clip: Literal["global", "per_tensor"] = _field(
        "global",
        "Gradient clipping to `max_grad_norm`: `global` scales all gradients by one factor, from the "
        "norm over every trainable parameter (all shards); `per_tensor` scales each parameter tensor's "
        "gradient to at most that norm on its own.",
    )
    max_grad_norm: float | None = _field(1.0, "Clip the gradient norm (see `clip`) to this; null disables.")

    def __post_init__(self) -> None:
        if self.betas is None:
            self.betas = list(DEFAULT_BETAS.get(self.name, DEFAULT_BETAS["adamw"]))

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(("betas", f"must be two numbers in [0, 1), got {self.betas}"))
        if self.eps <= 0:
            problems.append(("eps", f"must be > 0, got {self.eps}"))
        if self.weight_decay < 0:
            problems.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if self.warmup_steps < 0:
            problems.append(("warmup_steps", f"must be >= 0, got {self.warmup_steps}"))
        if not 0.0 <= self.warmup_ratio < 1.0:
            problems.append(("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"))
        elif self.warmup_ratio > 0 and self.warmup_steps > 0:
            problems.append(("warmup_ratio", f"give `warmup_steps` ({self.warmup_steps}) or `warmup_ratio` "
                             f"({self.warmup_ratio:g}), not both: set the other to 0"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"))
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            problems.append(("max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm}"))
        return problems


@dataclass
class TrainConfig:
    """The loop: length, batching, evaluation and checkpoint cadence."""

    max_steps: int | None = _field(None, "Optimizer steps to run; overrides `epochs` when set.")
    epochs: float = _field(
        1.0, f"Passes over the training packs when `max_steps` is unset; at most {MAX_EPOCHS:g}."
    )
    micro_batch_size: int = _field(1, f"Packs per forward/backward; at most {MAX_MICRO_BATCH}.")
    grad_accum_steps: int = _field(1, f"Micro-batches per optimizer step; at most {MAX_GRAD_ACCUM:,}.")
    seed: int = _field(0, "Seed for weights, data order and dropout.")
    gradient_checkpointing: bool | Literal["auto"] = _field(
        False, "Recompute decoder layers' activations in backward to save memory: `true` every layer; "
        "`auto` as few layers as fit `memory_budget_gib`, measured on the first step (CUDA; on a CPU "
        "`auto` recomputes none)."
    )
    memory_budget_gib: float | None = _field(
        None, "With `gradient_checkpointing: auto`: the peak device memory (GiB) a step may use; "
        "null: 90% of the GPU's memory."
    )
    activation_offload: bool | Literal["auto"] = _field(
        "auto", "Park the inputs of checkpointed layers in pinned host memory between their forward and "
        "their recompute, the copies overlapped with compute: `auto` where it lets `gradient_checkpointing: "
        "auto` recompute fewer layers (CUDA); `true` always; `false` never."
    )
    device: Literal["auto", "cpu", "cuda"] = _field("auto", "`auto`: CUDA when available, else CPU.")
    precision: Literal["auto", "fp8"] = _field(
        "auto", "`auto`: every matmul in `model.dtype`. `fp8`: the decoder's linear layers multiply in "
        "float8 over bf16 weights: trained layers through ligertune's float8 layers "
        "(`kernels.float8_linear`) or torchao's (pip install 'ligertune[fp8]'), a frozen base (LoRA's) "
        "cast to float8 once; an NVIDIA GPU of compute capability 8.9 or newer (H100-class), one process "
        "(docs/fp8.md)."
    )
    fp8_scaling: Literal["tensorwise", "rowwise"] | None = _field(
        None, "With `precision: fp8` through torchao's layers (`kernels.float8_linear: false`, over weights "
        "that train): one scale per tensor (`tensorwise`, the fastest; null means it) or per row "
        "(`rowwise`). ligertune's float8 layers and a frozen base take a scale per token and per output "
        "channel, and refuse this key."
    )
    log_every: int = _field(1, "Write a metrics record every N optimizer steps.")
    eval_every: int | None = _field(None, "Evaluate on the held-out data every N steps (and at the end).")
    eval_at_start: bool = _field(True, "Evaluate once before the first step, as a baseline.")
    eval_max_conversations: int | None = _field(None, "Cap on held-out conversations per evaluation.")
    save_every: int | None = _field(
        None, "Save a checkpoint (model, optimizer, schedule, RNG, data position) every N steps, to "
        "resume from with `--resume`; the final model is always saved."
    )
    keep_checkpoints: int = _field(3, "Checkpoints kept; the oldest is removed once a new one is complete.")
    max_skipped_steps: int = _field(
        5, "Stop the run after this many consecutive steps skipped for a non-finite loss or gradient "
        "(or a loss spike, with `on_spike: skip`)."
    )
    spike_threshold: float | None = _field(
        6.0,
        "A step's loss is a spike when it exceeds the median of the last `spike_window` losses by more "
        "than this many robust standard deviations (1.4826 x their median absolute deviation); spikes "
        "go to `spikes.jsonl` with the conversations of the step. null disables the watch.",
    )
    spike_window: int = _field(
        32, "Finite step losses the spike watch compares with; it starts once it holds this many."
    )
    on_spike: Literal["log", "skip"] = _field(
        "log", "`log`: record the spike and apply the update; `skip`: record it and drop the update, "
        "like a non-finite step."
    )
    num_threads: int | None = _field(
        None, f"CPU threads for torch, at most {MAX_THREADS}; default: torch's own choice."
    )

    @property
    def torchao_scaling(self) -> str:
        """`fp8_scaling` for torchao's layers, its null default resolved: `tensorwise`."""
        return self.fp8_scaling or "tensorwise"

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every", "eval_every",
                    "save_every", "keep_checkpoints", "max_skipped_steps", "eval_max_conversations",
                    "num_threads"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append((key, f"must be >= 1, got {value}"))
        if not 0 < self.epochs <= MAX_EPOCHS:
            problems.append(("epochs", f"must be in (0, {MAX_EPOCHS:g}], got {self.epochs}"))
        if self.memory_budget_gib is not None:
            if self.memory_budget_gib <= 0:
                problems.append(("memory_budget_gib", f"must be > 0 or null, got {self.memory_budget_gib}"))
            elif self.gradient_checkpointing != "auto":
                problems.append(("memory_budget_gib", "applies to `gradient_checkpointing: auto` only; "
                                 f"gradient_checkpointing is {str(self.gradient_checkpointing).lower()}"))
        if self.activation_offload is True and self.gradient_checkpointing is False:
            problems.append(("activation_offload", "parks the inputs of checkpointed layers; "
                             "gradient_checkpointing is false"))
        if self.spike_threshold is not None and self.spike_threshold <= 0:
            problems.append(("spike_threshold", f"must be > 0 or null, got {self.spike_threshold}"))
        if self.spike_window < 3:
            problems.append(("spike_window", f"must be >= 3 (a median and its deviation), got {self.spike_window}"))
        for key, most in (("micro_batch_size", MAX_MICRO_BATCH), ("grad_accum_steps", MAX_GRAD_ACCUM),
                          ("num_threads", MAX_THREADS)):
            value = getattr(self, key)
            if value is not None and value > most:
                problems.append((key, f"must be <= {most}, got {value}"))
        return problems


@dataclass
class DistributedConfig:
    """Training on several processes (`torchrun` or `ligertune train --nproc N`); unused with one."""

    strategy: Literal["auto", "fsdp", "ddp"] = _field(
        "auto",
        "`fsdp`: FSDP2 shards every decoder layer and the rest of the model over the processes (bf16 "
        "compute over float32 trained weights on CUDA; a LoRA base stays bf16); `ddp`: each process holds the whole model; `auto`: fsdp.",
    )
    timeout_minutes: float = _field(
        10.0, "How long a collective waits for the other processes before the run fails."
    )
    reshard_after_forward: bool = _field(
        True, "With `fsdp`: free each decoder layer's gathered weights after its forward and gather them "
        "again for its backward (`true`), or keep them from the forward to the backward (`false`: one "
        "all-gather a layer a step instead of two, for the memory of the whole model's 16-bit weights on "
        "every process)."
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.timeout_minutes > 0:
            problems.append(("timeout_minutes", f"must be > 0, got {self.timeout_minutes}"))
        if not self.reshard_after_forward and self.strategy == "ddp":
            problems.append(("reshard_after_forward", "applies to strategy fsdp only (ddp holds the whole "
                             "model on every process): remove it, or use strategy: fsdp"))
        return problems


@dataclass
class OutputConfig:
    """Where the run writes its files."""

    dir: str = _field(
        "runs/ligertune", "Output directory: resolved recipe, metrics.jsonl, final/. It must be new, empty or "
        "a run's: neither the current folder nor one holding other files."
    )
    overwrite: bool = _field(
        False, "Replace a run already in `dir` (finished or not): it is moved to `DIR.previous` first."
    )
    report_to: list[str] = _field(
        doc="Also send the metrics to `tensorboard` (event files in `dir/tensorboard`) and/or `wandb` "
        "(offline unless logged in); each needs its extra: pip install 'ligertune[tensorboard]'.",
        factory=list,
    )
    plot: bool = _field(
        True, "At the end of the run, draw `loss.png` in `dir` from metrics.jsonl (with matplotlib, the "
        "`plot` extra; without it, nothing). `ligertune plot DIR` draws it at any time."
    )

    def check(self) -> list[tuple[str, str]]:
        if not self.dir.strip():
            return [("dir", "must name a folder for the run, e.g. runs/NAME; an empty name would write the "
                     "run's files among those of the current folder")]
        return []


@dataclass
class Recipe:
    """A whole fine-tuning recipe."""

    model: ModelConfig = _field(doc="The model.", factory=ModelConfig)
    data: DataConfig = _field(doc="The data.", factory=DataConfig)
    kernels: KernelsConfig = _field(doc="Kernel flags.", factory=KernelsConfig)
    objective: ObjectiveConfig = _field(doc="What a step optimises.", factory=ObjectiveConfig)
    loss: LossConfig = _field(doc="The loss.", factory=LossConfig)
    lora: LoraConfig | None = _field(None, "LoRA adapters; absent or null trains every weight.")
    optim: OptimConfig = _field(doc="Optimizer and schedule.", factory=OptimConfig)
    train: TrainConfig = _field(doc="The training loop.", factory=TrainConfig)
    distributed: DistributedConfig = _field(doc="Several processes.", factory=DistributedConfig)
    output: OutputConfig = _field(doc="Output files.", factory=OutputConfig)
    description: str | None = _field(None, "Free text shown by `ligertune recipes ls`.")

    @property
    def trains_model_weights(self) -> bool:
        """Whether the model's own weights train: no LoRA adapters, and not frozen under Medusa heads."""
        return self.lora is None and self.objective.trains_backbone

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.data.packing and self.model.attention != "packed":
            problems.append(("data.packing", "packing needs `model.attention: packed`; with "
                             f"{self.model.attention!r} packed conversations would attend to each other"))
        for key, fmt in self._data_formats():
            problem = objective_data_problem(self.objective.name, fmt)
            if problem is not None:
                problems.append((key, problem))
        if self.objective.name == "medusa":
            backbone = self.objective.backbone
            if backbone == "lora" and self.lora is None:
                problems.append(("objective.backbone", "lora trains LoRA adapters under the heads: add a `lora` "
                                 "section (e.g. `--set lora.r=16`), or use `frozen` or `full`"))
            elif backbone != "lora" and self.lora is not None:
                what = ("trains the heads alone over the model" if backbone == "frozen"
                        else "trains every weight of the model")
                problems.append(("lora", f"objective.backbone: {backbone} {what}, so LoRA adapters would "
                                 "not be used: remove the `lora` section, or set objective.backbone: lora"))
        if self.train.precision == "fp8":
            if self.model.quantization is not None:
                problems.append(("train.precision", f"fp8 multiplies bf16 weights in float8; the base is "
                                 f"quantized ({self.model.quantization}): drop one of the two"))
            if self.train.device == "cpu":
                problems.append(("train.precision", "fp8 needs an NVIDIA GPU of compute capability 8.9 or "
                                 "newer (H100-class); train.device is cpu"))
            if self.model.dtype not in ("auto", "bfloat16"):
                problems.append(("train.precision", f"fp8 runs over bf16 weights; model.dtype is "
                                 f"{self.model.dtype}: use bfloat16 (or auto)"))
            torchao_layers = self.trains_model_weights and not self.kernels.float8_linear
            if self.train.fp8_scaling is not None and not torchao_layers:
                problems.append(("train.fp8_scaling", "applies to torchao's float8 layers only "
                                 "(kernels.float8_linear: false, over weights that train); ligertune's layers "
                                 "and a frozen base scale each token and output channel: drop the key"))
            if self.kernels.mlp_chunk_tokens is not None and torchao_layers:
                problems.append(("kernels.mlp_chunk_tokens", "not with train.precision: fp8 through torchao's "
                                 "layers, which run compiled: set kernels.float8_linear: true (ligertune's "
                                 "float8 layers take both), or drop one of the two"))
        if self.kernels.float8_weight_grad and not (self.train.precision == "fp8" and self.kernels.float8_linear
                                                    and self.trains_model_weights):
            problems.append(("kernels.float8_weight_grad", "the weights' gradients of ligertune's float8 "
                             "layers: needs train.precision: fp8 and kernels.float8_linear: true, over weights "
                             "that train (a full fine-tune)"))
        if self.model.quantization is not None and self.lora is None:
            problems.append(("model.quantization", f"a quantized base ({self.model.quantization}) is frozen: "
                             "train LoRA adapters over it (add a `lora` section, e.g. `--set lora.r=16`)"))
        return problems

    def _data_formats(self) -> list[tuple[str, str]]:
        """(key path, format) of each format the data sets: `data.format`, and each source's own."""
        found = [("data.format", self.data.format)]
        found += [(f"data.sources[{i}].format", s.format) for i, s in enumerate(self.data.sources)
                  if s.format != "auto"]
        return found

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def in_model_dtype(self) -> Recipe:
        """This recipe with every matmul in `model.dtype` (`train.precision: auto`): what verify-loss
        checks and bench's peers run, whatever the recipe's precision."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, precision="auto"))

