"""Test helpers: tiny tokenizers trained on a few sentences, chat templates of four families, records.

The templates are written here in the style of each family (not copied from any model):
ChatML/Qwen (`<|im_start|>role ... <|im_end|>`, with a default system prompt), Llama-3 (header ids,
`<|eot_id|>`), Mistral (`[INST] ... [/INST] answer</s>`, system merged into the first user turn)
and Gemma (`<start_of_turn>model ... <end_of_turn>`, system merged too). None has `{% generation %}`
markers. Three extra templates stress the fallbacks: two move the system prompt to the last user turn
(earlier renders are not prefixes of later ones), one writes an empty reasoning block into the final
assistant turn only.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = [
    "<unk>", "<pad>", "<s>", "</s>", "<bos>", "<eos>",
    "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "[INST]", "[/INST]",
    "<start_of_turn>", "<end_of_turn>",
]

CORPUS = [
    "You are a helpful assistant. Answer briefly and kindly.",
    "What is the capital of France? The capital of France is Paris.",
    "Say hi. Hello there! How are you today?",
    "Tell me a joke about cats. Cats sleep all day, then they sleep some more.",
    "The user asked the assistant a question, and the model answered.",
    "system user assistant model tool human gpt",
    "Compute two plus two. Two plus two is four.\nThanks!\n\nYou're welcome.",
    "Here is the weather: sunny, 21 degrees. Shall I look up tomorrow as well?",
]

CHATML = (
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] | trim -}}{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

MISTRAL = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system -%}{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' -}}"
    "{%- else -%}{{- '[INST] ' + message['content'] + ' [/INST]' -}}{%- endif -%}"
    "{%- else -%}{{- ' ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

GEMMA = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/model/user/model') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') -}}"
    "{{- message['content'] | trim -}}{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# System prompt written into the last user turn: a prefix rendering is not a prefix of the whole.
MISTRAL_LAST_SYSTEM = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- set last_user = namespace(i=-1) -%}"
    "{%- for message in turns -%}{%- if message['role'] == 'user' -%}{%- set last_user.i = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.index0 == last_user.i and system -%}"
    "{{- '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' -}}"
    "{%- else -%}{{- '[INST] ' + message['content'] + '[/INST]' -}}{%- endif -%}"
    "{%- else -%}{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# The same move in ChatML, where a user message is closed like an answer (<|im_end|>): an answer that
# repeats the question can only be told apart by what precedes it.
CHATML_LAST_SYSTEM = (
    "{%- set last_user = namespace(i=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set last_user.i = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if message['role'] == 'user' and messages[0]['role'] == 'system' and "
    "message is sameas messages[last_user.i] -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# An empty reasoning block in the final assistant turn only (earlier turns are rendered without).
CHATML_THINK = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and loop.last -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Tools in the system turn and tool calls as JSON lines in the assistant's turn, after the layout of
# the tool-calling ChatML templates (a tool's result is a turn of its own).
CHATML_TOOLS = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\nTools:' -}}"
    "{%- for tool in tools -%}{{- '\n' + tool | tojson -}}{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] -}}"
    "{%- for call in message.get('tool_calls', []) -%}"
    "{{- '<tool_call>' + call['function'] | tojson + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

FAMILIES = {
    "chatml": dict(chat_template=CHATML, bos_token=None, eos_token="<|im_end|>"),
    "llama3": dict(chat_template=LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "mistral": dict(chat_template=MISTRAL, bos_token="<s>", eos_token="</s>"),
    "gemma": dict(chat_template=GEMMA, bos_token="<bos>", eos_token="<eos>"),
    "mistral_last_system": dict(chat_template=MISTRAL_LAST_SYSTEM, bos_token="<s>", eos_token="</s>"),
    "chatml_last_system": dict(chat_template=CHATML_LAST_SYSTEM, bos_token=None, eos_token="<|im_end|>"),
    "chatml_think": dict(chat_template=CHATML_THINK, bos_token=None, eos_token="<|im_end|>"),
    "chatml_tools": dict(chat_template=CHATML_TOOLS, bos_token=None, eos_token="<|im_end|>"),
}


def build_backend(kind: str) -> Tokenizer:
    """A BPE of a few hundred tokens: byte-level (Llama-3/Qwen style) or metaspace (sentencepiece style)."""
    if kind == "bytelevel":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = list(string.printable) + ["\u2581"]
    else:
        raise ValueError(kind)
    trainer = trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def make_tokenizer(family: str = "chatml", kind: str = "bytelevel") -> PreTrainedTokenizerFast:
    spec = FAMILIES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(kind),
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def write_jsonl(path: Path, records: list) -> Path:
    """One JSON value per line; strings are written as they are (to plant malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def conversation(i: int, turns: int = 1, system: bool = False) -> dict:
    """A `messages` record with `turns` user/assistant exchanges, varied by `i`."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: what is {i} plus {t}?"})
        messages.append({"role": "assistant", "content": f"The answer is {i + t}." + " Thanks!" * (i % 5)})
    return {"messages": messages}
