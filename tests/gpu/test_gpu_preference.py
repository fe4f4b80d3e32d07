"""Preference packs on CUDA in bf16: every answer's sum of log p through the packed layout (prompt once,
then the chosen and the rejected answer, the rejected one attending to the prompt and itself) equals
that of its own conversation run alone. tests/models/test_preference_attention.py checks the same in
float64 on the CPU, where only the masked path runs; here the varlen FlashAttention path with separate
query and key ranges runs, and the SDPA path with the end-aligned mask beside it.

Tolerance: the kernel rule of tests/gpu (gpu_testing.py), error against the float32 oracle within
twice that of the bf16 oracle (each conversation alone in bf16), with a floor of its own. A sum of
hundreds of log p is about -n log V whatever the attention, so its relative error is small even when
the attention is wrong: the rule's 2e-3 floor would pass a rejected answer that sees the chosen one.
Here the floor is 5e-5: the bf16 oracles' errors measured 5e-6 to 2e-5 (H100), and the packed paths
up to 3.2 times theirs where the oracle's was smallest (mistral-w200: 2.2e-5 against 6.7e-6, the
attention outputs themselves matching the float32 mask path to bf16 rounding, 2.0e-3, on both
paths). That mistake, the SFT boundaries (each unit one causal block), is measured in the same way
and must miss the limit by five times (it measured 4.1e-4 on the rejected answers, eight times the
floor), so the comparison can fail.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from ligertune.data import IGNORE_INDEX, KTOExample, PreferenceExample, collate_preferences
from ligertune.data.preference import make_preference_pack
from ligertune.models import CausalLMLoss, build_model
from ligertune.models import attention as attention_module
from ligertune.numerics import relative_error
from ligertune.objectives.reference import score_answers
from ligertune.recipe import ModelConfig

pytestmark = pytest.mark.gpu

VOCAB = 3001
SMALL = {
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "llama": {"model_type": "llama", **SMALL},
    # A window shorter than most prompts: the varlen kernel's window over gathered keys must follow positions.
    "mistral-w200": {"model_type": "mistral", **SMALL, "sliding_window": 200},
}
FLOOR = 5e-5

# (prompt, answer lengths...) of each unit, odd lengths and a one-token answer among them, and the packs
# of one micro-batch (unit indices)
PAIRS = [(301, 120, 75), (57, 700, 13), (1200, 33, 250), (5, 1, 64), (640, 211, 211)]
KTO = [(301, 120), (57, 700), (1200, 250), (5, 1)]
KTO_MISMATCHED = [(301, 120, 75), (57, 700, 13), (1200, 33, 250), (5, 1, 64)]  # completion, mismatched
CASES = {
    "pairs-3+2": (PAIRS, False, [[0, 1, 2], [3, 4]]),
    "pairs-1+1+1+1+1": (PAIRS, False, [[4], [3], [2], [1], [0]]),
    "kto-2+2": (KTO, True, [[0, 2], [1, 3]]),
}


def make_units(shapes, kto: bool, seed: int = 0):
    """Random tokens; every answer token scored but every seventh (unscored answer tokens exist too)."""
    rng = random.Random(seed)
    units = []
    for k, (p, *lens) in enumerate(shapes):
        ids = [rng.randrange(VOCAB) for _ in range(p + sum(lens))]
        labels = [IGNORE_INDEX] * p
        for n in lens:
            start = len(labels)
            labels += [ids[start + i] if i % 7 != 3 else IGNORE_INDEX for i in range(n)]
        fields = {"input_ids": ids, "labels": labels, "prompt_len": p, "answer_lens": tuple(lens)}
        units.append(KTOExample(**fields, desirable=k % 2 == 0) if kto else PreferenceExample(**fields))
    return units


def models(family: str):
    """The packed-attention model in bf16 on CUDA, and `transformers`' sdpa model with the same (bf16)
    weights in bf16 and in float32: the oracles."""
    config = FAMILIES[family]
    packed = build_model(ModelConfig(config=dict(config), attention="packed"), device="cuda",
                         dtype=torch.bfloat16, seed=0)
    alone = build_model(ModelConfig(config=dict(config), attention="sdpa"), device="cuda",
                        dtype=torch.bfloat16, seed=1)
    alone.load_state_dict(packed.state_dict())
    return packed.train(), alone.train(), copy.deepcopy(alone).float().train()


def alone_sums(model, units, groups) -> torch.Tensor:
    """Each answer's sum of log p over its scored tokens, `prompt + answer` run alone, in batch order;
    the logits in float32, as the fused kernel computes them."""
    weight = model.lm_head.weight.float()
    sums = []
    for unit in (units[i] for g in groups for i in g):
        p = unit.prompt_len
        for start, end in unit.answer_spans:
            ids = unit.input_ids[:p] + unit.input_ids[start:end]
            labels = unit.labels[start:end]
            positions = torch.arange(len(ids), device="cuda")[None]
            hidden = model.model(input_ids=torch.tensor([ids], device="cuda"),
                                 position_ids=positions).last_hidden_state[0]
            scored = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
            rows = torch.tensor([p - 1 + i for i in scored], device="cuda")
            targets = torch.tensor([labels[i] for i in scored], device="cuda")
            logp = torch.log_softmax(hidden[rows].float() @ weight.T, dim=-1).gather(1, targets[:, None])
            sums.append(logp.sum())
    return torch.stack(sums)


def packed_sums(head: CausalLMLoss, batch) -> torch.Tensor:
    out = head(batch.input_ids, batch.position_ids, score_rows=batch.score_rows,
               score_targets=batch.score_targets, score_answers=batch.score_answers,
               num_answers=batch.num_answers, **batch.attention())
    return out.logp_sum


def sums_and_grads(model, sums_of, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums, and the gradient of `weights . sums` over every parameter as one float32 vector."""
    model.zero_grad(set_to_none=True)
    sums = sums_of()
    (weights.to(sums.dtype) * sums).sum().backward()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return sums.detach().float(), grads


