"""Preference packs through a real model: every answer's log-probs are those of its own conversation.

A batch of packed pairs (or KTO examples) runs once, with packed attention over separate query and
key ranges; the oracle runs each `prompt + answer` alone through `transformers`' sdpa attention
with the same weights. In float64 the per-token log-probs and the gradients of a weighted sum agree
to 1e-10. Packing the same units as plain conversations (each unit one causal block, the SFT
boundaries) lets the rejected answer see the chosen one: that comparison fails, so this one can.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, make_model

from ligertune.data import IGNORE_INDEX, KTOExample, PreferenceExample, collate_preferences
from ligertune.data.preference import make_preference_pack
from ligertune.models import CausalLMLoss
from ligertune.models.attention import end_aligned_causal_mask, preference_attention_kwargs

TOL = dict(rtol=0.0, atol=1e-10)


def float64_model(family: str, attention: str = "packed"):
    """The tiny model in float64 throughout. `transformers`' RMSNorm computes in float32 whatever its
    input, so its backward rounds every gradient to float32; the sums of those rounded gradients
    differ in the last float32 digits once a prompt serves two answers in one pass (about 1e-7 here).
    Its norms run in float64 instead (same formula), so that what is compared is the attention."""
    model = make_model(family, attention=attention, dtype=torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            assert module.weight.dtype == torch.float64 and "Gemma" not in type(module).__name__
            module.forward = lambda x, m=module: m.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
    return model


def make_units(shapes, kto: bool, seed: int = 0):
    """Units of random tokens: `shapes` are (prompt, answer lengths...); every other answer token
    from the second on is scored, so unscored answer tokens are exercised too."""
    gen = torch.Generator().manual_seed(seed)
    units = []
    for k, (p, *lens) in enumerate(shapes):
        ids = torch.randint(0, VOCAB, (p + sum(lens),), generator=gen).tolist()
        labels = [IGNORE_INDEX] * p
        for n in lens:
            start = len(labels)
            labels += [ids[start + i] if i == 0 or i % 3 != 1 else IGNORE_INDEX for i in range(n)]
        if kto:
            units.append(KTOExample(input_ids=ids, labels=labels, prompt_len=p, answer_lens=tuple(lens),
                                    desirable=k % 2 == 0))
        else:
            units.append(PreferenceExample(input_ids=ids, labels=labels, prompt_len=p,
                                           answer_lens=tuple(lens)))
    return units


PAIR_SHAPES = [(5, 4, 3), (3, 2, 6), (7, 5, 5), (2, 3, 1), (4, 6, 2)]
KTO_SHAPES = [(5, 4), (3, 6), (6, 2), (2, 5)]
CASES = {
    "pairs-3+2": (PAIR_SHAPES, False, [[0, 1, 2], [3, 4]]),
    "pairs-2+2+1": (PAIR_SHAPES, False, [[4, 2], [1, 3], [0]]),
    "kto-3+1": (KTO_SHAPES, True, [[0, 1, 3], [2]]),
}


def conversations(units, groups):
    """Every answer in batch order as (prompt + answer ids, labels)."""
    out = []
    for g in groups:
        for i in g:
            u = units[i]
            for start, end in u.answer_spans:
                out.append((u.input_ids[:u.prompt_len] + u.input_ids[start:end],
                            u.labels[:u.prompt_len] + u.labels[start:end]))
    return out


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, rows, targets) -> torch.Tensor:
    logits = hidden[rows].double() @ weight.double().T
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def alone_logprobs(model, answers):
    """Each answer's scored-token log-probs, its conversation run alone (`transformers`' sdpa attention)."""
    weight = model.lm_head.weight
    out = []
    for ids, labels in answers:
        hidden = model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]
                             ).last_hidden_state[0]
        scored = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        rows = torch.tensor([i - 1 for i in scored])
        out.append(token_logprobs(hidden, weight, rows, torch.tensor([labels[i] for i in scored])))
    return out


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_answers_score_as_each_conversation_alone(family, case):
    shapes, kto, groups = CASES[case]
    units = make_units(shapes, kto)
    batch = collate_preferences([make_preference_pack(units, g) for g in groups])
    head = CausalLMLoss(float64_model(family))
    reference = float64_model(family, attention="sdpa")

    hidden = head.hidden_states(batch.input_ids, batch.position_ids, **batch.attention())
    assert hidden.shape == (batch.num_tokens, 64)
    weight, bias = head.output_projection()
    assert bias is None
    packed = token_logprobs(hidden, weight, batch.score_rows, batch.score_targets)
    expected = alone_logprobs(reference, conversations(units, groups))
    assert len(expected) == batch.num_answers
    for a, want in enumerate(expected):
        torch.testing.assert_close(packed[batch.score_answers == a], want, **TOL)

    # Gradients of a weighted sum of every scored log-prob, against the same sum over the answers alone.
    w = torch.rand(packed.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (w * packed).sum().backward()
    alone = torch.cat(expected)  # batch order: answers in order, tokens in order within each
    (w * alone).sum().backward()
    ref_params = dict(reference.named_parameters())
    for name, p in head.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@torch.no_grad()
def test_sft_boundaries_let_the_rejected_answer_see_the_chosen_one():
    """Each unit as one causal block (what SFT packing would do) is wrong for every rejected answer:
    the comparison above tells the two apart."""
    units = make_units(PAIR_SHAPES[:3], kto=False)
    batch = collate_preferences([make_preference_pack(units, [0, 1, 2])])
    head = CausalLMLoss(float64_model("llama"))
    weight, _ = head.output_projection()
    good = token_logprobs(head.hidden_states(batch.input_ids, batch.position_ids, **batch.attention()),
                          weight, batch.score_rows, batch.score_targets)
    unit_bounds = torch.tensor([0, *torch.tensor([len(u) for u in units]).cumsum(0).tolist()],
                               dtype=torch.int32)
    blocks = token_logprobs(head.hidden_states(batch.input_ids, batch.position_ids, cu_seqlens=unit_bounds),
                            weight, batch.score_rows, batch.score_targets)
    chosen = batch.answer_chosen[batch.score_answers]
    torch.testing.assert_close(blocks[chosen], good[chosen], **TOL)
    # A rejected answer's first token is predicted from the prompt's last row, the same either way; every
    # later one comes from a rejected row, which under the SFT boundaries sees the chosen tokens: all wrong.
    prompt_ends = torch.tensor([0, *[len(u) for u in units[:-1]]]).cumsum(0) + torch.tensor(
        [u.prompt_len - 1 for u in units])
    from_prompt = torch.isin(batch.score_rows, prompt_ends)
    torch.testing.assert_close(blocks[from_prompt], good[from_prompt], **TOL)
    later = ~chosen & ~from_prompt
    assert later.sum() >= 3 and (blocks[later] - good[later]).abs().min() > 1e-6


def test_end_aligned_mask_is_each_packs_attention():
    """The mask over queries x gathered keys, scattered back to rows, is `PreferencePack.attention_mask`."""
    units = make_units(PAIR_SHAPES, kto=False)
    packs = [make_preference_pack(units, [0, 3]), make_preference_pack(units, [1, 2, 4])]
    batch = collate_preferences(packs)
    mask = end_aligned_causal_mask(batch.cu_seqlens_q, batch.cu_seqlens_k)[0, 0]
    assert mask.shape == (batch.num_tokens, batch.key_index.numel())
    dense = torch.zeros(batch.num_tokens, batch.num_tokens, dtype=torch.bool)
    for j, k in enumerate(batch.key_index.tolist()):
        dense[:, k] |= mask[:, j]
    assert torch.equal(dense, torch.block_diag(*[p.attention_mask() for p in packs]))
    # A window of 2: the query sees itself and the key just before it (by position) only.
    windowed = end_aligned_causal_mask(batch.cu_seqlens_q, batch.cu_seqlens_k, sliding_window=2)[0, 0]
    assert torch.equal(windowed.sum(1), torch.minimum(mask.sum(1), torch.tensor(2)))


def test_preference_kwargs_are_checked():
    cu_q, cu_k, keys = [0, 3, 5], [0, 3, 8], [0, 1, 2, 0, 1, 2, 3, 4]
    kwargs = preference_attention_kwargs(cu_q, cu_k, keys, total_tokens=5)
    assert kwargs["max_length_q"] == 3 and kwargs["max_length_k"] == 5
    assert kwargs["cu_seq_lens_q"].dtype == kwargs["cu_seq_lens_k"].dtype == torch.int32
    with pytest.raises(ValueError, match="every one of the 6 tokens"):
        preference_attention_kwargs(cu_q, cu_k, keys, total_tokens=6)
    with pytest.raises(ValueError, match="segment 1 has 2 queries and only 1 keys"):
        preference_attention_kwargs(cu_q, [0, 3, 4], keys[:4], total_tokens=5)
    with pytest.raises(ValueError, match="key_index must name rows"):
        preference_attention_kwargs(cu_q, cu_k, keys[:-1] + [5], total_tokens=5)
    with pytest.raises(ValueError, match="max_seqlen_k=4"):
        preference_attention_kwargs(cu_q, cu_k, keys, 3, 4, total_tokens=5)
    with pytest.raises(ValueError, match="cu_seqlens_k ends at 8"):
        preference_attention_kwargs(cu_q, cu_k, keys[:-1], total_tokens=5)


def test_key_index_needs_packed_attention_and_no_mask():
    units = make_units(PAIR_SHAPES[:1], kto=False)
    batch = collate_preferences([make_preference_pack(units, [0])])
    with pytest.raises(ValueError, match="ligertune_packed"):
        CausalLMLoss(make_model("llama", attention="eager")).hidden_states(
            batch.input_ids, batch.position_ids, **batch.attention())
    with pytest.raises(ValueError, match="no attention_mask"):
        CausalLMLoss(make_model("llama")).hidden_states(
            batch.input_ids, batch.position_ids, attention_mask=torch.ones_like(batch.input_ids),
            **batch.attention())
