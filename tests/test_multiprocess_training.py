"""train.py and regeneration as several processes on one machine: the head and losses of one
process, SIGTERM, a killed peer, restarts on another process count, one shard per process, and
the process flags' errors.

Each process gets K fake CPU devices and joins a coordinator on a free loopback port; the
references run in this process (pytest's 4 devices, the first 2 or all 4).
"""

import importlib.util
import json
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

import jetflow_jax
from conftest import ROOT, run_cli
from jetflow_jax.decoding import generate
from jetflow_jax.errors import ConfigError
from jetflow_jax.head_checkpoint import load_head
from jetflow_jax.train.loop import train_and_evaluate
from jetflow_jax.train.sharding import check_batch, make_mesh
from jetflow_jax.train.store import TokenStore
from multiprocess import job, wait_for

# configs/tiny.py with a 128-token random target: 100 steps compile and run in seconds.
FAST = {"target.random.vocab_size": 128, "target.random.num_hidden_layers": 4,
        "head.mask_token_id": 127, "head.target_layer_ids": (0, 2), "data.prompts": "",
        "data.seq_len": 48, "train.batch_size": 4, "train.epochs": 10, "train.num_steps": 100,
        "train.checkpoint_every": 4, "train.log_every": 1}
TIMEOUT = 240


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
  """A given regenerated JSONL (what a regeneration run would have written)."""
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("data") / "regenerated.jsonl"
  with open(path, "w") as f:
    for i in range(64):
      f.write(json.dumps({"id": i, "prompt_ids": rng.integers(0, 127, 6).tolist(),
                          "response_ids": rng.integers(0, 127, int(rng.integers(8, 40))).tolist()})
              + "\n")
  return str(path)


def settings(regenerated, **extra):
  return {**FAST, "data.regenerated": regenerated, **extra}


def cli_args(workdir, values):
  flag = lambda v: f"({','.join(map(str, v))})" if isinstance(v, tuple) else v
  return ["train.py", "--config=configs/tiny.py", f"--workdir={workdir}",
          *[f"--config.{key}={flag(value)}" for key, value in values.items()]]


