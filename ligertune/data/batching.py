"""Micro-batches as tensors: packs flattened into one row for varlen attention, or padded rows.

`collate(packs)` lays the packs of a micro-batch end to end in ONE row of T tokens ([1, T]):
attention is confined to each conversation through `cu_seqlens` (varlen attention), so nothing
is padded and the packs need not be the same length. `collate_padded` builds the classic
[B, L] right-padded batch with one conversation per row: the reference that packed training
must agree with.

`collate_preferences(packs)` does the same for preference packs (`PreferencePack`): one row, the
attention of every pack as varlen segments with separate query and key ranges laid end to end, and
the scored (row, target, answer) triples numbered across the batch (`PreferenceBatch`).
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import torch

from ligertune.data.chat import IGNORE_INDEX, TokenizedExample
from ligertune.data.packing import Pack, shift_labels
from ligertune.data.preference import PreferencePack, varlen_segments
from ligertune.devices import to_device


_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.bool: "B"}


def host_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of Python ints (or bools), through the standard library's `array`: for the
    thousands of ints of a pack, a third of the time of `torch.tensor` over a list. The host collates
    a batch while the device may be waiting for it (the reference pass, evaluation)."""
    buffer = array.array(_ARRAY_TYPECODES[dtype], values)
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


@dataclass
class Batch:
    """One flattened micro-batch of n conversations and T tokens.

    `input_ids`, `targets`, `position_ids`: [1, T] int64; `cu_seqlens`: [n + 1] int32 (the
    conversation boundaries, from 0 to T); `max_seqlen`: the longest conversation; `seq_ids`: [T]
    int64, the conversation (0..n-1) each token belongs to.

    `to(device)` moves every tensor but `cu_seqlens`, which stays on the host: the attention kwargs
    are checked there and copied over without the host waiting on the device
    (`packed_attention_kwargs`).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def to(self, device: torch.device | str) -> Batch:
        return _to(self, device, keep_on_host=("cu_seqlens",))


@dataclass
class PaddedBatch:
    """B conversations, one per row, right-padded to the longest (L).

    `input_ids` (padding: `pad_id`), `targets` (padding: -100), `attention_mask` (1 on real tokens)
    and `position_ids` (0..n-1 per row, 0 on padding): [B, L] int64.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device | str) -> PaddedBatch:
        return _to(self, device)


def collate(packs: Sequence[Pack]) -> Batch:
    """The packs of one micro-batch concatenated into one row (see `Batch`)."""
    if not packs:
        raise ValueError("collate needs at least one pack")
    input_ids = host_tensor(itertools.chain.from_iterable(p.input_ids for p in packs))
    targets = host_tensor(itertools.chain.from_iterable(p.targets for p in packs))
    seq_lens = host_tensor(n for p in packs for n in p.seq_lens)
    starts = seq_lens.cumsum(0) - seq_lens
    seq_ids = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens)
    cu_seqlens = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = seq_lens.cumsum(0)
    return Batch(
        input_ids=input_ids.unsqueeze(0),
        targets=targets.unsqueeze(0),
        position_ids=(torch.arange(input_ids.numel()) - starts[seq_ids]).unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seq_lens.max()),
        seq_ids=seq_ids,
    )


