"""Fails the docs build (a warning, and `make docs` runs with -W) when a public name has no entry
in the built API reference: every name in the `__all__` of the modules below must have an
element `id="MODULE.NAME"` in some page under api/."""

from __future__ import annotations

import glob
import importlib
import os
import re

PUBLIC_MODULES = ("jetflow_jax", "jetflow_jax.decoding", "jetflow_jax.engine", "jetflow_jax.serve")


def public_names() -> list[str]:
  """`MODULE.NAME` for every name in the `__all__` of `PUBLIC_MODULES`."""
  return [f"{module}.{name}" for module in PUBLIC_MODULES
          for name in importlib.import_module(module).__all__]


def documented_ids(html_dir: str) -> set[str]:
  """Every `id="..."` of the built API reference pages."""
  ids = set()
  for path in glob.glob(os.path.join(html_dir, "api", "*.html")):
    with open(path, encoding="utf-8") as f:
      ids.update(re.findall(r'id="([\w.]+)"', f.read()))
  return ids


def missing_names(html_dir: str) -> list[str]:
  """Public names without an entry in the HTML under `html_dir` (empty when all are there)."""
  ids = documented_ids(html_dir)
  return [name for name in public_names() if name not in ids]


def check(app, exception) -> None:
  """After an HTML build: one warning per public name without an entry."""
  from sphinx.util import logging  # here: the tests import this file without Sphinx installed
  if exception is not None or app.builder.name != "html":
    return
  for name in missing_names(app.outdir):
    logging.getLogger(__name__).warning(f"public name {name} has no entry in the API reference (docs/api/)")


def setup(app):
  app.connect("build-finished", check)
  return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
