"""Train a draft head on a frozen Qwen3 target.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/qwen3_8b.py --workdir=runs/8b \
      --config.target.checkpoint=/models/Qwen3-8B --config.data.prompts=prompts.jsonl
  python train.py --config=configs/qwen3_8b.py --config.target.checkpoint=DIR --validate_only
  python train.py --config=configs/qwen3_8b.py --memory_report --config.mesh.fsdp=8 \
      --config.train.batch_size=8 --config.train.num_anchors=512 [--json]

  # one process per host: add to each
  python train.py ... --coordinator_address=HOST:PORT --num_processes=N --process_id=I

Re-running the same command resumes from the workdir's latest checkpoint; SIGTERM saves one
after the current step and exits 0. On SLURM, Open MPI or a TPU pod the process flags can be
left out: JAX reads them from the environment. `--memory_report` compiles the train step on
abstract shapes (no weights; fake CPU devices when the mesh needs more than the host has) and
prints XLA's per-device memory analysis; with `--num_processes=N --devices_per_process=D` it
sizes a job of N hosts of D devices each, without the hosts.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jetflow_jax import cli, compile_cache, distributed
from jetflow_jax.config_files import load_config_file
from jetflow_jax.errors import JetflowError


class ConfigFileParser(flags.ArgumentParser):
  """--config, as ml_collections parses it, but a file that is missing or fails to load is a
  flag error (one line) rather than a traceback at first use."""

  def parse(self, spec):
    try:
      config = load_config_file(spec)
    except JetflowError as e:
      raise ValueError(str(e)) from None
    config.lock()
    return config

  def flag_type(self):
    return "config object"


distributed.define_flags()
_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file",
                                          lock_config=True)
flags.FLAGS["config"].parser = ConfigFileParser()
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics, data")
_VALIDATE_ONLY = flags.DEFINE_bool("validate_only", False,
                                   "check the config against the target's config.json and exit")
_MEMORY_REPORT = flags.DEFINE_bool("memory_report", False,
                                   "compile the train step without weights, print its per-device "
                                   "memory and exit")
_JSON = flags.DEFINE_bool("json", False, "with --memory_report: print one JSON object")
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", None, "with --memory_report and --num_processes: devices of each "
    "process of the job to size")


def parse_flags(argv):
  """absl's flag parsing, its errors (a bad --config among them) as one line and exit 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = _CONFIG.value

  def run():
    if _MEMORY_REPORT.value:
      from jetflow_jax.train import memory_report
      report = memory_report.memory_report(config, **memory_report.job_layout(
          flags.FLAGS.num_processes, _DEVICES_PER_PROCESS.value,
          flags.FLAGS.coordinator_address, flags.FLAGS.process_id))
      print(json.dumps(report) if _JSON.value else memory_report.format_report(report))
      return
    distributed.initialize_from_flags()  # before anything touches a device
    compile_cache.enable()  # a resumed or repeated run loads its train step instead of compiling
    from jetflow_jax.train import setup
    if _VALIDATE_ONLY.value:
      print(setup.validate(config))
      return
    if not _WORKDIR.value:
      raise cli.InputError("--workdir is required for training")
    setup.check_data(config, _WORKDIR.value)  # before anything loads or is written
    setup.say(f"training a {config.head.num_layers}-layer "
              f"{'JetFlow' if config.head.causal else 'DFlash'} head into {_WORKDIR.value}")
    from jetflow_jax.train.loop import train_and_evaluate
    result = train_and_evaluate(config, _WORKDIR.value)
    if "past_total_steps" in result:
      print(f"nothing to do: {_WORKDIR.value} is already at step {result['step']}, past the "
            f"{result['past_total_steps']} steps this config asks for")
      print(setup.how_to_decode(config, _WORKDIR.value))
      return
    if result.get("preempted"):
      print(f"preempted: saved step {result['step']}; rerun the same command to resume",
            flush=True)
      return
    print(f"done: step {result['step']}, loss {result.get('loss', float('nan')):.4f}, "
          f"depth-1 agreement {result.get('agreement_k', [float('nan')])[0]:.3f}")
    if "acceptance" in result:
      print(f"held out ({config.eval.prompts}): {result['acceptance'].summary()}")
    print(setup.how_to_decode(config, _WORKDIR.value))

  cli.run(run)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=parse_flags)
