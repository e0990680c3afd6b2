"""Terms against the target's own loops, read on its greedy continuations (rollouts).

A small model's greedy continuations loop: more language-model training lowered the
embedded target's held-out loss and made its loops worse. `pretrain --unlikelihood-batch B`
adds to each step's language-model loss a term on B rollouts of training-file prompts, on
every continuation token that belongs to a 4-gram already seen in the prompt or
continuation:
- `unlikelihood_loss`, sequence-level unlikelihood (Welleck et al., 2020): `-log(1 - p)`;
- `corrected_teacher_loss`: cross-entropy against the starting model with that token removed.
"""

from __future__ import annotations

import numpy as np

from jetflow_jax.embedded import prompts as prompt_sources

PROMPT_TOKENS = 96  # every prompt left-padded to this, so the training shapes are static


def repeated_ngram_mask(tokens, continuation_start: int, n: int = 4) -> np.ndarray:
  """`[T]` bool: the continuation tokens (index >= `continuation_start`) that belong to an
  n-gram occurring earlier in `tokens` (the prompt counts as earlier text)."""
  tokens = list(tokens)
  mask = np.zeros(len(tokens), bool)
  seen = set()
  for end in range(n, len(tokens) + 1):
    gram = tuple(tokens[end - n:end])
    if gram in seen:
      mask[max(end - n, continuation_start):end] = True
    seen.add(gram)
  return mask


def prompt_pool(tokenizer, count: int, seed: int) -> list[list[int]]:
  """Half documented-function prompts (HumanEval's shape), half 48-token snippets, all of
  training files; seeds apart from the heads' data (0, 2, 3)."""
  functions = prompt_sources.function_prompts(tokenizer, count // 2, PROMPT_TOKENS, seed=seed)
  snippets = prompt_sources.snippet_prompts(tokenizer, count - count // 2, 48, seed=seed)
  return functions + snippets


def left_padded(prompt_ids: list[list[int]], pad_id: int):
  """`[B, PROMPT_TOKENS]` ids and attention mask, prompts flush right."""
  ids = np.full((len(prompt_ids), PROMPT_TOKENS), pad_id, np.int64)
  mask = np.zeros_like(ids)
  for row, prompt in enumerate(prompt_ids):
    prompt = prompt[-PROMPT_TOKENS:]
    ids[row, PROMPT_TOKENS - len(prompt):] = prompt
    mask[row, PROMPT_TOKENS - len(prompt):] = 1
  return ids, mask


def greedy_rollouts(model, prompt_ids: list[list[int]], pad_id: int, new_tokens: int):
  """The model's greedy continuations: `[B, PROMPT_TOKENS + new_tokens]` ids and mask."""
  import torch
  ids, mask = (torch.from_numpy(a) for a in left_padded(prompt_ids, pad_id))
  was_training = model.training
  model.eval()
  with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=pad_id)
  model.train(was_training)
  full_mask = torch.cat([mask, torch.ones_like(out[:, PROMPT_TOKENS:])], dim=1)
  return out, full_mask


def rollout_logits(model, ids, attention_mask):
  """`[B, T, V]` logits of left-padded rows, each read at its unpadded positions."""
  return model(input_ids=ids, attention_mask=attention_mask,
               position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)).logits


def rollout_marks(ids, attention_mask, continuation_start: int, n: int = 4) -> np.ndarray:
  """`[B, T]` bool: `repeated_ngram_mask` of each row, n-grams counted over its unpadded text."""
  marks = np.zeros(ids.shape, bool)
  for row, (tokens, mask) in enumerate(zip(ids.numpy(), attention_mask.numpy())):
    first = int(np.argmax(mask))  # left padding: the text starts at the first unmasked slot
    marks[row, first:] = repeated_ngram_mask(tokens[first:], continuation_start - first, n)
  return marks


def unlikelihood_loss(logits, ids, attention_mask, continuation_start: int, n: int = 4):
  """The term for `[B, T]` rollouts (ids with their padding mask) and the model's `[B, T, V]`
  logits over them; also returns the share of continuation tokens penalised."""
  import torch
  # Predicted tokens: position t is read from logits t - 1.
  marks = torch.from_numpy(rollout_marks(ids, attention_mask, continuation_start, n)[:, 1:])
  log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
  token_log_probs = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
  # log(1 - p), kept finite where the model is already sure of the repeat.
  penalty = -torch.log(torch.clamp(1 - token_log_probs.exp(), min=1e-5))
  num_continuation = ids.shape[0] * (ids.shape[1] - continuation_start)
  return (penalty * marks).sum() / num_continuation, float(marks.sum()) / num_continuation


def corrected_teacher_loss(logits, reference_logits, ids, attention_mask,
                           continuation_start: int, n: int = 4):
  """Cross-entropy on the rollouts against the reference model's next-token distribution
  with, where the rollout's token repeats a 4-gram, that token's probability removed.

  The plain term alone lets the model escape its loops into tokens no text has (it did:
  distinct-4 0.71, continuations of junk); the reference names a natural second choice.
  Returns the term and the share of continuation tokens whose teacher was corrected.
  """
  import torch
  marks = torch.from_numpy(rollout_marks(ids, attention_mask, continuation_start, n))
  targets, marks = ids[:, continuation_start:], marks[:, continuation_start:]
  teacher = torch.softmax(reference_logits[:, continuation_start - 1:-1].float(), dim=-1)
  repeated = torch.zeros_like(teacher).scatter(-1, targets[..., None], marks[..., None].float())
  teacher = teacher * (1 - repeated)
  teacher = teacher / teacher.sum(-1, keepdim=True)
  log_probs = torch.log_softmax(logits[:, continuation_start - 1:-1].float(), dim=-1)
  return -(teacher * log_probs).sum(-1).mean(), float(marks.float().mean())


def reference_nll(reference, ids, attention_mask, continuation_start: int) -> float:
  """Mean NLL (nats/token) of the rollouts' continuations under `reference`: how natural they
  read to the model before the fine-tune (junk reads high)."""
  import torch
  with torch.no_grad():
    logits = rollout_logits(reference, ids, attention_mask)
  log_probs = torch.log_softmax(logits[:, continuation_start - 1:-1].float(), dim=-1)
  return float(-log_probs.gather(-1, ids[:, continuation_start:, None]).mean())
