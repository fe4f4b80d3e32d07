"""Fast LoRA (`ligertune.models.lora`): peft's values, gradients and saved adapters, with fewer GEMMs
and no float32 copy of the activations kept for backward. peft's own forward is the oracle."""

from __future__ import annotations

import copy
from collections import Counter

import peft
import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, make_model
from torch.utils._python_dispatch import TorchDispatchMode

from ligertune.models.lora import is_lora_patched, patch_lora, shared_lora_a, unpatch_lora
from ligertune.numerics import relative_error
from ligertune.recipe import KernelsConfig, LoraConfig, ModelConfig, Recipe
from ligertune.training.build import build_model, enable_gradient_checkpointing

LAYERS = 2
ALL_LINEAR = {"lora": "all-linear", "shared": 2 * LAYERS, "layers": 7 * LAYERS}
# q and v share one product, k is left out; up alone (gate is not adapted); down alone.
SUBSET = {"lora": ["q_proj", "v_proj", "up_proj", "down_proj"], "shared": LAYERS, "layers": 4 * LAYERS}
TARGETS = {"all-linear": ALL_LINEAR, "subset": SUBSET}

# fp32: the one GEMM over cat(A) and the summed dx add in another order than peft's GEMM per layer,
# rounding errors of ~1e-7 that grow through the layers of backward. bf16: peft rounds each layer's
# dx to bf16 before autograd sums them where the fast path sums in fp32 and rounds once, so the two
# differ by bf16 rounding (eps 7.8e-3) carried through two layers.
TOL = {torch.float32: {"logits": 1e-6, "grads": 1e-5}, torch.bfloat16: {"logits": 1e-2, "grads": 3e-2}}


def wrapped_pair(family: str, dtype: torch.dtype, lora: peft.LoraConfig, **fields):
    """(peft's path, fast path): one tiny model with LoRA, adapters drawn nonzero, and its copy patched."""
    model = peft.get_peft_model(make_model(family, attention="sdpa", dtype=dtype, **fields), lora)
    perturb_adapters(model)
    fast = copy.deepcopy(model)
    return model, fast, patch_lora(fast)


def perturb_adapters(model, seed: int = 0) -> None:
    """Every adapter weight (and LoRA bias) random: B starts at zero, and then A would get no gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def token_batch(shape=(3, 13), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, shape, generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


def logits_loss_grads(model, ids, targets, *, embeds: bool = False):
    """Logits, summed cross-entropy, and the gradient of every trainable parameter."""
    model.zero_grad(set_to_none=True)
    if embeds:  # inputs that require grad, so that every layer's input gets a gradient
        inputs = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=inputs).logits
    else:
        logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), loss.detach(), grads


def assert_same(fast, reference, dtype, label: str = "") -> None:
    (logits1, loss1, grads1), (logits0, loss0, grads0) = fast, reference
    tol = TOL[dtype]
    assert relative_error(logits1, logits0) <= tol["logits"], label
    assert relative_error(loss1, loss0) <= tol["logits"], label
    assert grads1.keys() == grads0.keys() and grads0, label
    for name in grads0:
        assert grads1[name] is not None, name
        assert relative_error(grads1[name], grads0[name]) <= tol["grads"], f"{label} {name}"


# --------------------------------------------------------------------------------------------------
# the same values as peft


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_lora_equals_peft(family, targets, dtype):
    case = TARGETS[targets]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=case["lora"], task_type="CAUSAL_LM")
    model, fast, report = wrapped_pair(family, dtype, lora)
    assert (report.modules, report.shared, dict(report.kept)) == (case["layers"], case["shared"], {})
    ids, targets_ = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets_), logits_loss_grads(model, ids, targets_), dtype)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_fast_lora_is_as_close_to_float32_as_peft(family):
    """Against the same weights in fp32: the fast path's bf16 error is that of peft's bf16 path."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair(family, torch.bfloat16, lora)
    oracle = copy.deepcopy(model).float()  # bf16 base weights upcast exactly; adapters are fp32 already
    ids, targets = token_batch()
    ref, peft_bf16, fast_bf16 = (logits_loss_grads(m, ids, targets) for m in (oracle, model, fast))

    def flat(grads):
        return torch.cat([g.flatten().float() for g in grads.values()])

    assert relative_error(fast_bf16[0], ref[0]) <= 1.5 * relative_error(peft_bf16[0], ref[0])
    assert relative_error(flat(fast_bf16[2]), flat(ref[2])) <= 1.5 * relative_error(flat(peft_bf16[2]), flat(ref[2]))


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # o, gate, up, down have no base bias
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_option_at_once(dtype):
    """Ranks and alphas per layer within one shared product, rsLoRA, LoRA biases on B, trained base
    biases (Qwen2's q, k, v)."""
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", use_rslora=True,
        rank_pattern={"k_proj": 2, "gate_proj": 8}, alpha_pattern={"v_proj": 3, "up_proj": 5},
        lora_bias=True, bias="all",
    )
    model, fast, report = wrapped_pair("qwen2", dtype, lora)
    assert (report.modules, report.shared) == (7 * LAYERS, 2 * LAYERS)
    k = fast.get_base_model().model.layers[0].self_attn.k_proj
    assert k.r["default"] == 2 and k.lora_B["default"].bias is not None
    ids, targets = token_batch()
    reference = logits_loss_grads(model, ids, targets)
    assert any(n.endswith("q_proj.base_layer.bias") for n in reference[2])  # base biases are trained
    assert_same(logits_loss_grads(fast, ids, targets), reference, dtype)


