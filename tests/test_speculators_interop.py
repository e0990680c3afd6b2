"""Our speculators exports, checked by speculators 0.9.0 itself in its own venv.

The venv is made once per machine by `scripts/speculators_venv.py` (`make test` does it before
the suite; ~2 minutes the first time, then reused); this test skips, saying why, only where it
cannot be installed. `tests/speculators_check.py` runs inside it.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from conftest import ROOT
from jetflow_jax import embedded
from jetflow_jax.head import draft_logits, to_target_ids, with_draft_vocab
from jetflow_jax.head_checkpoint import export_head, load_head, save_speculators_head
from jetflow_jax.speculators_format import read_verifier

TOKENS = [5, 17, 300, 88, 40, 1000, 7, 9, 11, 400, 33, 21, 2, 64]
ANCHOR = 11  # context: the 11 tokens before it


@pytest.fixture(scope="module")
def speculators_python():
  spec = importlib.util.spec_from_file_location(
      "speculators_venv", os.path.join(ROOT, "scripts", "speculators_venv.py"))
  venv = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(venv)
  try:
    return venv.ensure()
  except venv.Unavailable as e:
    pytest.skip(f"speculators 0.9.0 cannot be installed here: {e}")


def run_speculators(python, cases, tmp_path):
  request, result = tmp_path / "request.json", tmp_path / "result.npz"
  request.write_text(json.dumps({"cases": cases}))
  # -I: the tests folder must not shadow speculators' own imports (tests/multiprocess.py).
  done = subprocess.run([python, "-I", os.path.join(ROOT, "tests", "speculators_check.py"),
                         str(request), str(result)], capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return np.load(result)


def test_exports_load_in_speculators_and_draft_what_we_draft(speculators_python, tmp_path):
  """dflash and jetspec exports of the embedded heads, and a dflash head with a 2,048-token draft
  vocabulary: speculators loads each with no missing or unexpected keys (beyond those it takes
  from the verifier), reads our taps, mask and verifier, and its own modules give our draft
  logits on the same context and anchor within 1e-4 (float32)."""
  target_config, target_params = jetflow_jax.load_qwen3(embedded.TARGET_DIR, jnp.float32)
  dirs = {}
  for name, kind in (("dflash", "dflash"), ("jetspec", "jetflow")):
    dirs[name] = str(tmp_path / name)
    export_head(embedded.HEAD_DIRS[kind], "speculators", dirs[name], dtype=jnp.float32)
  head, params = load_head(embedded.HEAD_DIRS["dflash"])
  ids = np.sort(np.random.default_rng(0).choice(target_config.vocab_size, 2048, replace=False))
  small = dataclasses.replace(head, draft_vocab_size=2048)
  dirs["draft_vocab"] = str(tmp_path / "draft_vocab")
  save_speculators_head(with_draft_vocab(params, target_params, target_config, ids), small,
                        dirs["draft_vocab"], read_verifier(embedded.TARGET_DIR), jnp.float32)

  cases = [dict(name=name, dir=path, target=embedded.TARGET_DIR, tokens=TOKENS, anchor=ANCHOR,
                causal=name == "jetspec") for name, path in dirs.items()]
  result = run_speculators(speculators_python, cases, tmp_path)
  for name, path in dirs.items():
    info = json.loads(str(result[f"{name}/info"]))
    config, params = load_head(path)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == []
    assert info["aux_hidden_state_layer_ids"] == [i + 1 for i in config.target_layer_ids]
    assert (info["mask_token_id"], info["block_size"]) == (config.mask_token_id, 16)
    assert info["draft_vocab_size"] == config.output_vocab_size
    assert info["verifier"] == embedded.TARGET_DIR
    ours = np.asarray(draft_logits(params, config, target_params, target_config,
                                   np.array([TOKENS[:ANCHOR + 1]])))[0]
    theirs = result[f"{name}/logits"][1:]  # row 0 is the anchor's
    assert ours.shape == theirs.shape == (15, config.output_vocab_size)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0, err_msg=name)
  np.testing.assert_array_equal(result["draft_vocab/target_ids"], ids)
  _, loaded = load_head(dirs["draft_vocab"])
  np.testing.assert_array_equal(to_target_ids(loaded, small, jnp.arange(2048)), ids)
