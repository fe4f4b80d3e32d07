"""Kernel patching: a patched model computes what the unpatched one does, through the kernels."""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
from counting import DownProducts
from tiny_models import FAMILIES, GEGLU_FAMILIES, make_model

from ligertune import kernels
from ligertune.models import (
    PATCH_TABLE,
    CausalLMLoss,
    is_patched,
    packed_attention_kwargs,
    patch_model,
    unpatch_model,
)
from ligertune.models.patching import _RopeRedirect

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Count the calls into each public kernel (the patched modules look them up at call time)."""
    calls: Counter = Counter()
    for name in ("rms_norm", "apply_rope", "swiglu", "geglu", "fused_linear_cross_entropy"):
        original = getattr(kernels, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, spy)
    return calls


def hf_loss_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' own logits and a plain summed cross-entropy, with every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(batch.input_ids, position_ids=batch.position_ids,
                   **_packed(batch)).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="sum")
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _packed(batch) -> dict:
    return packed_attention_kwargs(batch.cu_seqlens)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_equals_unpatched(family, packed_batch, kernel_calls):
    reference = make_model(family)
    ref_logits, ref_loss, ref_grads = hf_loss_and_grads(reference, packed_batch)

    model = make_model(family)
    report = patch_model(model)
    try:
        n_norms = 2 * 2 + 1  # two per layer, one final
        n_norms += 2 * 2 if family in ("qwen3", "gemma3", "olmo2", "olmo3") else 0  # q_norm and k_norm
        n_norms += 2 * 2 if family in ("gemma2", "gemma3") else 0  # pre/post feed-forward norms
        assert report.rms_norm == n_norms
        assert report.mlps == 2
        assert report.glu == ("geglu" if family in GEGLU_FAMILIES else "swiglu")
        assert report.rope == f"{FAMILIES[family]['model_type']} apply_rotary_pos_emb"

        with torch.no_grad():
            logits = model(packed_batch.input_ids, position_ids=packed_batch.position_ids,
                           **_packed(packed_batch)).logits
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)

        kernel_calls.clear()
        head = CausalLMLoss(model, fused=True)
        out = head(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
                   cu_seqlens=packed_batch.cu_seqlens)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-4)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)

        # Each kernel ran once per layer use (the comparison above is not between two HF models).
        assert kernel_calls["rms_norm"] == n_norms
        assert kernel_calls["apply_rope"] == (1 if family == "smollm3" else 2)  # its layer 2 has no RoPE
        assert kernel_calls[report.glu] == report.mlps
        assert kernel_calls["swiglu"] + kernel_calls["geglu"] == report.mlps
        assert kernel_calls["fused_linear_cross_entropy"] == 1
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("family, fields", [("llama", {}), ("llama", {"mlp_bias": True}), ("qwen2", {})],
                         ids=["llama", "llama-mlp-bias", "qwen2"])
def test_a_recompute_skips_the_full_models_last_product(family, fields, packed_batch):
    """Full fine-tuning under gradient checkpointing: a recomputed layer's down_proj product, which
    nothing the layer keeps for backward reads, is skipped (`_ProductSkippedInRecompute`): once a
    step instead of twice, with the loss and every gradient (bias too) of the model without
    checkpointing, bit for bit."""
    from ligertune.training.build import enable_gradient_checkpointing

    runs = []
    for checkpointed in (False, True):
        model = make_model(family, **fields)
        patch_model(model)
        if checkpointed:
            enable_gradient_checkpointing(model)
        model.train()
        config = model.config
        with DownProducts(config.intermediate_size, config.hidden_size) as products:
            values = hf_loss_and_grads(model, packed_batch)
        runs.append((products.count, *values))
    (plain, logits, loss, grads), (recomputed, logits_c, loss_c, grads_c) = runs
    assert plain == recomputed == config.num_hidden_layers
    assert torch.equal(logits, logits_c) and torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys()
    assert any("down_proj.bias" in name for name in grads) == bool(fields)
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_unpatch_restores_the_original(family, packed_batch, kernel_calls):
    spec = PATCH_TABLE[FAMILIES[family]["model_type"]]
    modeling = importlib.import_module(spec.modeling)
    gc.collect()  # patched models that earlier tests in this process left unreferenced
    before = getattr(modeling, spec.rope)
    original_rope = getattr(before, "original", before)
    model, other = make_model(family), make_model(family)
    patch_model(model)
    patch_model(other)
    assert is_patched(model) and isinstance(getattr(modeling, spec.rope), _RopeRedirect)

    unpatch_model(model)
    assert not is_patched(model) and is_patched(other)
    assert isinstance(getattr(modeling, spec.rope), _RopeRedirect), "still in use by the other model"
    unpatch_model(other)
    after = getattr(modeling, spec.rope)
    if isinstance(after, _RopeRedirect):  # another test's patched model of the family is still alive
        assert model not in after.models and other not in after.models
    else:
        assert after is original_rope

    kernel_calls.clear()
    with torch.no_grad():
        model(packed_batch.input_ids, position_ids=packed_batch.position_ids)
    assert sum(kernel_calls.values()) == 0
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_switches_and_the_report():
    model = make_model("llama")
    report = patch_model(model, rms_norm=False, rope=False)
    try:
        assert (report.rms_norm, report.rope, report.mlps) == (0, None, 2)
        assert report.describe() == "swiglu: 2 MLPs"
    finally:
        unpatch_model(model)
    gemma = make_model("gemma")
    report = patch_model(gemma)
    try:
        assert report.describe() == "rms_norm: 5 modules, rope: gemma apply_rotary_pos_emb, geglu: 2 MLPs"
    finally:
        unpatch_model(gemma)
    exact_gelu = make_model("llama", hidden_act="gelu")  # erf GELU: no kernel computes it
    report = patch_model(exact_gelu, rope=False)
    try:
        assert report.describe() == (
            "rms_norm: 5 modules "
            "(gated MLP: not applied, its activation is gelu, not one of silu, swish, gelu_pytorch_tanh)"
        )
    finally:
        unpatch_model(exact_gelu)


def test_unsupported_model_type_warns_and_runs_unpatched():
    model = make_model("llama")
    model.config.model_type = "not-a-family"
    with pytest.warns(UserWarning, match="no kernel patches for model type 'not-a-family'"):
        report = patch_model(model)
    assert not report.supported and not is_patched(model)
    assert report.describe() == "none (no kernel patches for model type 'not-a-family')"


def test_peft_wrapped_model_is_patched_through_its_base(packed_batch, kernel_calls):
    """LoRA around a patched base model: the same loss and adapter gradients as without patches."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    results = []
    for patched in (False, True):
        model = peft.get_peft_model(make_model("qwen3"), lora)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the same adapters in both runs, and B nonzero so that they act
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(std=0.1, generator=gen)
        if patched:
            report = patch_model(model)  # patched after wrapping, through the peft model
            assert report.mlps == 2 and is_patched(model.get_base_model())
        kernel_calls.clear()
        out = CausalLMLoss(model)(packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets,
                                  cu_seqlens=packed_batch.cu_seqlens)
        out.loss.backward()
        assert (kernel_calls["swiglu"] > 0) == patched
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((out.loss.detach(), grads))
        if patched:
            unpatch_model(model)
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-4)
    assert grads0.keys() == grads1.keys() and len(grads0) == 2 * 7 * 2
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-5, msg=name)