def collate_padded(items: Sequence[TokenizedExample | Pack], pad_id: int) -> PaddedBatch:
    """One conversation per row, right-padded; targets shifted inside each conversation.

    Accepts examples or packs of one conversation (`packs_of_one`); a pack of several is refused,
    since a [B, L] attention mask cannot keep its conversations apart.
    """
    if not items:
        raise ValueError("collate_padded needs at least one item")
    rows: list[tuple[list[int], list[int]]] = []
    for item in items:
        if isinstance(item, Pack):
            if len(item.seq_lens) != 1:
                raise ValueError(
                    f"a padded row holds one conversation; this pack has {len(item.seq_lens)} "
                    "(use packs_of_one)"
                )
            rows.append((item.input_ids, item.targets))
        else:
            rows.append((item.input_ids, shift_labels(item.labels)))
    width = max(len(ids) for ids, _ in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.int64)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros(shape, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    for r, (ids, tgt) in enumerate(rows):
        n = len(ids)
        input_ids[r, :n] = host_tensor(ids)
        targets[r, :n] = host_tensor(tgt)
        attention_mask[r, :n] = 1
        position_ids[r, :n] = torch.arange(n)
    return PaddedBatch(input_ids, targets, attention_mask, position_ids)


@dataclass
class PreferenceBatch:
    """One flattened micro-batch of preference packs: U units, A answers, T tokens, S scored tokens.

    `input_ids`, `position_ids`: [1, T] int64 (positions continue from the prompt in every answer).
    `prompt_lens` [U] and `answer_lens` [U] (a tuple per unit): the layout of the units laid end to
    end, each its prompt then its answers (`data.preference.PreferenceUnit`).

    Attention (`data.preference.varlen_segments` of that layout): segment s has the query rows
    `cu_seqlens_q[s]:cu_seqlens_q[s+1]` (consecutive, from 0 to T) and the key rows
    `key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`, causal aligned to the end of the segment;
    `cu_seqlens_q`, `cu_seqlens_k`: int32; `key_index`: int64; `max_seqlen_q`, `max_seqlen_k`: the
    longest query and key ranges. `attention()` gives them as the keyword arguments of
    `CausalLMLoss.hidden_states`.

    Scores: the output of row `score_rows[i]` predicts token `score_targets[i]` of answer
    `score_answers[i]`: [S] int64, rows and answers numbered across the batch (a prompt's last row
    appears once per answer it predicts), in answer order.

    Per answer ([A]): `answer_unit`, the unit it belongs to (a pair's index in the batch, or a KTO
    example's); `answer_chosen` (bool), for a pair whether it is the chosen answer (a pair's answers
    are chosen then rejected), for a KTO example's completion its label (desirable), False for its
    mismatched completion; `answer_mismatched` (bool), True for a KTO example's mismatched completion
    (its second answer: another example's, scored for the KL estimate), False everywhere else;
    `answer_tokens`, how many of its tokens are scored. `kto` says which of the two the batch holds.

    `to(device)` moves every tensor but the attention boundaries (`cu_seqlens_q`, `cu_seqlens_k`,
    `key_index`) and `answer_tokens`, which stay on the host to be checked and indexed there and
    copied over without the host waiting on the device, as `Batch` keeps `cu_seqlens`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    prompt_lens: list[int]
    answer_lens: list[tuple[int, ...]]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    key_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    score_rows: torch.Tensor
    score_targets: torch.Tensor
    score_answers: torch.Tensor
    answer_unit: torch.Tensor
    answer_chosen: torch.Tensor
    answer_mismatched: torch.Tensor
    answer_tokens: torch.Tensor
    kto: bool
    reference_logps: torch.Tensor | None = None
    """[A] float32: the reference model's sum of log p of each answer (`PreferencePack.reference_logps`
    of every pack, laid end to end), or None when a pack has none (reference-free losses)."""
    kl_estimate: torch.Tensor | None = None
    """KTO: the step's reference point z0, a scalar on the device, set by the objective before the
    step's first forward (`Preference.prepare_step`); None until then, and for pairs."""

    @property
    def answer_pair(self) -> torch.Tensor:
        """The unit of each answer, the name `objectives.preference.PreferenceBatch` reads."""
        return self.answer_unit

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_answers(self) -> int:
        return self.answer_unit.numel()

    @property
    def num_units(self) -> int:
        return len(self.prompt_lens)

    def attention(self) -> dict:
        """The attention boundaries as `CausalLMLoss.hidden_states`' keyword arguments."""
        return {
            "cu_seqlens": self.cu_seqlens_q, "max_seqlen": self.max_seqlen_q,
            "cu_seqlens_k": self.cu_seqlens_k, "max_seqlen_k": self.max_seqlen_k,
            "key_index": self.key_index,
        }

    def to(self, device: torch.device | str) -> PreferenceBatch:
        return _to(self, device, keep_on_host=("cu_seqlens_q", "cu_seqlens_k", "key_index", "answer_tokens"))

    def kto_parts(self) -> tuple[PreferenceBatch, PreferenceBatch | None]:
        """KTO: (the completions, the mismatched completions): each unit as its prompt and its
        completion, and as its prompt and its mismatched completion (just its prompt where it has
        none, so that every rank runs as many forwards). The policy trains on the first and
        estimates KL on the second, and each costs only its own tokens. A batch of pairs: itself
        and None. Made once per batch: the step splits it, then counts what it trained."""
        if not self.kto:
            return self, None
        parts = self.__dict__.get("_kto_parts")  # not a field: `to` and `replace` make batches without it
        if parts is None:  # from the layout on the host: each unit's second answer is its mismatched one
            second = [a == 1 for lens in self.answer_lens for a in range(len(lens))]
            parts = self.__dict__["_kto_parts"] = (self.select_answers([not s for s in second]),
                                                   self.select_answers(second))
        return parts

    def select_answers(self, keep: Sequence[bool]) -> PreferenceBatch:
        """The batch with only the answers where `keep` [A] is True: every unit keeps its prompt,
        a dropped answer's tokens leave the row and the rest close up (a unit left with one answer
        is one causal segment). Rows and answers are numbered anew, the per-answer values (the
        reference's too) follow their answers, and `kl_estimate` is kept. The indices are made on
        the host from the layout and the scored counts, so the host does not wait on the device."""
        if len(keep) != self.num_answers:
            raise ValueError(f"select_answers: {len(keep)} flags for {self.num_answers} answers")
        scored = self.answer_tokens.tolist()  # on the host
        rows: list[int] = []  # the kept rows, in order
        scores: list[int] = []  # the kept score triples (they come in answer order)
        answers: list[int] = []
        answer_lens: list[tuple[int, ...]] = []
        row = answer = score = 0
        for p, lens in zip(self.prompt_lens, self.answer_lens):
            rows += range(row, row + p)
            row += p
            kept = []
            for n in lens:
                if keep[answer]:
                    rows += range(row, row + n)
                    scores += range(score, score + scored[answer])
                    answers.append(answer)
                    kept.append(n)
                row, score, answer = row + n, score + scored[answer], answer + 1
            answer_lens.append(tuple(kept))
        device = self.input_ids.device
        new_row = torch.full((self.num_tokens,), -1, dtype=torch.int64)
        new_row[rows] = torch.arange(len(rows))
        new_answer = torch.full((self.num_answers,), -1, dtype=torch.int64)
        new_answer[answers] = torch.arange(len(answers))
        rows_t, scores_t, answers_t, new_row, new_answer = (
            to_device(host_tensor(x) if isinstance(x, list) else x, device)
            for x in (rows, scores, answers, new_row, new_answer))
        segments = varlen_segments(self.prompt_lens, answer_lens)
        return PreferenceBatch(
            input_ids=self.input_ids[:, rows_t],
            position_ids=self.position_ids[:, rows_t],
            prompt_lens=list(self.prompt_lens),
            answer_lens=answer_lens,
            cu_seqlens_q=host_tensor(segments.cu_seqlens_q, torch.int32),
            cu_seqlens_k=host_tensor(segments.cu_seqlens_k, torch.int32),
            key_index=host_tensor(segments.key_index),
            max_seqlen_q=segments.max_seqlen_q,
            max_seqlen_k=segments.max_seqlen_k,
            score_rows=new_row[self.score_rows[scores_t]],
            score_targets=self.score_targets[scores_t],
            score_answers=new_answer[self.score_answers[scores_t]],
            answer_unit=self.answer_unit[answers_t],
            answer_chosen=self.answer_chosen[answers_t],
            answer_mismatched=self.answer_mismatched[answers_t],
            answer_tokens=self.answer_tokens[answers],
            kto=self.kto,
            reference_logps=None if self.reference_logps is None else self.reference_logps[answers_t],
            kl_estimate=self.kl_estimate,
        )


