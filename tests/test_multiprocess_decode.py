"""decode.py over a mesh that spans two processes (2 fake CPU devices each): every process
loads only its slices of a sharded checkpoint, the rows go where the mesh splits them, and
the greedy tokens equal one process decoding on one device; only process 0 prints."""

import json

import pytest

from conftest import run_cli
from multiprocess import job

TIMEOUT = 240


@pytest.mark.parametrize("moe,mesh", [(False, "data=2,tp=2"), (True, "tp=2,ep=2")])
def test_two_processes_decode_like_one_device(make_checkpoint, tmp_path, moe, mesh):
  overrides = dict(num_experts=8) if moe else {}
  directory, _ = make_checkpoint(moe=moe, max_shard_size="40KB", **overrides)
  common = ["decode.py", "--checkpoint", directory, "--prompt-ids", "5,17,3,88,40,9",
            "--batch-size", "2", "--max-new-tokens", "12", "--json"]
  single = run_cli(*common)
  assert single.returncode == 0, single.stderr
  want = json.loads(single.stdout)

  with job([*common, "--mesh", mesh], 2, 2, str(tmp_path)) as running:
    assert running.wait(TIMEOUT) == [0, 0], running.output(0) + running.output(1)
    lines = [line for line in running.output(0).splitlines() if line.startswith("{")]
    assert not [line for line in running.output(1).splitlines() if line.startswith("{")]
  got = json.loads(lines[-1])
  assert got["token_ids"] == want["token_ids"]
  assert [row["token_ids"] for row in got["rows"]] == [row["token_ids"] for row in want["rows"]]