INTERPRETER_PROBE = textwrap.dedent("""
    import torch, triton, triton.language as tl
    @triton.jit
    def count(out_ptr, n, BLOCK: tl.constexpr):
        total = 0
        for start in range(0, n, BLOCK):
            total += tl.sum(((start + tl.arange(0, BLOCK)) < n).to(tl.int32))
        tl.store(out_ptr, total)
    out = torch.zeros(1, dtype=torch.int32)
    count[(1,)](out, 10, BLOCK=4)
    assert out.item() == 10
""")


def interpreter_runs_loops() -> bool:
    """Whether this triton's interpreter runs a loop with a run-time bound (triton 3.6's does not)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", INTERPRETER_PROBE], env=env, capture_output=True).returncode == 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_patched_llama_through_triton_kernels_in_the_interpreter():
    """The same equality with every kernel run by Triton (interpreted on the CPU), in a fresh process:
    TRITON_INTERPRET must be set before triton is imported."""
    script = textwrap.dedent("""
        import sys, torch, torch.nn.functional as F
        sys.path.insert(0, "tests/models")
        from tiny_models import make_model, make_packed_batch
        from ligertune import kernels
        from ligertune.models import CausalLMLoss, packed_attention_kwargs, patch_model
        assert kernels.active_path("cpu") == "triton"
        batch = make_packed_batch([6, 5, 8])
        kw = packed_attention_kwargs(batch.cu_seqlens)
        ref = make_model("llama")
        logits = ref(batch.input_ids, position_ids=batch.position_ids, **kw).logits
        ref_loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
        ref_loss.backward()
        model = make_model("llama")
        patch_model(model)
        head = CausalLMLoss(model)
        out = head(batch.input_ids, batch.position_ids, batch.targets, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref_loss, rtol=1e-4, atol=1e-4)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=name)
        print("ok")
    """)
    if not interpreter_runs_loops():
        pytest.skip(f"triton {importlib.metadata.version('triton')}'s interpreter cannot run loops with "
                    "run-time bounds; the compiled kernels are tested on CUDA instead")
    env = {**os.environ, "TRITON_INTERPRET": "1", "LIGERTUNE_KERNELS": "triton", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_patched_model_on_cuda_in_bf16(family):
    """On CUDA the kernels run compiled: a bf16 patched model against the same model unpatched."""
    from tiny_models import make_packed_batch

    batch = make_packed_batch([37, 11, 64, 5, 20])
    cuda = {k: v.cuda() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    results = []
    for patched in (False, True):
        model = make_model(family).to("cuda", torch.bfloat16)
        if patched:
            patch_model(model)
        out = CausalLMLoss(model, fused=patched)(cuda["input_ids"], cuda["position_ids"], cuda["targets"],
                                                 cu_seqlens=cuda["cu_seqlens"])
        out.loss.backward()
        results.append((out.loss.detach().float(), [p.grad.float() for p in model.parameters()]))
        if patched:
            unpatch_model(model)
    (loss0, grads0), (loss1, grads1) = results
    assert abs(loss1.item() - loss0.item()) / abs(loss0.item()) < 1e-2
    for g0, g1 in zip(grads0, grads1):
        assert (g1 - g0).norm() / g0.norm().clamp(min=1e-6) < 5e-2
