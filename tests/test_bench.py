"""python -m jetflow_jax.bench: a quick run writes a well-formed table, JSON and plot."""

import json

import jax
import jax.numpy as jnp

import jetflow_jax
from conftest import run_cli
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import save_hf_head
from jetflow_jax.head_config import HeadConfig


def test_quick_benchmark_writes_results(make_checkpoint, tmp_path):
  directory, _ = make_checkpoint(num_hidden_layers=4)
  config, _ = jetflow_jax.load_qwen3(directory)
  heads = {}
  for kind, causal in (("jetflow", True), ("dflash", False)):
    head = HeadConfig.for_target(config, num_layers=1, block_size=5, mask_token_id=95,
                                 target_layer_ids=(0, 2), causal=causal)
    heads[kind] = str(tmp_path / kind)
    save_hf_head(init_head_params(head, jax.random.key(0)), head, heads[kind], dtype=jnp.float32)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5, 6, 7, 8]}\n'
                     '{"prompt_ids": [9]}\n')
  out = tmp_path / "results"
  done = run_cli("-m", "jetflow_jax.bench", "--checkpoint", directory, "--head", heads["jetflow"],
                 "--dflash-head", heads["dflash"], "--dataset", f"jsonl:{prompts}", "--limit", "2",
                 "--methods", "ar,dflash,jetflow",  # ddtree is jetflow's tree with dflash's head
                 "--budgets", "16", "--top-k", "2,3", "--max-new-tokens", "8", "--out", str(out))
  assert done.returncode == 0, done.stderr
  record = json.loads((out / "results.json").read_text())
  cells = {(c["method"], c["top_k"], c["temperature"]): c for c in record["cells"]}
  # The trees run at every top-k; AR and the chain have none.
  expected = [("ar", None), ("dflash", None), ("jetflow", 2), ("jetflow", 3)]
  assert set(cells) == {(m, k, t) for m, k in expected for t in (0.0, 1.0)}
  assert len(record["cells"]) == len(cells)
  for (method, _, temperature), cell in cells.items():
    assert cell["num_tokens"] == 16 and cell["wall_s"] > 0 and cell["tau"] >= 1
    assert cell["identical_to_ar"] is (True if temperature == 0 else None)
  assert cells[("dflash", None, 0.0)]["budget"] == 5
  assert cells[("jetflow", 3, 0.0)]["budget"] == 16
  assert record["transformers_peer"]["identical_to_ar"] is True
  assert "| 0 | jetflow | 16 | 3 |" in done.stdout and "| 0 | dflash | 5 | - |" in done.stdout
  assert (out / "results.md").exists()
  assert (out / "results.png").stat().st_size > 1000
