"""The embedded model's corpus: the CPython standard library source of the running interpreter.

Every machine has it, so the corpus needs no download. A fixed list of modules is
held out (never trained on, neither by the tokenizer nor the target nor the heads)
and serves for evaluation next to the HumanEval prompts. Pre-training and evaluation read
it alike, as token streams (`tokenize_files`) cut into windows (`batch_windows`).
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

# Held out for evaluation, never trained on (tokenizer, target, heads). Two sets:
# a random sample of files drawn like the corpus (numpy seed 2026 over the files of 2-60 kB:
# 16 library modules and 24 test suites), which the target's quality bar reads, ...
HELDOUT_SAMPLE = (
    "_compression.py", "asyncio/staggered.py", "base64.py", "codecs.py",
    "distutils/command/bdist.py", "distutils/command/build_clib.py", "distutils/config.py",
    "fileinput.py", "io.py", "lib2to3/patcomp.py", "multiprocessing/synchronize.py", "netrc.py",
    "pty.py", "tkinter/colorchooser.py", "unittest/signals.py", "zipimport.py",
    "ctypes/test/test_functions.py", "distutils/tests/test_config_cmd.py",
    "distutils/tests/test_core.py", "test/_test_embed_set_config.py",
    "test/libregrtest/logger.py", "test/test_asyncio/test_runners.py",
    "test/test_asyncio/test_taskgroups.py", "test/test_cgitb.py", "test/test_context.py",
    "test/test_csv.py", "test/test_dbm_dumb.py", "test/test_dict.py", "test/test_dict_version.py",
    "test/test_genericclass.py", "test/test_importlib/builtin/test_loader.py",
    "test/test_marshal.py", "test/test_peepholer.py", "test/test_pstats.py", "test/test_queue.py",
    "test/test_sqlite3/test_userfunctions.py", "test/test_string_literals.py",
    "test/test_symtable.py", "test/test_tcl.py", "tkinter/test/support.py",
)
# ... and hand-picked, docstring-heavy library modules: a harder second row (3.2 nats/token
# where the first target's training windows read 2.3).
HELDOUT_MODULES = (
    "argparse.py", "bisect.py", "calendar.py", "csv.py", "dataclasses.py", "difflib.py",
    "fractions.py", "heapq.py", "json/decoder.py", "json/encoder.py", "pprint.py", "shlex.py",
    "statistics.py", "textwrap.py", "urllib/parse.py", "zipfile.py",
)
HELDOUT_FILES = HELDOUT_SAMPLE + HELDOUT_MODULES

# Machine-generated tables and data dumps that teach nothing about code.
_SKIPPED_PARTS = ("site-packages", "__pycache__", "encodings", "pydoc_data", "_sysconfigdata",
                  "lib2to3/tests/data", "test/decimaltestdata", "test/cjkencodings",
                  "idlelib/idle_test", "unicodedata", "ensurepip", "config-3")
MAX_FILE_BYTES = 200_000


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _wanted(relative: str, size: int) -> bool:
  return (relative.endswith(".py") and size <= MAX_FILE_BYTES
          and not any(part in relative for part in _SKIPPED_PARTS))


def source_files(root: str | None = None) -> list[str]:
  """Relative paths of every corpus file, sorted so that every machine agrees."""
  root = root or stdlib_dir()
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs.sort()
    for name in files:
      path = os.path.join(directory, name)
      relative = os.path.relpath(path, root).replace(os.sep, "/")
      if _wanted(relative, os.path.getsize(path)):
        found.append(relative)
  return sorted(found)


def read_source(relative: str, root: str | None = None) -> str:
  with open(os.path.join(root or stdlib_dir(), relative), encoding="utf-8", errors="replace") as f:
    return f.read()


def is_test_file(relative: str) -> bool:
  """Lib/test and the packages' own test suites: about 65% of the training bytes."""
  parts = relative.split("/")
  return any(p in ("test", "tests") for p in parts[:-1]) or parts[-1].startswith("test_")


def split_files(root: str | None = None) -> tuple[list[str], list[str]]:
  """(training files, held-out files); every held-out file must exist."""
  files = source_files(root)
  missing = [f for f in HELDOUT_FILES if f not in files]
  if missing:
    raise FileNotFoundError(f"held-out files missing from the standard library: {missing}")
  held = set(HELDOUT_FILES)
  return [f for f in files if f not in held], list(HELDOUT_FILES)


def tokenize_files(tokenizer, files: list[str], eos_id: int) -> np.ndarray:
  """All files' token ids, each file followed by EOS, as one uint16 stream."""
  ids = []
  for name in files:
    ids.extend(tokenizer.encode(read_source(name), add_special_tokens=False))
    ids.append(eos_id)
  return np.asarray(ids, np.uint16)


def batch_windows(ids: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int):
  """`batch` windows of `seq_len + 1` tokens (inputs and next-token labels) at random starts."""
  starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
  return np.stack([ids[s:s + seq_len + 1] for s in starts]).astype(np.int64)
