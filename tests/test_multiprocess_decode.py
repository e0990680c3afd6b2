"""decode.py over a mesh that spans two processes (2 fake CPU devices each): every process
loads only its slices of a sharded checkpoint, the rows go where the mesh splits them, and
the greedy tokens equal one process decoding on one device; only process 0 prints.

The dense case drafts with a head under `--budget auto` and streams: each process times the
budgets' rounds and the stream's pace on its own clock, so these decisions must be process 0's
everywhere (`distributed.agreed`) or the processes run different programs and hang."""

import json

import jax
import jax.numpy as jnp
import pytest

import jetflow_jax
from conftest import run_cli
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import save_hf_head
from jetflow_jax.head_config import HeadConfig
from multiprocess import job

TIMEOUT = 240
PROMPT = [5, 17, 3, 88, 40, 9]


def random_head(directory, out_dir) -> list[str]:
  config, _ = jetflow_jax.load_qwen3(directory)
  head = HeadConfig.for_target(config, num_layers=1, block_size=4,
                               mask_token_id=config.vocab_size - 1, target_layer_ids=(0, 1))
  save_hf_head(init_head_params(head, jax.random.key(0)), head, out_dir, dtype=jnp.float32)
  return ["--head", out_dir, "--budget", "auto", "--max-budget", "4", "--top-k", "3"]


@pytest.mark.parametrize("moe,mesh", [(False, "data=2,tp=2"), (True, "tp=2,ep=2")])
def test_two_processes_decode_like_one_device(make_checkpoint, tmp_path, moe, mesh):
  overrides = dict(num_experts=8) if moe else {}
  directory, _ = make_checkpoint(moe=moe, max_shard_size="40KB", **overrides)
  common = ["decode.py", "--checkpoint", directory, "--prompt-ids", ",".join(map(str, PROMPT)),
            "--batch-size", "2", "--max-new-tokens", "12"]
  single = run_cli(*common, "--json")
  assert single.returncode == 0, single.stderr
  want = json.loads(single.stdout)
  streamed = not moe
  flags = random_head(directory, str(tmp_path / "head")) if streamed else ["--json"]

  with job([*common, *flags, "--mesh", mesh], 2, 2, str(tmp_path)) as running:
    assert running.wait(TIMEOUT) == [0, 0], running.output(0) + running.output(1)
    out, quiet = running.output(0), running.output(1)
  if streamed:  # no tokenizer: on stdout, the prompt's ids, then the new ones as they come
    text = running.stdout(0)
    assert "[Gloo]" not in text  # its prints go to stderr (distributed.initialize)
    shown = " ".join(map(str, PROMPT)) + " "  # the new ids stand apart from the prompt's
    streamed_ids = text[text.index(shown) + len(shown):].split()
    assert all(t.isdigit() for t in streamed_ids), text  # nothing else inside the stream
    assert [int(t) for t in streamed_ids] == want["token_ids"]
    assert "[jetflow: 12 tokens, budget auto: " in out
    assert "[jetflow" not in quiet  # one summary line, process 0's
    return
  lines = [line for line in out.splitlines() if line.startswith("{")]
  assert not [line for line in quiet.splitlines() if line.startswith("{")]
  got = json.loads(lines[-1])
  assert got["token_ids"] == want["token_ids"]
  assert [row["token_ids"] for row in got["rows"]] == [row["token_ids"] for row in want["rows"]]
