"""train.py --memory_report: the step compiled on abstract shapes over a 2-device fake mesh, and
a job of 2 processes x 2 devices sized without its hosts; decode.py --memory_report over tp=2."""

import json

import pytest

from conftest import run_cli
from jetflow_jax import config_files
from jetflow_jax.errors import InputError
from jetflow_jax.train import memory_report

# A small vocabulary keeps the compile to seconds; the mesh's 2 devices are fake CPU devices
# the report asks jax for (the CLI subprocess starts with one).
SMALL = ["--config.target.random.vocab_size=512", "--config.head.mask_token_id=511",
         "--config.target.random.num_hidden_layers=3", "--config.head.target_layer_ids=(0,1)",
         "--config.mesh.fsdp=2"]


def report_args(*extra):
  return ["train.py", "--config=configs/tiny.py", "--memory_report", *SMALL, *extra]


def test_json_report_is_self_consistent():
  done = run_cli(*report_args("--json"), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert report["num_devices"] == 2 and report["mesh"] == {"data": 1, "fsdp": 2}
  assert report["platform"] == "cpu" and report["batch_per_device"] == 1
  m = report["per_device_bytes"]
  assert min(m["arguments"], m["outputs"], m["temporaries"], m["total"]) > 0
  # The donated state's outputs are written over its argument buffers: counted once.
  assert 0 < m["aliased"] <= min(m["arguments"], m["outputs"])
  assert m["total"] == m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"]
  # XLA's buffer assignment accounts for the same bytes allocation by allocation.
  allocations = report["allocation_bytes"]
  assert allocations["argument"] == m["arguments"]
  assert allocations["temporary"] == m["temporaries"]
  assert allocations.get("output", 0) == m["outputs"] - m["aliased"]
  assert 0 < report["peak_live_bytes"] <= m["total"]
  buffers = report["largest_buffers"]
  sizes = [b["bytes"] for b in buffers]
  assert buffers and sizes == sorted(sizes, reverse=True)
  assert sum(sizes) <= report["peak_live_bytes"]
  assert all(b["shape"] and b["kind"] in ("argument", "output", "temporary") for b in buffers)
  assert all(v > 0 for v in report["estimate_bytes"].values())
  text = memory_report.format_report(report)
  assert "temporaries" in text and "Largest buffers live at the peak" in text


def test_a_job_of_several_hosts_is_sized_without_them():
  done = run_cli(*report_args("--num_processes=2", "--devices_per_process=2",
                              "--config.train.batch_size=4", "--json"), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert report["num_devices"] == 4 and report["mesh"] == {"data": 2, "fsdp": 2}
  assert report["num_processes"] == 2 and report["batch_per_process"] == 2
  assert "job: 2 processes x 2 devices, 2 rows of each batch per process; each fsdp group stays " \
      "on one process" in memory_report.format_report(report)
  with pytest.raises(InputError, match="not --coordinator_address or --process_id"):
    memory_report.job_layout(2, 2, "127.0.0.1:1234", 0)
  with pytest.raises(InputError, match="--num_processes and --devices_per_process go together"):
    memory_report.job_layout(2, None)


def test_bad_mesh_is_one_line():
  done = run_cli(*report_args("--config.train.batch_size=3"), timeout=120)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.strip() == "error: batch_size=3 must be a multiple of data x fsdp = 2"


def test_published_shapes_fit_their_heads():
  from configs import qwen3_4b, qwen3_8b, qwen3_30b_a3b
  for module, layers in ((qwen3_8b, 36), (qwen3_4b, 36), (qwen3_30b_a3b, 48)):
    config = module.get_config()
    target, source = config_files.target_shape(config)
    assert source == "target.shape" and target.num_hidden_layers == layers
    config_files.head_config(config, target)  # taps and widths fit the published shape


def test_decode_memory_report_splits_over_tp_and_adds_up():
  """decode.py --memory_report on configs/tiny.py over tp=2 (fake devices, no weights)."""
  args = ["decode.py", "--memory_report", "--config", "configs/tiny.py", "--batch-size", "2",
          "--budget", "16", "--cache-size", "256", "--json"]
  done = run_cli(*args, "--mesh", "tp=2", timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert report["num_devices"] == 2 and report["mesh"] == {"data": 1, "tp": 2, "ep": 1}
  target, m = report["target"], report["per_device_bytes"]
  # The target cache (2 kv heads over tp=2): one kv head a device, bf16, context + a round.
  slots = report["context"] + report["head"]["block_size"]
  assert report["kv_cache_split_over_tp"]
  assert m["target KV cache"] == 2 * target["layers"] * slots * 1 * 16 * report["batch"] * 2
  for phase in ("prefill", "decode loop (rounds)"):
    a = m[phase]
    assert a["total"] == a["arguments"] + a["outputs"] - a["aliased"] + a["temporaries"]
    assert 0 < a["peak_without_cpu_copies"] == a["total"] - a["cpu_f32_copies_at_peak"]
    assert a["peak_without_cpu_copies"] >= m["target weights"] + m["target KV cache"]
  missing = run_cli(*[a for a in args if a not in ("--config", "configs/tiny.py")], timeout=120)
  assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1] == (
      "error: --memory_report needs --config (a training config file: configs/NAME.py)")
