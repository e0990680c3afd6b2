"""Hub ids resolve offline through a Hugging Face cache; a missing one is one clear line."""

import os
import shutil
import subprocess
import sys

import pytest

import jetflow_jax
from conftest import CLI_ENV, ROOT
from jetflow_jax import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root, repo_id: str, files_from: str):
  """The hub cache layout: models--org--name/{refs/main, snapshots/COMMIT/...}."""
  repo = root / ("models--" + repo_id.replace("/", "--"))
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / "main").write_text(COMMIT)
  shutil.copytree(files_from, repo / "snapshots" / COMMIT)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
  cache = tmp_path / "hub"
  cache.mkdir()
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  import huggingface_hub.constants as constants
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return cache


def test_hub_id_loads_from_the_cache_offline(make_checkpoint, offline_cache):
  directory, _ = make_checkpoint()
  fake_cache(offline_cache, "Qwen/Qwen3-Tiny", directory)
  assert hub.is_hub_id("Qwen/Qwen3-Tiny") and not hub.is_hub_id(directory)
  config, params = jetflow_jax.load_qwen3("Qwen/Qwen3-Tiny")
  assert config.vocab_size == 96
  assert os.path.basename(hub.resolve(f"Qwen/Qwen3-Tiny@{COMMIT}")) == COMMIT


def test_missing_hub_id_offline_is_one_clear_line(offline_cache):
  with pytest.raises(jetflow_jax.CheckpointError, match="hf download JetSpec/nothing-here"):
    hub.resolve("JetSpec/nothing-here")
  env = dict(CLI_ENV, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(offline_cache))
  done = subprocess.run([sys.executable, "decode.py", "--checkpoint", "Qwen/Qwen3-Missing",
                         "--prompt-ids", "1"], cwd=ROOT, capture_output=True, text=True, env=env,
                        timeout=300)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert f"not in the Hugging Face cache ({offline_cache})" in done.stderr
  assert "hf download Qwen/Qwen3-Missing" in done.stderr