def collate_preferences(packs: Sequence[PreferencePack]) -> PreferenceBatch:
    """The preference packs of one micro-batch concatenated into one row (see `PreferenceBatch`).

    Each pack's rows and answers are offset by those of the packs before it. Packs of pairs and
    packs of KTO examples are not mixed.
    """
    if not packs:
        raise ValueError("collate_preferences needs at least one pack")
    kinds = {p.desirable is not None for p in packs}
    if len(kinds) > 1:
        raise ValueError("pairs and KTO examples go in separate batches: give one kind of pack")
    kto = kinds.pop()
    input_ids: list[int] = []
    position_ids: list[int] = []
    prompt_lens: list[int] = []
    answer_lens: list[tuple[int, ...]] = []
    rows: list[int] = []
    targets: list[int] = []
    answers: list[int] = []
    answer_unit: list[int] = []
    answer_chosen: list[bool] = []
    answer_mismatched: list[bool] = []
    for p in packs:
        row0, answer0 = len(input_ids), len(answer_unit)
        rows += [row0 + r for r in p.score_rows]
        targets += p.score_targets
        answers += [answer0 + a for a in p.score_answers]
        for u, lens in enumerate(p.answer_lens):
            # Answer 0: a pair's chosen answer, a KTO example's completion (chosen if desirable);
            # answer 1: the rejected answer, the mismatched completion.
            answer_unit += [len(prompt_lens) + u] * len(lens)
            answer_chosen += [a == 0 and (p.desirable[u] if kto else True) for a in range(len(lens))]
            answer_mismatched += [kto and a == 1 for a in range(len(lens))]
        prompt_lens += p.prompt_lens
        answer_lens += p.answer_lens
        input_ids += p.input_ids
        position_ids += p.position_ids

    score_answers = host_tensor(answers)
    with_reference = [p.reference_logps is not None for p in packs]
    if any(with_reference) and not all(with_reference):
        raise ValueError("some packs carry reference log-probabilities and some do not")
    reference = None
    if all(with_reference):
        reference = torch.tensor([x for p in packs for x in p.reference_logps], dtype=torch.float32)
        if reference.numel() != len(answer_unit):
            raise ValueError(f"the packs carry {reference.numel()} reference log-probabilities for "
                             f"{len(answer_unit)} answers")
    segments = varlen_segments(prompt_lens, answer_lens)
    return PreferenceBatch(
        input_ids=host_tensor(input_ids).unsqueeze(0),
        position_ids=host_tensor(position_ids).unsqueeze(0),
        prompt_lens=prompt_lens,
        answer_lens=answer_lens,
        cu_seqlens_q=host_tensor(segments.cu_seqlens_q, torch.int32),
        cu_seqlens_k=host_tensor(segments.cu_seqlens_k, torch.int32),
        key_index=host_tensor(segments.key_index),
        max_seqlen_q=segments.max_seqlen_q,
        max_seqlen_k=segments.max_seqlen_k,
        score_rows=host_tensor(rows),
        score_targets=host_tensor(targets),
        score_answers=score_answers,
        answer_unit=host_tensor(answer_unit),
        answer_chosen=host_tensor(answer_chosen, torch.bool),
        answer_mismatched=host_tensor(answer_mismatched, torch.bool),
        answer_tokens=torch.bincount(score_answers, minlength=len(answer_unit)),
        kto=kto,
        reference_logps=reference,
    )


def _to(batch, device: torch.device | str, keep_on_host: tuple[str, ...] = ()):
    """The batch with its tensors (but those named in `keep_on_host`) on `device`, without waiting."""
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        movable = isinstance(value, torch.Tensor) and f.name not in keep_on_host
        moved[f.name] = to_device(value, device) if movable else value
    return type(batch)(**moved)
