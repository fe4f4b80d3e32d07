"""`unwrap_model` finds the transformers model inside peft's wrappers, without importing peft for a
model that cannot be one of them."""

from __future__ import annotations

import subprocess
import sys

from tiny_models import make_model

from ligertune.models import decoder_of, unwrap_model


def test_peft_model_and_bare_tuner_unwrap_to_the_same_base():
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraModel

    base = make_model("llama", attention="sdpa")
    assert unwrap_model(base) is base
    config = LoraConfig(r=2, target_modules=["q_proj"])
    wrapped = get_peft_model(base, config)
    assert unwrap_model(wrapped) is base
    tuner = wrapped.base_model
    assert isinstance(tuner, LoraModel) and unwrap_model(tuner) is base
    assert decoder_of(tuner) is base.model


def test_a_plain_model_is_unwrapped_without_importing_peft():
    code = (
        "import sys\n"
        "from torch import nn\n"
        "from ligertune.models import unwrap_model\n"
        "layer = nn.Linear(2, 2)\n"
        "assert unwrap_model(layer) is layer\n"
        "print('peft' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