def count_varlen_calls(monkeypatch) -> list[int]:
    calls = []
    varlen = attention_module._varlen_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(attention_module, "_varlen_attention", counted)
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_packed_answers_score_as_each_conversation_alone(family, case, monkeypatch):
    shapes, kto, groups = CASES[case]
    units = make_units(shapes, kto)
    batch = collate_preferences([make_preference_pack(units, g) for g in groups]).to("cuda")
    packed, alone, precise = models(family)
    head = CausalLMLoss(packed)
    weights = torch.rand(batch.num_answers, generator=torch.Generator().manual_seed(1)).cuda()

    want = sums_and_grads(precise, lambda: alone_sums(precise, units, groups), weights)
    same = sums_and_grads(alone, lambda: alone_sums(alone, units, groups), weights)
    with monkeypatch.context() as m:
        calls = count_varlen_calls(m)
        varlen = sums_and_grads(packed, lambda: packed_sums(head, batch), weights)
    assert len(calls) == SMALL["num_hidden_layers"], "the varlen path did not run"
    with monkeypatch.context() as m:
        m.setattr(attention_module, "_varlen_applies", lambda *args, **kwargs: False)
        calls = count_varlen_calls(m)
        masked = sums_and_grads(packed, lambda: packed_sums(head, batch), weights)
    assert not calls

    failures = []
    for what, i in (("sums", 0), ("gradients", 1)):
        yardstick = relative_error(same[i], want[i])
        limit = max(FLOOR, 2.0 * yardstick)
        for path, got in (("varlen", varlen), ("masked", masked)):
            error = relative_error(got[i], want[i])
            if not error <= limit:
                failures.append(f"{path} {what}: error {error:.2e} over {limit:.2e} "
                                f"(the bf16 oracle's {yardstick:.2e})")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_kto_parts_score_as_each_conversation_alone(family):
    """KTO's two passes on the GPU: each unit as its prompt and completion, and as its prompt and
    mismatched completion (`kto_parts`, indices made on the host and gathered on the device), give
    every answer's sum as that conversation run alone, within the rule above."""
    units = make_units(KTO_MISMATCHED, kto=True)
    groups = [[0, 2], [1, 3]]
    batch = collate_preferences([make_preference_pack(units, g) for g in groups]).to("cuda")
    packed, alone, precise = models(family)
    want = alone_sums(precise, units, groups).float()
    limit = max(FLOOR, 2.0 * relative_error(alone_sums(alone, units, groups).float(), want))
    engine = CausalLMLoss(packed)
    completions, mismatched = (score_answers(engine, part) for part in batch.kto_parts())
    got = torch.stack([completions, mismatched], dim=1).reshape(-1)  # each unit's completion, then its mismatched one
    assert relative_error(got, want) <= limit


@torch.no_grad()
def test_sft_boundaries_fail_the_same_comparison():
    """Each pair as one causal block lets the rejected answer see the chosen one: the rejected answers'
    sums miss the limit above by far (measured over the rejected answers alone, as is the packed layout
    that passes it), so that comparison tells the two layouts apart at this tolerance."""
    units = make_units(PAIRS, kto=False)
    groups = CASES["pairs-3+2"][2]
    batch = collate_preferences([make_preference_pack(units, g) for g in groups]).to("cuda")
    rejected = ~batch.answer_chosen
    packed, alone, precise = models("llama")
    want = alone_sums(precise, units, groups)[rejected]
    limit = max(FLOOR, 2.0 * relative_error(alone_sums(alone, units, groups)[rejected], want))
    head = CausalLMLoss(packed)
    right = relative_error(packed_sums(head, batch)[rejected], want)

    unit_ends = torch.tensor([len(units[i]) for g in groups for i in g]).cumsum(0).tolist()
    blocks = torch.tensor([0, *unit_ends], dtype=torch.int32)
    hidden = head.hidden_states(batch.input_ids, batch.position_ids, cu_seqlens=blocks)
    weight = packed.lm_head.weight.float()
    logp = torch.log_softmax(hidden[batch.score_rows].float() @ weight.T, dim=-1)
    logp = logp.gather(1, batch.score_targets[:, None])[:, 0]
    wrong = torch.zeros(batch.num_answers, device="cuda").index_add(0, batch.score_answers, logp)
    wrong = relative_error(wrong[rejected], want)
    assert right <= limit < wrong / 5, f"packed {right:.2e}, SFT boundaries {wrong:.2e}, limit {limit:.2e}"
