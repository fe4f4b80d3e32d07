"""Chat data: records -> normalized conversations -> tokenized, masked examples -> packs -> batches.

    prepare_data(cfg, tokenizer, seed=...)  -> PreparedData(train, eval, stats)   (prepare.py)
    tokenize_conversation(tokenizer, messages, train_on=...) -> TokenizedExample  (chat.py)
    pack(examples, max_seq_len, packing=...) -> list[Pack]                       (packing.py)
    shuffled(packs, seed=, epoch=) -> list[Pack]; order_report(packs, steps, ...)  (order.py)
    collate(packs) -> Batch (one flattened row); collate_padded(items, pad_id) -> PaddedBatch  (batching.py)
    collate_preferences(packs) -> PreferenceBatch (one flattened row, query/key attention ranges)  (batching.py)
    packing_stats(packs, max_seq_len) -> PackingStats  (stats.py)
    load_preferences(path, tokenizer, max_seq_len=...) -> PreparedPreferences(units, stats)  (preference.py)
    pack_preferences(units, max_seq_len) -> list[PreferencePack]                  (preference.py)
"""

from __future__ import annotations

from ligertune.data.batching import (
    Batch,
    PaddedBatch,
    PreferenceBatch,
    collate,
    collate_padded,
    collate_preferences,
)
from ligertune.data.chat import (
    IGNORE_INDEX,
    ConversationError,
    TokenizedExample,
    tokenize_conversation,
    trained_segments,
)
from ligertune.data.formats import Conversation, read_conversations
from ligertune.data.order import OrderReport, order_report, shuffled
from ligertune.data.packing import Pack, best_fit_decreasing, pack, packs_digest, packs_of_one, shift_labels
from ligertune.data.preference import (
    KTOExample,
    PreferenceExample,
    PreferencePack,
    PreferencePair,
    PreferenceStats,
    PreparedPreferences,
    UnpairedPreference,
    load_preferences,
    pack_preferences,
    read_preferences,
    tokenize_preference,
    tokenize_preferences,
    unpair,
)
from ligertune.data.prepare import PreparedData, prepare_data
from ligertune.data.stats import (
    DataStats,
    LengthBucket,
    PackingStats,
    SourceStats,
    length_histogram,
    packing_stats,
)

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "Conversation",
    "ConversationError",
    "DataStats",
    "KTOExample",
    "LengthBucket",
    "OrderReport",
    "Pack",
    "PackingStats",
    "PaddedBatch",
    "PreferenceBatch",
    "PreferenceExample",
    "PreferencePack",
    "PreferencePair",
    "PreferenceStats",
    "PreparedData",
    "PreparedPreferences",
    "SourceStats",
    "TokenizedExample",
    "UnpairedPreference",
    "best_fit_decreasing",
    "collate",
    "collate_padded",
    "collate_preferences",
    "length_histogram",
    "load_preferences",
    "order_report",
    "pack",
    "packs_digest",
    "pack_preferences",
    "packing_stats",
    "packs_of_one",
    "prepare_data",
    "read_conversations",
    "read_preferences",
    "shift_labels",
    "shuffled",
    "tokenize_conversation",
    "tokenize_preference",
    "tokenize_preferences",
    "trained_segments",
    "unpair",
]
