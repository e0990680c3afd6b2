"""Train a draft head on a frozen Qwen3 target.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/qwen3_8b.py --workdir=runs/8b \
      --config.target.checkpoint=/models/Qwen3-8B --config.data.prompts=prompts.jsonl
  python train.py --config=configs/qwen3_8b.py --config.target.checkpoint=DIR --validate_only

Re-running the same command resumes from the workdir's latest checkpoint.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from jetflow_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics, data")
_VALIDATE_ONLY = flags.DEFINE_bool("validate_only", False,
                                   "check the config against the target's config.json and exit")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = _CONFIG.value

  def run():
    from jetflow_jax.train import setup
    if _VALIDATE_ONLY.value:
      print(setup.validate(config))
      return
    if not _WORKDIR.value:
      raise cli.InputError("--workdir is required for training")
    from jetflow_jax.train.loop import train_and_evaluate
    result = train_and_evaluate(config, _WORKDIR.value)
    print(f"done: step {result['step']}, loss {result.get('loss', float('nan')):.4f}, "
          f"depth-1 agreement {result.get('agreement_k', [float('nan')])[0]:.3f}")

  cli.run(run)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