def test_gradient_checkpointing_recomputes_the_shared_products():
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    base = make_model("llama", attention="sdpa")
    enable_gradient_checkpointing(base)
    model = peft.get_peft_model(base, lora)
    perturb_adapters(model)
    fast = copy.deepcopy(model)
    patch_lora(fast)
    model.train(), fast.train()
    ids, targets = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets, embeds=True),
                logits_loss_grads(model, ids, targets, embeds=True), torch.float32)


def test_through_build_model_with_the_kernels_patched():
    """`ligertune train`'s model: patched RMSNorm/RoPE/SwiGLU (SwiGLU's backward writes over the gate
    and up outputs, which are the fast path's outputs) and `kernels.lora` on, against it off."""

    def build(fast: bool):
        recipe = Recipe(model=ModelConfig(config=dict(FAMILIES["llama"]), attention="sdpa", dtype="float32"),
                        kernels=KernelsConfig(lora=fast), lora=LoraConfig(r=4, alpha=8))
        model = build_model(recipe, device=torch.device("cpu"), vocab_size=None).module
        perturb_adapters(model)
        return model

    fast, model = build(True), build(False)
    assert is_lora_patched(fast) and not is_lora_patched(model)
    ids, targets = token_batch()
    assert_same(logits_loss_grads(fast, ids, targets), logits_loss_grads(model, ids, targets), torch.float32)


# --------------------------------------------------------------------------------------------------
# less work and less memory


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def gemm_counts(model, ids) -> tuple[int, int]:
    """GEMMs of a forward and of its backward."""
    inputs = model.get_input_embeddings()(ids).detach().requires_grad_()
    with _CountMatmuls() as forward:
        loss = model(inputs_embeds=inputs).logits.sum()
    with _CountMatmuls() as backward:
        loss.backward()
    return sum(forward.calls.values()), sum(backward.calls.values())


def test_one_gemm_for_the_a_projections_of_a_shared_input():
    """Per layer, peft runs A for q, k, v, gate, up: 5 GEMMs forward and 10 backward (grad A and dx
    of each); the fast path runs 2 and 4 (one per shared input). Everything else is the same."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", torch.float32, lora)
    ids, _ = token_batch()
    (peft_fwd, peft_bwd), (fast_fwd, fast_bwd) = gemm_counts(model, ids), gemm_counts(fast, ids)
    assert peft_fwd - fast_fwd == 3 * LAYERS
    assert peft_bwd - fast_bwd == 6 * LAYERS


def saved_in_lora_layers(model, ids) -> list[torch.Tensor]:
    """What autograd keeps for backward inside the forwards of the LoRA layers, base layers included."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    handles = []
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            handles.append(module.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__()))
            handles.append(module.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None)))
    try:
        model(ids).logits.sum()
    finally:
        for handle in handles:
            handle.remove()
    return saved


