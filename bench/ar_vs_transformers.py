"""Plain AR decoding, jetflow_jax against transformers on the same Qwen3 shapes and weights, side
by side on this CPU, against the bandwidth floor (one read of the weights per token).

  python bench/ar_vs_transformers.py                          # Qwen3-0.6B shapes, ~5 minutes
  python bench/ar_vs_transformers.py --preset qwen3-1.7b --new-tokens 16

One random float32 Qwen3 (transformers' own init) is written as safetensors and loaded by both;
each pass decodes one random prompt greedily with both (transformers' `generate` and
jetflow_jax's `generate`), the order rotated from pass to pass, and a cell's figure is its median over `--repeats` passes. Times are of decoding only,
prefill included (jetflow_jax's `Generation.wall_s`, its programs compiled and run once before;
transformers' `generate` after an untimed first call). The floor is the weights' bytes over the
host's read bandwidth (`roofline.host_device()`), per token. Writes
bench/results/ar_vs_transformers_<preset>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jetflow_jax import load_qwen3, roofline  # noqa: E402
from jetflow_jax.model import decode_kernel_layout, with_kernel_layout  # noqa: E402
from jetflow_jax.decoding import generate  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import step_costs  # noqa: E402


def hf_model(config) -> transformers.Qwen3ForCausalLM:
  hf_config = transformers.Qwen3Config(
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
      rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
      tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=40960,
      torch_dtype="float32")
  torch.manual_seed(0)
  return transformers.Qwen3ForCausalLM(hf_config).float().eval()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--preset", choices=("qwen3-0.6b", "qwen3-1.7b"), default="qwen3-0.6b")
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out")
  args = parser.parse_args()
  config = step_costs.PRESETS[args.preset].config
  torch.set_num_threads(os.cpu_count() or 1)
  model = hf_model(config)
  weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
  prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, args.prompt_len))
  n = args.new_tokens

  def run_transformers():
    with torch.inference_mode():
      start = time.perf_counter()
      out = model.generate(torch.tensor(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
      seconds = time.perf_counter() - start
    return seconds, out[0, args.prompt_len:].tolist()

  with tempfile.TemporaryDirectory() as directory:
    model.save_pretrained(directory, safe_serialization=True)
    _, params = load_qwen3(directory, jnp.float32)
  params = with_kernel_layout(params, decode_kernel_layout())  # as `decode.py` decodes

  def run_jax():
    result = generate(params, config, prompt.tolist(), n, stop_tokens=(), warmup=True)
    return result.wall_s, result.tokens[0]
  cells = {"transformers": run_transformers, "jetflow_jax": run_jax}
  tokens = {name: cell()[1] for name, cell in cells.items()}  # first calls: compile, warm
  seconds = {name: [] for name in cells}
  names = list(cells)
  for repeat in range(args.repeats):
    shift = repeat % len(names)
    for name in names[shift:] + names[:shift]:
      elapsed, got = cells[name]()
      assert got == tokens[name], f"{name} decoded other tokens on a rerun"
      seconds[name].append(elapsed)
      print(f"pass {repeat}: {name} {1e3 * elapsed / n:.1f} ms/token", flush=True)
  host = roofline.host_device()
  floor_ms = 1e3 * weight_bytes / host.hbm_bytes_per_s
  reference = tokens["transformers"]
  rows = []
  for name in names:
    ms = 1e3 * statistics.median(seconds[name]) / n
    agree = sum(a == b for a, b in zip(tokens[name], reference)) / n
    rows.append(dict(cell=name, ms_per_token=ms, tokens_per_s=1e3 / ms, over_floor=ms / floor_ms,
                     agreement_with_transformers=agree, seconds=seconds[name]))
  print(f"\n{args.preset}, float32, batch 1, prompt {args.prompt_len}, {n} new tokens; "
        f"weights {weight_bytes / 1e9:.2f} GB, read at {host.hbm_bytes_per_s / 1e9:.1f} GB/s: "
        f"floor {floor_ms:.1f} ms/token\n")
  print("| cell | ms/token | tokens/s | x floor | tokens equal to transformers' |")
  print("|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['cell']} | {row['ms_per_token']:.1f} | {row['tokens_per_s']:.2f} | "
          f"{row['over_floor']:.2f} | {row['agreement_with_transformers']:.2f} |")
  out = args.out or os.path.join(ROOT, "bench", "results", f"ar_vs_transformers_{args.preset}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(dict(preset=args.preset, prompt_len=args.prompt_len, new_tokens=n,
                   repeats=args.repeats, weight_bytes=weight_bytes, floor_ms=floor_ms,
                   host=dataclasses.asdict(host), jax_version=jax.__version__,
                   torch_version=torch.__version__, transformers_version=transformers.__version__,
                   load_average=os.getloadavg(), rows=rows), f, indent=1)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
