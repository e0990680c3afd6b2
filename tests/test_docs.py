"""The docs site: the research walk-through runs and prints what its page says it prints, and the
API reference's sources name every public name (`make docs` fails the build when the built HTML
misses one: docs/_ext/public_names.py)."""

import importlib
import os
import re
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
sys.path.insert(0, os.path.join(DOCS, "_ext"))

import cells  # noqa: E402  (docs/_ext: the runner the docs build uses)
import public_names  # noqa: E402

WALKTHROUGH = os.path.join(DOCS, "guides", "walkthrough.py")
# Lines of an `autosummary` list and `auto*` / `py:*` entries, in the API pages' eval-rst blocks.
ENTRY = re.compile(r"^\.\. (?:auto\w+|py:\w+):: ([\w.]+)", re.M)
CURRENT = re.compile(r"^\.\. currentmodule:: ([\w.]+)", re.M)


def api_entries() -> set[str]:
  """Full names of every entry the API pages' sources declare (`currentmodule` applied)."""
  names = set()
  for name in sorted(os.listdir(os.path.join(DOCS, "api"))):
    if not name.endswith(".md"):
      continue
    with open(os.path.join(DOCS, "api", name)) as f:
      text = f.read()
    module = ""
    events = sorted([(m.start(), "module", m.group(1)) for m in CURRENT.finditer(text)]
                    + [(m.start(), "entry", m.group(1)) for m in ENTRY.finditer(text)])
    for _, kind, value in events:
      if kind == "module":
        module = value
      elif value.startswith("jetflow_jax"):
        names.add(value)
      else:
        names.add(f"{module}.{value}")
  return names


def test_api_pages_name_every_public_name():
  entries = api_entries()
  missing = [name for name in public_names.public_names() if name not in entries]
  assert not missing, f"public names without an entry in docs/api/*.md: {missing}"
  for name in entries:  # and every entry names something that exists
    module, _, attr = name.rpartition(".")
    while module and module not in sys.modules:
      try:
        importlib.import_module(module)
        break
      except ImportError:
        module, _, rest = module.rpartition(".")
        attr = f"{rest}.{attr}"
    target = sys.modules[module]
    for part in attr.split("."):
      target = getattr(target, part)


def test_walkthrough_runs_and_prints_what_its_page_shows():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as in the docs
  env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))
  run = {c["name"]: c for c in cells.run(WALKTHROUGH, env)}
  assert list(run) == ["load", "forward", "draft", "tree", "drafter", "train"]
  with open(os.path.join(DOCS, "guides", "walkthrough.md")) as f:
    shown = re.findall(r"```\{cell\} walkthrough\.py (\w+)", f.read())
  assert shown == list(run)  # the page shows every cell, in order

  out = {name: cell["output"] for name, cell in run.items()}
  assert "target: 8 layers, width 256, vocabulary 8192" in out["load"]
  assert "causal True" in out["load"]
  assert re.search(r"logits: \(1, (\d+), 8192\) float32 \| taps: \(1, \1, 2, 256\)",
                   out["forward"])
  assert "draft logits: (1, 15, 8192)" in out["draft"]
  nodes = re.findall(r"node (\d): depth (\d), parent\s+(-?\d+), path log-prob\s+(-?[\d.]+)",
                     out["tree"])
  assert [int(n) for n, *_ in nodes] == list(range(8))
  assert nodes[0][1:] == ("0", "-1", "0.00")
  for node, depth, parent, _ in nodes[1:]:  # parents come first, one depth up
    assert int(parent) < int(node) and int(nodes[int(parent)][1]) == int(depth) - 1
  assert "identical to plain greedy decoding: True" in out["drafter"]
  assert "stop reasons: ['max_tokens', 'max_tokens']" in out["drafter"]
  losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", out["train"])]
  assert len(losses) == 3 and losses[-1] < losses[0]