def test_no_float32_copy_of_the_activations_is_kept():
    """bf16 model, float32 adapters: peft keeps a float32 copy of the input of every adapted layer;
    the fast path keeps the bf16 input, once per shared input."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", torch.bfloat16, lora)
    ids, _ = token_batch()

    def fp32_activations(saved):
        # [tokens, width] or [batch, length, width], hidden (64) and intermediate (96) widths
        return [t for t in saved if t.dtype == torch.float32 and t.shape[-1] in (64, 96)
                and t.numel() == ids.numel() * t.shape[-1]]

    def activation_bytes(model, saved):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(n for ptr, n in storages.items() if ptr not in weights)

    peft_saved, fast_saved = saved_in_lora_layers(model, ids), saved_in_lora_layers(fast, ids)
    assert len(fp32_activations(peft_saved)) == 7 * LAYERS
    assert fp32_activations(fast_saved) == []
    # Both keep the A products (one [tokens, 3r] tensor instead of three [tokens, r] ones: the same
    # bytes). peft adds a float32 copy of each of the 7 inputs of a layer, the fast path the bf16
    # inputs of its 4 products: q/k/v's, o's, gate/up's (width 64) and down's (96).
    tokens = ids.numel()
    copies = LAYERS * tokens * (6 * 64 + 96) * 4
    inputs = LAYERS * tokens * (3 * 64 + 96) * 2
    assert activation_bytes(model, peft_saved) - activation_bytes(fast, fast_saved) == copies - inputs


def test_base_weights_stay_frozen_in_the_model_dtype():
    recipe = Recipe(model=ModelConfig(config=dict(FAMILIES["qwen2"]), attention="sdpa", dtype="bfloat16"),
                    lora=LoraConfig(r=4, alpha=8))
    model = build_model(recipe, device=torch.device("cpu"), vocab_size=None).module
    assert is_lora_patched(model)
    perturb_adapters(model)
    ids, targets = token_batch()
    _, _, grads = logits_loss_grads(model, ids, targets)
    assert grads and all("lora_" in n for n in grads)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert not param.requires_grad and param.grad is None, name
            assert param.dtype == torch.bfloat16, name


# --------------------------------------------------------------------------------------------------
# peft's files and peft's forward where the shortcut does not apply


def test_saved_adapters_load_with_peft(tmp_path):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    _, fast, _ = wrapped_pair("llama", torch.float32, lora)
    ids, targets = token_batch()
    logits_loss_grads(fast, ids, targets)  # trained state: gradients exist, forwards ran
    fast.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(make_model("llama", attention="sdpa"), tmp_path)
    assert not is_lora_patched(loaded)
    saved = {n: p for n, p in fast.named_parameters() if "lora_" in n}
    reloaded = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert saved.keys() == reloaded.keys()
    for name, param in saved.items():
        assert torch.equal(param, reloaded[name]), name
    fast.eval(), loaded.eval()
    with torch.no_grad():
        assert relative_error(fast(ids).logits, loaded(ids).logits) <= 1e-6
        merged = loaded.merge_and_unload()
        assert relative_error(merged(ids).logits, fast(ids).logits) <= 1e-5


def test_dropout_keeps_peft_forward():
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, report = wrapped_pair("llama", torch.float32, lora)
    assert report.modules == 0 and report.kept == {"dropout > 0": 7 * LAYERS}
    assert not is_lora_patched(fast)
    model.train(), fast.train()
    ids, targets = token_batch()
    torch.manual_seed(3)
    reference = logits_loss_grads(model, ids, targets)
    torch.manual_seed(3)
    logits, loss, grads = logits_loss_grads(fast, ids, targets)
    assert torch.equal(logits, reference[0]) and torch.equal(loss, reference[1])
    assert grads.keys() == reference[2].keys()
    assert all(torch.equal(grads[n], reference[2][n]) for n in grads)


def test_disabled_merged_and_unpatched_adapters():
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model, fast, _ = wrapped_pair("llama", torch.float32, lora)
    ids, _ = token_batch()
    with torch.no_grad():
        adapted = fast(ids).logits
        with fast.disable_adapter():
            base = fast(ids).logits
        with model.disable_adapter():
            assert torch.equal(base, model(ids).logits)
        assert relative_error(adapted, base) > 1e-2  # the adapters act
        unpatch_lora(fast)
        assert not is_lora_patched(fast)
        assert torch.equal(fast(ids).logits, model(ids).logits)
        patch_lora(fast)
        fast.merge_adapter()  # W + s B A in the base weights: the fast forward is peft's plain base call
        assert is_lora_patched(fast)
        assert relative_error(fast(ids).logits, adapted) <= 1e-5
        fast.unmerge_adapter()
        assert relative_error(fast(ids).logits, adapted) <= 1e-5


def test_shared_product_is_for_one_input_only():
    """k_proj called on another tensor than q_proj, or on q's tensor changed in place, computes its own."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    _, fast, _ = wrapped_pair("llama", torch.float32, lora)
    attn = fast.get_base_model().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)

    def peft_forward(module, t):
        return type(module).forward(module, t)

    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            torch.testing.assert_close(proj(x), peft_forward(proj, x), rtol=1e-6, atol=1e-6)
        attn.q_proj(x)
        torch.testing.assert_close(attn.k_proj(y), peft_forward(attn.k_proj, y), rtol=1e-6, atol=1e-6)
        attn.q_proj(x)
        x.mul_(2)
        torch.testing.assert_close(attn.v_proj(x), peft_forward(attn.v_proj, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_lora_a_gradients(dtype):
    """The autograd function alone against x.to(fp32) @ A_i^T per weight, odd sizes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 123, generator=gen).to(dtype).requires_grad_()
    weights = [torch.randn(r, 123, generator=gen).requires_grad_() for r in (5, 1, 8)]
    outs = shared_lora_a(x, weights)
    cotangents = [torch.randn(o.shape, generator=gen) for o in outs]
    torch.autograd.backward(outs, cotangents)
    got = [x.grad, *(w.grad for w in weights)]
    x2 = x.detach().clone().requires_grad_()
    weights2 = [w.detach().clone().requires_grad_() for w in weights]
    refs = [F.linear(x2.float(), w) for w in weights2]
    torch.autograd.backward(refs, cotangents)
    for out, ref in zip(outs, refs):
        assert relative_error(out, ref) <= 1e-6
    for g, ref in zip(got, [x2.grad, *(w.grad for w in weights2)]):
        assert g.dtype == ref.dtype and relative_error(g, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)
