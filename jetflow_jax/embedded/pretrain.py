"""Pre-trains the embedded Qwen3 target on the standard library with PyTorch + transformers.

PyTorch is used here only because it trains this small model faster on CPU than
our JAX port (measured); the result is a plain HF checkpoint that our JAX loader
reads like any other. The run is resumable: the whole training state is saved
atomically to `WORKDIR/checkpoint.pt` every few minutes, and re-running the same
command continues from it.

    python -m jetflow_jax.embedded.pretrain --workdir runs/embedded/pretrain \
        --out jetflow_jax/embedded/checkpoints/target
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import time

import numpy as np

from jetflow_jax.embedded import corpus, evaluation, unlikelihood
from jetflow_jax.embedded.tokenizer import EOS_TOKEN, MASK_TOKEN, train_tokenizer


def model_config(vocab_size: int, eos_id: int):
  from transformers import Qwen3Config
  return Qwen3Config(
      vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eos_id,
      eos_token_id=eos_id, pad_token_id=eos_id, torch_dtype="float32")


def prepare_data(workdir: str, tokenizer_from: str | None = None):
  """Tokenizer and tokenized splits, built once and cached in the workdir.

  `train` is every training file; `train_lib` and `train_test` split it into library
  modules and test suites, for runs that set the test files' share of each batch.
  `heldout` is the random held-out sample (the quality bar), `heldout_modules` the
  hand-picked held-out modules.
  A run continuing an earlier one keeps its tokenizer (`tokenizer_from`: the directory of
  its `tokenizer.json`).
  """
  from transformers import AutoTokenizer
  tok_dir = os.path.join(workdir, "tokenizer")
  if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    if tokenizer_from:
      os.makedirs(tok_dir, exist_ok=True)
      for name in os.listdir(tokenizer_from):  # an HF directory also holds the weights
        if name.startswith(("tokenizer", "special_tokens")):
          shutil.copy(os.path.join(tokenizer_from, name), tok_dir)
    else:
      train_tokenizer(tok_dir)
  tokenizer = AutoTokenizer.from_pretrained(tok_dir)
  eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
  splits = {}
  train_files, _ = corpus.split_files()
  test_files = [f for f in train_files if corpus.is_test_file(f)]
  lib_files = [f for f in train_files if not corpus.is_test_file(f)]
  for split, files in (("train", train_files), ("heldout", corpus.HELDOUT_SAMPLE),
                       ("heldout_modules", corpus.HELDOUT_MODULES),
                       ("train_lib", lib_files), ("train_test", test_files)):
    path = os.path.join(workdir, f"{split}_ids.npy")
    if not os.path.isfile(path):
      np.save(path + ".tmp.npy", corpus.tokenize_files(tokenizer, files, eos_id))
      os.replace(path + ".tmp.npy", path)
    splits[split] = np.load(path)
  return tokenizer, splits


def training_batch(splits: dict, rng: np.random.Generator, batch: int, seq_len: int,
                   test_share: float | None) -> np.ndarray:
  """Windows drawn uniformly over all training files, or with a fixed share from test suites."""
  if test_share is None:
    return corpus.batch_windows(splits["train"], rng, batch, seq_len)
  num_test = round(batch * test_share)
  return np.concatenate(
      [corpus.batch_windows(splits["train_test"], rng, num_test, seq_len),
       corpus.batch_windows(splits["train_lib"], rng, batch - num_test, seq_len)])


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether the CPU multiplies bfloat16 natively (AMX or AVX512-BF16); True when unknown."""
  try:
    with open(cpuinfo) as f:
      flags = set(f.read().split())
  except OSError:
    return True
  return bool(flags & {"amx_bf16", "avx512_bf16"})


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
  if step < warmup:
    return peak * (step + 1) / warmup
  progress = min(1.0, (step - warmup) / max(1, total - warmup))
  return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_state(path: str, state: dict):
  import torch
  torch.save(state, path + ".tmp")
  os.replace(path + ".tmp", path)  # atomic: a kill mid-save keeps the previous checkpoint


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True, help="HF checkpoint directory written at the end")
  parser.add_argument("--tokens", type=float, default=12e6, help="training tokens in all")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=512)
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast on CPUs that have "
                      "it natively (AMX, AVX512-BF16); float32 elsewhere")
  parser.add_argument("--compile", action="store_true", help="torch.compile the model")
  parser.add_argument("--init-from", help="checkpoint.pt of an earlier run, or an HF checkpoint "
                      "directory (the shipped target), whose weights and tokenizer this run "
                      "starts from (fresh optimizer and schedule); ignored once WORKDIR has its "
                      "own checkpoint")
  parser.add_argument("--test-share", type=float, help="share of each batch drawn from the test "
                      "suites (default: their share of the corpus, about 0.65)")
  parser.add_argument("--unlikelihood-batch", type=int, default=0, help="each step also "
                      "penalises repeated 4-grams in this many of the model's own greedy "
                      "continuations of training-file prompts (jetflow_jax.embedded.unlikelihood)")
  parser.add_argument("--unlikelihood-weight", type=float, default=1.0)
  parser.add_argument("--rollout-loss", choices=("teacher", "unlikelihood"), default="teacher",
                      help="teacher: match the --init-from model with repeats removed; "
                      "unlikelihood: -log(1 - p) of repeats (escapes into junk)")
  parser.add_argument("--unlikelihood-tokens", type=int, default=128,
                      help="tokens per continuation")
  parser.add_argument("--save-every-s", type=float, default=300)
  parser.add_argument("--eval-every", type=int, default=200)
  parser.add_argument("--export-only", action="store_true",
                      help="write --out from the latest checkpoint now (no quality measures)")
  parser.add_argument("--max-steps-now", type=int, default=0, help="stop after this many steps "
                      "in this process (to measure speed); 0 = run to the end")
  args = parser.parse_args()
  if args.test_share is not None and not 0 <= args.test_share <= 1:
    parser.error(f"--test-share must be in [0, 1], got {args.test_share}")
  if args.unlikelihood_batch < 0 or args.unlikelihood_tokens < 4:
    parser.error("--unlikelihood-batch must be >= 0 and --unlikelihood-tokens >= 4")
  if args.unlikelihood_batch and not args.init_from:
    parser.error("--unlikelihood-batch needs --init-from: the model whose loops it fixes")
  if args.init_from and not (os.path.isfile(args.init_from)
                             or os.path.isfile(os.path.join(args.init_from, "model.safetensors"))):
    parser.error(f"--init-from: no checkpoint.pt or HF checkpoint (model.safetensors) at "
                 f"{args.init_from}")

  if args.bf16 and not cpu_has_native_bf16():
    # Emulated bfloat16 measured 35x slower than float32 (AMD EPYC, AVX2 only).
    print("warning: --bf16 ignored: this CPU has no native bfloat16 (no amx_bf16 or "
          "avx512_bf16 flag), so autocast would be emulated; training in float32", flush=True)
    args.bf16 = False

  import torch
  from tqdm import tqdm
  from transformers import Qwen3ForCausalLM

  torch.set_num_threads(args.threads)
  os.makedirs(args.workdir, exist_ok=True)
  tokenizer, splits = prepare_data(args.workdir, init_tokenizer_dir(args.init_from))
  eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
  assert tokenizer.convert_tokens_to_ids(MASK_TOKEN) < len(tokenizer)
  tokens_per_step = args.batch_size * args.seq_len
  total_steps = int(args.tokens // tokens_per_step)

  torch.manual_seed(0)
  model = Qwen3ForCausalLM(model_config(len(tokenizer), eos_id))
  optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=0.1)
  train_model = torch.compile(model) if args.compile else model
  ckpt_path = os.path.join(args.workdir, "checkpoint.pt")
  metrics_path = os.path.join(args.workdir, "metrics.jsonl")
  step = 0
  if os.path.isfile(ckpt_path):
    state = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
  elif args.init_from:
    model.load_state_dict(init_weights(args.init_from))
    print(f"starting from the weights of {args.init_from}", flush=True)
  _truncate_metrics(metrics_path, step)
  if args.export_only:
    model.to(torch.bfloat16).save_pretrained(args.out)
    evaluation.save_tokenizer(tokenizer, args.out)
    print(f"exported step {step} to {args.out}")
    return
  num_params = sum(p.numel() for p in model.parameters())
  print(f"model {num_params / 1e6:.2f}M params; train {len(splits['train']) / 1e6:.2f}M tokens, "
        f"held-out {len(splits['heldout']) / 1e6:.2f}M sample + "
        f"{len(splits['heldout_modules']) / 1e6:.2f}M modules; step {step}/{total_steps}",
        flush=True)

  eval_batches = {f"{split}_loss": [corpus.batch_windows(splits[split],
                                                         np.random.default_rng(1000 + i), 16,
                                                         args.seq_len) for i in range(4)]
                  for split in ("heldout", "heldout_modules")}
  reference = None  # the --init-from model, kept frozen for the rollout terms
  if args.unlikelihood_batch:
    reference = Qwen3ForCausalLM(model_config(len(tokenizer), eos_id)).eval()
    reference.load_state_dict(init_weights(args.init_from))
    rollout_prompts = unlikelihood.prompt_pool(tokenizer, 4000, seed=5)
    # Monitored on held-out snippets: the loops the term is for, on text it never reads.
    monitor_prompts = unlikelihood.prompt_sources.snippet_prompts(tokenizer, 32, 48, seed=9,
                                                                  heldout=True)
  stop_requested = []  # SIGTERM/SIGINT finish the current step, save, then exit
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop_requested.append(True))
  last_save = time.perf_counter()
  steps_now = 0
  bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True)
  model.train()
  while step < total_steps:
    rng = np.random.default_rng(step)  # data depends on the step only: resumes are exact
    batch = torch.from_numpy(training_batch(splits, rng, args.batch_size, args.seq_len,
                                            args.test_share))
    lr = learning_rate(step, total_steps, args.lr, warmup=max(1, total_steps // 25))
    for group in optimizer.param_groups:
      group["lr"] = lr
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
      loss = train_model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
      record = {}
      objective = loss
      if args.unlikelihood_batch:
        picked = rng.choice(len(rollout_prompts), args.unlikelihood_batch, replace=False)
        ids, mask = unlikelihood.greedy_rollouts(model, [rollout_prompts[i] for i in picked],
                                                 eos_id, args.unlikelihood_tokens)
        logits = unlikelihood.rollout_logits(train_model, ids, mask)
        if args.rollout_loss == "teacher":
          with torch.no_grad():
            reference_logits = unlikelihood.rollout_logits(reference, ids, mask)
          term, record["repeated_share"] = unlikelihood.corrected_teacher_loss(
              logits, reference_logits, ids, mask, unlikelihood.PROMPT_TOKENS)
        else:
          term, record["repeated_share"] = unlikelihood.unlikelihood_loss(
              logits, ids, mask, unlikelihood.PROMPT_TOKENS)
        record["unlikelihood"] = term.item()
        objective = loss + args.unlikelihood_weight * term
    objective.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1
    steps_now += 1
    record.update({"step": step, "tokens": step * tokens_per_step, "loss": loss.item(),
                   "lr": lr, "grad_norm": float(grad_norm),
                   "tokens_per_s": tokens_per_step / (time.perf_counter() - start)})
    if step % args.eval_every == 0 or step == total_steps:
      for name, batches in eval_batches.items():
        record[name] = evaluation.mean_loss(model, batches)
      if args.unlikelihood_batch:
        ids, mask = unlikelihood.greedy_rollouts(model, monitor_prompts, eos_id, 128)
        record["heldout_distinct_4gram"] = float(np.mean(
            [evaluation.distinct_ngram_ratio(row)
             for row in ids[:, unlikelihood.PROMPT_TOKENS:].tolist()]))
        record["heldout_rollout_reference_nll"] = unlikelihood.reference_nll(
            reference, ids, mask, unlikelihood.PROMPT_TOKENS)
      model.train()
    with open(metrics_path, "a") as f:
      f.write(json.dumps(record) + "\n")
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
    finished = (step == total_steps or bool(stop_requested)
                or (args.max_steps_now and steps_now >= args.max_steps_now))
    if finished or time.perf_counter() - last_save > args.save_every_s:
      save_state(ckpt_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "step": step})
      last_save = time.perf_counter()
    if finished:
      break
  bar.close()
  if step == total_steps:
    evaluation.export(model, tokenizer, args.out, splits, args.workdir, reference)


def init_tokenizer_dir(init_from: str | None) -> str | None:
  """Where the tokenizer of `--init-from` lives: an HF directory holds its own, a run's
  checkpoint.pt sits beside the run's `tokenizer/`."""
  if not init_from:
    return None
  if os.path.isdir(init_from):
    return init_from
  return os.path.join(os.path.dirname(os.path.abspath(init_from)), "tokenizer")


def init_weights(init_from: str) -> dict:
  """The float32 state dict of `--init-from` (a run's checkpoint.pt or an HF directory)."""
  import torch
  if os.path.isdir(init_from):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(init_from, dtype=torch.float32).state_dict()
  return torch.load(init_from, weights_only=False)["model"]


def _truncate_metrics(path: str, step: int):
  """Drops metric lines written after the checkpoint being resumed."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    kept = [line for line in f if json.loads(line)["step"] <= step]
  with open(path, "w") as f:
    f.writelines(kept)


if __name__ == "__main__":
  main()
