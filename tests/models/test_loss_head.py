"""The loss head: the same loss and gradients as transformers' logits + cross-entropy, fused or not."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model

import ligertune.models.head as head_module
from ligertune import kernels
from ligertune.kernels import LossOptions
from ligertune.models import CausalLMLoss, causal_lm_loss_from_logits, packed_attention_kwargs
from ligertune.recipe import KernelsConfig, LossConfig
from ligertune.training.build import build_head


def _lora(model, target_modules="all-linear"):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # seeded adapters, with B nonzero (it starts at zero) so that they act
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(std=0.1, generator=gen)
    return model


def _trainable_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


# --------------------------------------------------------------------------------------------------
# the plain formula


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["eps0", "eps0.1"])
def test_plain_formula_is_torch_cross_entropy(label_smoothing, reduction):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 123, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 123, (37,), generator=gen)
    targets[::4] = -100
    options = LossOptions(label_smoothing=label_smoothing, reduction=reduction)
    got = causal_lm_loss_from_logits(logits, targets, options=options)
    want = F.cross_entropy(logits, targets, label_smoothing=label_smoothing, reduction=reduction)
    if reduction == "none":
        want = want.float()
    torch.testing.assert_close(got.loss, want.float(), rtol=1e-6, atol=1e-6)
    supervised = targets != -100
    assert got.n_tokens.item() == supervised.sum().item()
    assert got.n_correct.item() == (supervised & (logits.argmax(-1) == targets)).sum().item()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"z_loss_weight": 1e-3}, id="zloss"),
        pytest.param({"softcap": 3.0}, id="softcap"),
        pytest.param({"label_smoothing": 0.2, "z_loss_weight": 1e-2, "softcap": 5.0, "weights": True,
                      "reduction": "sum"}, id="every-option"),
        pytest.param({"weights": True, "reduction": "none"}, id="weights-none"),
    ],
)
def test_plain_formula_matches_the_fused_kernel(options):
    options = dict(options)
    gen = torch.Generator().manual_seed(1)
    n, h, v = 29, 48, 131
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64).mul_(0.2).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::3] = -100
    token_weights = None
    if options.pop("weights", False):
        token_weights = torch.rand(n, generator=gen, dtype=torch.float64)
    options = LossOptions(**options)

    fused = kernels.fused_linear_cross_entropy(hidden, weight, targets, token_weights=token_weights,
                                               options=options)
    fused_grads = torch.autograd.grad(fused.loss.sum(), (hidden, weight))
    plain = causal_lm_loss_from_logits(hidden @ weight.T, targets, token_weights=token_weights,
                                       options=options)
    plain_grads = torch.autograd.grad(plain.loss.sum(), (hidden, weight))

    for name in ("loss", "z_loss"):
        got, want = getattr(plain, name).float(), getattr(fused, name).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (plain.n_correct.item(), plain.n_tokens.item()) == (fused.n_correct.item(), fused.n_tokens.item())
    for got, want in zip(plain_grads, fused_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# the head on real models


def hf_reference(model, batch, **kwargs):
    """transformers' forward (logits from its lm_head) + torch cross-entropy, summed."""
    logits = model(batch.input_ids, position_ids=batch.position_ids,
                   **packed_attention_kwargs(batch.cu_seqlens)).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="sum", **kwargs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("llama", {}, False), id="llama"),
        pytest.param(("qwen2", {"tie_word_embeddings": True}, False), id="qwen2-tied"),
        pytest.param(("llama", {}, True), id="llama-lora"),
        pytest.param(("gemma", {"tie_word_embeddings": True}, True), id="gemma-tied-lora"),
    ],
)
def test_head_equals_hf_logits_and_cross_entropy(case, fused, packed_batch):
    family, fields, lora = case
    models = []
    for _ in range(2):
        model = make_model(family, **fields)
        models.append(_lora(model) if lora else model)
    reference, model = models
    if fields.get("tie_word_embeddings"):
        base = model.get_base_model() if lora else model
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight

    loss_ref = hf_reference(reference, packed_batch, label_smoothing=0.1)
    loss_ref.backward()
    head = CausalLMLoss(model, fused=fused, options=LossOptions(label_smoothing=0.1, reduction="sum"))
    assert head.fused == fused
    out = head(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
               cu_seqlens=packed_batch.cu_seqlens)
    out.loss.backward()

    torch.testing.assert_close(out.loss, loss_ref, rtol=1e-5, atol=1e-4)
    assert out.n_tokens.item() == (packed_batch.targets != -100).sum().item()
    want, got = _trainable_grads(reference), _trainable_grads(model)
    assert want.keys() == got.keys()
    if lora:
        assert all("lora_" in name for name in got) and len(got) == 2 * 7 * 2
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_token_weights_and_reductions(packed_batch):
    model = make_model("mistral")
    heads = {r: CausalLMLoss(model, options=LossOptions(z_loss_weight=1e-3, reduction=r))
             for r in ("sum", "mean", "none")}
    weights = torch.rand(packed_batch.targets.shape, generator=torch.Generator().manual_seed(0))
    args = (packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets)
    with torch.no_grad():
        per_token = heads["none"](*args, weights, cu_seqlens=packed_batch.cu_seqlens)
        total = heads["sum"](*args, weights, cu_seqlens=packed_batch.cu_seqlens)
        mean = heads["mean"](*args, cu_seqlens=packed_batch.cu_seqlens)
        unweighted = heads["none"](*args, cu_seqlens=packed_batch.cu_seqlens)
    assert per_token.loss.shape == (packed_batch.targets.numel(),)
    torch.testing.assert_close(total.loss, per_token.loss.sum())
    torch.testing.assert_close(total.z_loss, per_token.z_loss.sum())
    assert total.z_loss > 0
    torch.testing.assert_close(mean.loss, unweighted.loss.sum() / unweighted.n_tokens)


