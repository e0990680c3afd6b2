"""Executed scripts in the docs: a script split into cells by `# %% name` lines runs once per
build, and the `cell` directive shows one cell's code followed by what it printed.

    ```{cell} walkthrough.py load
    ```

The script runs in a subprocess of this file (`python cells.py SCRIPT`), which executes its
cells in order in one namespace and prints them as JSON: `[{"name", "source", "output"}]`.
tests/test_docs.py runs the same command. A cell that raises fails the build.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

CELL = re.compile(r"^# %% (\w+)\s*$")


def split_cells(text: str) -> list[tuple[str, str]]:
  """(name, source) of every cell; what comes before the first marker is not a cell."""
  cells, name, lines = [], None, []
  for line in text.splitlines():
    match = CELL.match(line)
    if match:
      if name is not None:
        cells.append((name, "\n".join(lines).strip("\n")))
      name, lines = match.group(1), []
    else:
      lines.append(line)
  if name is not None:
    cells.append((name, "\n".join(lines).strip("\n")))
  return cells


def execute(path: str) -> list[dict]:
  """Runs the cells of `path` in order in one namespace; returns each one's source and output.

  Raises:
    RuntimeError: a cell raised (its name and the error are in the message).
  """
  with open(path) as f:
    text = f.read()
  namespace = {"__name__": "__main__", "__file__": os.path.abspath(path)}
  cells = []
  for name, source in split_cells(text):
    out = io.StringIO()
    start = time.perf_counter()
    try:
      with contextlib.redirect_stdout(out):
        exec(compile(source, f"{path} [cell {name}]", "exec"), namespace)
    except Exception as e:
      raise RuntimeError(f"{path}: cell {name!r} raised {type(e).__name__}: {e}") from e
    cells.append({"name": name, "source": source, "output": out.getvalue(),
                  "seconds": round(time.perf_counter() - start, 2)})
  return cells


def run(path: str, env: dict | None = None) -> list[dict]:
  """`execute(path)` in a fresh Python process (what the docs build and the test call)."""
  done = subprocess.run([sys.executable, os.path.abspath(__file__), path], capture_output=True,
                        text=True, env=env)
  if done.returncode:
    raise RuntimeError(f"running {path} failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout)


# The Sphinx side: only what this file needs when Sphinx loads it as an extension.

_RESULTS: dict[str, list[dict]] = {}


def _cells_of(path: str) -> list[dict]:
  if path not in _RESULTS:
    env = dict(os.environ)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    env.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    _RESULTS[path] = run(path, env)
    print(f"cells: ran {os.path.relpath(path)} in {time.perf_counter() - start:.1f} s")
  return _RESULTS[path]


def setup(app):
  from docutils import nodes
  from sphinx.util.docutils import SphinxDirective

  class Cell(SphinxDirective):
    """```{cell} SCRIPT NAME```: cell NAME of SCRIPT (relative to this page), run."""

    required_arguments = 2

    def run(self):
      script, name = self.arguments
      path = os.path.normpath(os.path.join(os.path.dirname(self.env.doc2path(self.env.docname)),
                                           script))
      self.env.note_dependency(path)
      cells = {c["name"]: c for c in _cells_of(path)}
      if name not in cells:
        raise self.error(f"{script} has no cell {name!r} (it has {', '.join(cells)})")
      cell = cells[name]
      container = nodes.container(classes=["cell"])
      container += nodes.literal_block(cell["source"], cell["source"], language="python")
      if cell["output"]:
        output = nodes.container(classes=["cell-output"])
        output += nodes.literal_block(cell["output"], cell["output"], language="text")
        container += output
      return [container]

  app.add_directive("cell", Cell)
  return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}


if __name__ == "__main__":
  json.dump(execute(sys.argv[1]), sys.stdout)
