"""The chat template a recipe names (`model.chat_template`) in place of its tokenizer's own.

A base model's tokenizer often has no template, or one that its instruct sibling does not share;
`model.chat_template` gives one:

    chatml          <|im_start|>role\\ncontent<|im_end|>\\n   (needs both tokens: Qwen's vocabularies)
    llama3          <|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>
                    (the Llama 3 vocabularies, base models included; a tool turn is `ipython`)
    a .jinja file   resolved next to the recipe, like the other paths
    Jinja text      anything with `{{` or `{%`, written in the recipe itself

A built-in template's tokens must be special tokens of the vocabulary: split into pieces, a marker
would be text the model learns to spell, and no reply would stop at its end. No token is added
(the embeddings keep their size); a template of one's own can close each turn with `eos_token`.
The tokenizer saved with the run carries the template, so `chat` and `merge` render as training did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ligertune.data.chat import ONE_EXCHANGE, ConversationError, special_ids, tokenize_conversation
from ligertune.errors import UserError, first_line

KEY = "model.chat_template"

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{%- if bos_token -%}{{- bos_token -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# name -> (template, the special tokens it writes)
BUILT_IN = {
    "chatml": (CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}

def is_template_text(value: str) -> bool:
    return "{{" in value or "{%" in value


def template_text(value: str) -> tuple[str, tuple[str, ...]]:
    """The Jinja text that `value` names, and the special tokens a built-in template needs."""
    if value in BUILT_IN:
        return BUILT_IN[value]
    if is_template_text(value):
        return value, ()
    if value.endswith(".jinja"):  # a file, which the recipe loader resolved next to the recipe
        try:
            return Path(value).expanduser().read_text(encoding="utf-8"), ()
        except FileNotFoundError:
            raise UserError(f"{KEY}: {value}: no such file") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{KEY}: {value}: cannot read it: {first_line(err)}") from None
    raise UserError(f"{KEY}: {value!r} is no built-in template ({', '.join(BUILT_IN)}), no .jinja file "
                    "and no Jinja text")


def set_chat_template(tokenizer: Any, value: str, subject: str) -> None:
    """Give `tokenizer` the template `value` names, once it is known to render a conversation with
    special tokens of this vocabulary. `subject` names the tokenizer in errors."""
    text, tokens = template_text(value)
    special = special_ids(tokenizer)
    missing = [t for t in tokens if tokenizer.convert_tokens_to_ids(t) not in special]
    if missing:
        lacks = "none of them" if len(missing) == len(tokens) else "not all"
        raise UserError(f"{KEY}: {value} needs {', '.join(missing)} as special tokens, and {subject} has "
                        f"{lacks}: write a template of your own that closes each turn with the tokenizer's "
                        "eos_token (a .jinja file)")
    tokenizer.chat_template = text
    try:
        tokenize_conversation(tokenizer, ONE_EXCHANGE)
    except ConversationError as err:
        raise UserError(f"{KEY}: {err}") from None
