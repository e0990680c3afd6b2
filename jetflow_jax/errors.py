"""Errors that name the problem; CLIs print them without a traceback."""


class JetflowError(Exception):
  """Base class for every error this library raises on bad input."""


class CheckpointError(JetflowError):
  """A checkpoint directory or file is missing, truncated or inconsistent."""


class ConfigError(JetflowError):
  """A config is unsupported or does not fit the model it is used with."""


class InputError(JetflowError):
  """A prompt, flag or argument value is invalid (too long, out of range, ...)."""
