"""Shared fixtures of the data tests (helpers and templates live in `chat_fixtures`)."""

from __future__ import annotations

import pytest
from chat_fixtures import make_tokenizer
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def tokenizer_factory():
    """`make(family, kind)`, one tokenizer per pair for the session: never modify one (use
    `chat_fixtures.make_tokenizer` for a private copy)."""
    cache: dict[tuple[str, str], PreTrainedTokenizerFast] = {}

    def make(family: str = "chatml", kind: str = "bytelevel") -> PreTrainedTokenizerFast:
        if (family, kind) not in cache:
            cache[family, kind] = make_tokenizer(family, kind)
        return cache[family, kind]

    return make


@pytest.fixture()
def chatml(tokenizer_factory) -> PreTrainedTokenizerFast:
    return tokenizer_factory("chatml", "bytelevel")