def test_gemma2_final_logit_softcapping(packed_batch):
    """Gemma 2 caps its logits; the head applies the same cap, fused and unfused."""
    reference = make_model("gemma2", final_logit_softcapping=2.0)
    model = make_model("gemma2", final_logit_softcapping=2.0)
    loss_ref = hf_reference(reference, packed_batch)
    for fused in (True, False):
        out = CausalLMLoss(model, fused=fused)(packed_batch.input_ids, packed_batch.position_ids,
                                               packed_batch.targets, cu_seqlens=packed_batch.cu_seqlens)
        torch.testing.assert_close(out.loss, loss_ref, rtol=1e-5, atol=1e-4)
    # Without the cap the loss is another number: the cap is really applied.
    model.config.final_logit_softcapping = None
    uncapped = CausalLMLoss(model)(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
                                   cu_seqlens=packed_batch.cu_seqlens)
    assert abs(uncapped.loss.item() - loss_ref.item()) > 1e-2


def test_default_options_sum_and_carry_the_model_softcap():
    model = make_model("gemma2", final_logit_softcapping=2.0)
    assert CausalLMLoss(model).options == LossOptions(reduction="sum", softcap=2.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=2.0"):
        CausalLMLoss(model, options=LossOptions(reduction="sum"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_build_head_builds_the_options_once_and_the_loss_gets_them_unchanged(fused, packed_batch,
                                                                             monkeypatch):
    model = make_model("gemma2", final_logit_softcapping=2.0)
    loss_cfg = LossConfig(label_smoothing=0.1, z_loss_weight=1e-3)
    head = build_head(model, KernelsConfig(fused_linear_cross_entropy=fused, loss_chunk_mib=3), loss_cfg)
    assert head.fused == fused
    assert head.options == LossOptions(ignore_index=-100, label_smoothing=0.1, z_loss_weight=1e-3,
                                       softcap=2.0, reduction="sum", chunk_bytes=3 * 2**20)
    seen = []

    def spy(module, name):
        original = getattr(module, name)

        def call(*args, **kwargs):
            seen.append(kwargs["options"])
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    spy(kernels, "fused_linear_cross_entropy")
    spy(head_module, "causal_lm_loss_from_logits")
    head(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
         cu_seqlens=packed_batch.cu_seqlens)
    assert len(seen) == 1 and seen[0] is head.options


def test_repr_names_the_kernel_that_runs():
    model = make_model("llama")
    fused = repr(CausalLMLoss(model, options=LossOptions(label_smoothing=0.1, reduction="sum")))
    assert f"kernel=fused_linear_cross_entropy ({kernels.active_path('cpu')})" in fused
    assert "options=LossOptions(ignore_index=-100, label_smoothing=0.1, z_loss_weight=0.0" in fused
    unfused = repr(CausalLMLoss(model, fused=False))
    assert "kernel=causal_lm_loss_from_logits (torch, logits of the Linear)" in unfused


def test_lora_on_lm_head_falls_back_to_the_unfused_path(packed_batch):
    reference = _lora(make_model("llama"), ["q_proj", "lm_head"])
    model = _lora(make_model("llama"), ["q_proj", "lm_head"])
    with pytest.warns(UserWarning, match="not a plain linear layer"):
        head = CausalLMLoss(model, fused=True)
    assert not head.fused
    out = head(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
               cu_seqlens=packed_batch.cu_seqlens)
    torch.testing.assert_close(out.loss, hf_reference(reference, packed_batch), rtol=1e-5, atol=1e-4)


def test_lm_head_in_modules_to_save_keeps_the_fused_path(packed_batch, monkeypatch):
    """A fully trained copy of lm_head (peft modules_to_save) is still one matrix: fused, and it gets
    the gradient (the frozen original does not)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(make_model("llama"), config)
    with torch.no_grad():
        for param in model.base_model.model.lm_head.modules_to_save["default"].parameters():
            param.mul_(1.5)  # the trained copy differs from the original
    reference_loss = hf_reference(model, packed_batch)
    calls = []
    original = kernels.fused_linear_cross_entropy
    monkeypatch.setattr(
        kernels, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    out = CausalLMLoss(model)(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
                              cu_seqlens=packed_batch.cu_seqlens)
    out.loss.backward()
    assert calls == [1]
    torch.testing.assert_close(out.loss, reference_loss, rtol=1e-5, atol=1e-4)
    wrapper = model.base_model.model.lm_head
    assert wrapper.modules_to_save["default"].weight.grad is not None
    assert wrapper.original_module.weight.grad is None


def test_underlying_model_is_a_submodule():
    model = make_model("llama")
    head = CausalLMLoss(model)
    assert head.model is model
    assert dict(head.named_parameters()).keys() == {f"model.{n}" for n, _ in model.named_parameters()}


def test_every_output_of_the_loss_head_flattens_to_its_tensors():
    """FSDP2 (torch 2.11) hooks the root's backward on the tensors that `tree_flatten` finds in the
    root's output: each type the loss head returns must give up its tensors, nested ones included
    (Medusa's losses hold a `LossOutput` per head)."""
    from torch.utils._pytree import tree_flatten

    from ligertune.kernels import DivergenceOutput, LossOutput
    from ligertune.models.head import MedusaLossOutput
    from ligertune.objectives.preference import AnswerLogps

    def loss() -> LossOutput:
        return LossOutput(*(torch.zeros(()) for _ in range(4)))

    outputs = {
        "loss": (loss(), 4),
        "answers": (AnswerLogps(torch.zeros(3), torch.ones(3, dtype=torch.int64)), 2),
        "divergence": (DivergenceOutput(*(torch.zeros(()) for _ in range(7))), 7),
        "medusa": (MedusaLossOutput(lm=loss(), heads=[loss(), loss()]), 12),
    }
    for name, (output, tensors) in outputs.items():
        leaves, _ = tree_flatten(output)
        assert len(leaves) == tensors and all(isinstance(x, torch.Tensor) for x in leaves), name