def train_here(workdir, values, devices):
  """train_and_evaluate in this process on its first `devices` devices."""
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  config = tiny.get_config()
  fsdp = values.get("mesh.fsdp", 1)
  config.update_from_flattened_dict({**values, "mesh.data": devices // fsdp})
  return train_and_evaluate(config, str(workdir))


def losses(workdir):
  """Loss by step, each step logged once (process 0 alone writes metrics)."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  steps = [row["step"] for row in rows]
  assert steps == sorted(set(steps)), steps
  return {row["step"]: row["loss"] for row in rows}


def assert_heads_equal(workdir_a, workdir_b, atol=1e-6):
  _, a = load_head(str(workdir_a))
  _, b = load_head(str(workdir_b))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=atol), a, b)


def checkpoint_exists(workdir, step):
  return os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))


def test_two_processes_train_like_one_and_resume_on_one_after_sigterm(tmp_path, regenerated):
  values = settings(regenerated)
  reference = tmp_path / "one_process"
  train_here(reference, values, devices=2)

  workdir = tmp_path / "two_processes"
  with job(cli_args(workdir, values), 2, 1, str(tmp_path), "preempted") as two:
    wait_for(lambda: checkpoint_exists(workdir, 4), TIMEOUT, "the step-4 checkpoint")
    two.processes[1].send_signal(signal.SIGTERM)  # SLURM would signal every task; one is enough
    assert two.wait(TIMEOUT) == [0, 0], two.output(0)[-3000:] + two.output(1)[-3000:]
  stopped = int(two.output(0).split("preempted: saved step ")[1].split(";")[0])
  assert 4 < stopped < 100 and checkpoint_exists(workdir, stopped)
  assert not os.path.exists(workdir / "hf_head")
  # Steps trained by two processes of one device each: the losses of one process of two devices.
  want = losses(reference)
  assert losses(workdir) == {step: want[step] for step in range(1, stopped + 1)}

  result = train_here(workdir, values, devices=2)  # the two processes' checkpoint, on one
  assert result["step"] == 100
  assert_heads_equal(workdir, reference)
  assert losses(workdir) == want


def test_two_by_two_killed_peer_restarts_and_matches_one_by_four(tmp_path, regenerated):
  values = settings(regenerated, **{"mesh.fsdp": 2, "train.num_steps": 12})
  reference = tmp_path / "one_process"
  train_here(reference, values, devices=4)

  killed = tmp_path / "killed"
  with job(cli_args(killed, values), 2, 2, str(tmp_path), "killed") as two:
    wait_for(lambda: checkpoint_exists(killed, 4), TIMEOUT, "the step-4 checkpoint")
    two.processes[1].kill()
    start = time.time()
    code = two.processes[0].wait(TIMEOUT)
    waited = time.time() - start
  assert code != 0 and waited < 90, (code, waited)
  # Stopped in a collective (gloo's error, then ours) or by JAX's heartbeat watch.
  assert ("usually means another process died" in two.output(0)
          or "another task died" in two.output(0)), two.output(0)[-3000:]
  saved = max(int(name) for name in os.listdir(killed / "checkpoints") if name.isdigit())
  with job(cli_args(killed, values), 2, 2, str(tmp_path), "restarted") as two:
    assert two.wait(TIMEOUT) == [0, 0], two.output(0)[-3000:]
  # Resumed from the last checkpoint (the progress bar starts there), not from scratch.
  assert re.search(r"(\d+)/12 \[", two.output(0)).group(1) == str(saved), two.output(0)[-3000:]
  # Four-term sums round differently across processes: the losses and heads agree, not the bits.
  want, got = losses(reference), losses(killed)
  assert sorted(got) == list(range(1, 13))
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=1e-4)
  assert_heads_equal(killed, reference, atol=1e-4)


def test_bad_process_flags_and_layouts_are_refused(tmp_path, regenerated):
  args = cli_args(tmp_path / "w", settings(regenerated))
  for flags, problem in (
      (["--num_processes=2"], "go together: got --num_processes without --coordinator_address, "
                              "--process_id"),
      (["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"],
       "--process_id=2 is outside [0, 2)"),
      (["--coordinator_address=nowhere", "--num_processes=2", "--process_id=0"],
       "must be HOST:PORT")):
    done = run_cli(*args, *flags, timeout=120)
    assert done.returncode == 2 and problem in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not os.path.exists(tmp_path / "w")
  with pytest.raises(ConfigError, match="must span all the 4 devices of 2 processes"):
    make_mesh(data=1, fsdp=2, devices=jax.devices(), num_processes=2)
  with pytest.raises(ConfigError, match="mesh.fsdp=3 must divide the 4 devices of 2 processes"):
    make_mesh(data=-1, fsdp=3, devices=jax.devices(), num_processes=2)
  with pytest.raises(ConfigError, match="must split evenly over the 4 processes"):
    check_batch(make_mesh(devices=jax.devices()), 6, num_processes=4)

  # Every process refuses, at once and writing nothing, a batch that does not split over them
  # and a mesh that does not divide their devices.
  for name, extra, problem in (
      ("odd", {"train.batch_size": 3},
       "train.batch_size=3 (the global batch) must split evenly over the 2 processes"),
      ("mesh", {"mesh.fsdp": 3}, "mesh.fsdp=3 must divide the 2 devices of 2 processes")):
    with job(cli_args(tmp_path / name, settings(regenerated, **extra)), 2, 1, str(tmp_path),
             name) as two:
      assert two.wait(120) == [2, 2]
    for p in range(2):
      assert f"error: {problem}" in two.output(p) and "Traceback" not in two.output(p)
    assert not os.path.exists(tmp_path / name)


SLOW_PEER = """
import sys, time
from jetflow_jax import cli, distributed
from jetflow_jax.errors import InputError
flags = dict(arg.lstrip("-").split("=") for arg in sys.argv[1:])

def run():
  distributed.initialize(flags["coordinator_address"], int(flags["num_processes"]),
                         int(flags["process_id"]))
  import jax
  jax.devices()
  if flags["process_id"] == "1":
    time.sleep(3)  # slower to reach the error than process 0, which holds the coordinator
  raise InputError("the same bad value on every process")

cli.run(run)
"""


def test_an_error_every_process_meets_is_reported_by_each(tmp_path):
  """Process 0 waits for its peers before exiting: one that lost the coordinator first would
  abort (SIGABRT) instead of printing the error (seen in CI, once)."""
  script = tmp_path / "slow_peer.py"
  script.write_text(SLOW_PEER)
  with job([str(script)], 2, 1, str(tmp_path), "slow_peer") as two:
    assert two.wait(60) == [2, 2], two.output(1)[-2000:]
  for p in range(2):
    assert "error: the same bad value on every process" in two.output(p)


def test_each_process_regenerates_its_shard_on_all_its_devices(tmp_path, make_checkpoint):
  directory, _ = make_checkpoint(num_hidden_layers=2)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 90, int(rng.integers(3, 12))).tolist() for _ in range(11)]
  with open(tmp_path / "prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"id": f"q{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts))
  store = tmp_path / "store"
  args = ["-m", "jetflow_jax.train.regenerate", f"--target={directory}",
          f"--prompts={tmp_path / 'prompts.jsonl'}", f"--out={store}", "--max_new_tokens=6",
          "--batch_size=3", "--dtype=float32"]
  for run in ("first", "again"):  # the second run finds both shards done
    with job(args, 2, 2, str(tmp_path), run) as two:
      assert two.wait(TIMEOUT) == [0, 0], two.output(0)[-3000:]
  assert "regenerated 6 records" in (tmp_path / "first.0.log").read_text()
  assert "regenerated 5 records" in (tmp_path / "first.1.log").read_text()
  assert "regenerated 0 records" in (tmp_path / "again.1.log").read_text()
  assert sorted(os.listdir(store)) == ["shard-00000-of-00002", "shard-00001-of-00002",
                                       "store.json"]
  config, params = jetflow_jax.load_qwen3(directory)
  regenerated = TokenStore(str(store))
  for i, prompt in enumerate(prompts):  # source order across the shards
    assert regenerated.tokens(i).tolist() == prompt + generate(params, config, [prompt], 6).tokens[0]
