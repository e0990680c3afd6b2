"""python -m jetflow_jax.bench: a quick run writes a well-formed table, JSON and plot."""

import json

import jax
import jax.numpy as jnp
import pytest

import jetflow_jax
from conftest import run_cli
from jetflow_jax.errors import InputError
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


def test_tree_options_run_the_papers_comparison_beside_the_controlled_one(make_checkpoint):
  from jetflow_jax.bench import report
  from jetflow_jax.bench.run import parse_trees, run_benchmark, runs_per_benchmark, tree_cells
  trees = parse_trees("paper")
  assert trees == ((None, "top_n"), ("ddtree", "wide"), ("jetflow", "accum"))
  assert tree_cells("ddtree", [8, 16], [7], trees) == [(8, 7, "top_n"), (8, 7, "wide"),
                                                        (16, 7, "top_n"), (16, 15, "wide")]
  assert tree_cells("jetflow", [8], [2, 3], parse_trees("accum")) == [(8, 2, "accum"),
                                                                      (8, 3, "accum")]
  assert runs_per_benchmark(["ar", "dflash", "ddtree", "jetflow"], [8], [7], [0.0], 3,
                            trees) == (1 + 1 + 2 + 2) * 3
  for bad in ("best", "dflash:accum", "jetflow:"):
    with pytest.raises(InputError, match="--trees entries"):
      parse_trees(bad)

  directory, _ = make_checkpoint(num_hidden_layers=2)
  config, params = jetflow_jax.load_qwen3(directory)
  heads = {}
  for kind, causal in (("jetflow", True), ("ddtree", False)):
    head = HeadConfig.for_target(config, num_layers=1, block_size=4, mask_token_id=95,
                                 target_layer_ids=(0,), causal=causal)
    heads[kind] = (head, init_head_params(head, jax.random.key(0)))
  cells, _ = run_benchmark(params, config, heads, [[1, 2, 3]], methods=["ddtree", "jetflow"],
                           budgets=[6], temperatures=[0.0], max_new_tokens=6, top_ks=[2],
                           trees=trees)
  assert [(c.method, c.top_k, c.tree) for c in cells] == [
      ("ddtree", 2, "top_n"), ("ddtree", 5, "wide"), ("jetflow", 2, "top_n"),
      ("jetflow", 2, "accum")]
  assert all(c.identical_to_ar for c in cells)
  assert "| 0 | jetflow | 6 | 2 | accum |" in report.markdown_table(cells)
