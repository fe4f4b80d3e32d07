"""Warnings of optional libraries that are no fault of the run, silenced before they are imported.

peft imports bitsandbytes and torchao whenever they are installed, so their import-time warnings
would reach every command's output (and break its one-line errors). Their errors still show.
"""

from __future__ import annotations

import logging

NOISY_LOGGERS = (
    # bitsandbytes: int8 layers cast their float32/bf16 inputs to float16 (logged on every call), and
    # a CPU with avx512-bf16 lacks an optional kernel from the hub (logged at import).
    "bitsandbytes.autograd._functions",
    "bitsandbytes.backends.cpu.ops",
    # torchao: one warning per optional C++ extension built for another torch (float8 training needs
    # none of them), and torch's about the enums torchao registers with it.
    "torchao",
    "torch.utils._pytree",
)


def quiet_optional_libraries() -> None:
    """Raise the loggers of `NOISY_LOGGERS` to errors only; takes effect for import-time warnings
    when called before the library is first imported."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
