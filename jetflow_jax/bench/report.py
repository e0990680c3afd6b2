"""Benchmark results as a markdown table, JSON and a plot of tau and speedup against budget."""

from __future__ import annotations

import dataclasses
import json
import os


def markdown_table(cells, peer: dict | None = None) -> str:
  lines = ["| T | method | budget | top-k | tree | tau | target forwards | tokens/s "
           "| speedup vs AR | = AR |", "|---|---|---|---|---|---|---|---|---|---|"]
  for c in cells:
    same = {None: "", True: "yes", False: "**no**"}[c.identical_to_ar]
    top_k = "-" if c.top_k is None else c.top_k
    lines.append(f"| {c.temperature:g} | {c.method} | {c.budget} | {top_k} | {c.tree or '-'} | "
                 f"{c.tau:.2f} | {c.num_target_forwards} | {c.tokens_per_s:.1f} | "
                 f"{c.speedup:.2f}x | {same} |")
  if peer:
    same = "yes" if peer["identical_to_ar"] else "**no**"
    lines.append(f"| 0 | transformers generate | - | - | - | 1.00 | - | "
                 f"{peer['tokens_per_s']:.1f} | {peer['speedup']:.2f}x | {same} |")
  return "\n".join(lines)


def write(out_dir: str, cells, settings: dict, peer: dict | None = None) -> dict[str, str]:
  """Writes results.json, results.md and (with matplotlib) results.png; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, "results.json"),
           "markdown": os.path.join(out_dir, "results.md")}
  with open(paths["json"], "w") as f:
    json.dump({"settings": settings, "cells": [dataclasses.asdict(c) for c in cells],
               "transformers_peer": peer}, f, indent=1)
  with open(paths["markdown"], "w") as f:
    f.write(markdown_table(cells, peer) + "\n")
  try:
    plot_path = os.path.join(out_dir, "results.png")
    plot(cells, plot_path, title=settings.get("title", ""))
    paths["plot"] = plot_path
  except ImportError:
    pass
  return paths


def plot(cells, path: str, title: str = ""):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  temperatures = sorted({c.temperature for c in cells})
  # One line per method, tree and top-k (wide trees: one line, their top-k is N - 1); the tree
  # and the top-k go in the label only where there are several.
  lines = [("dflash", None, None)] + sorted(
      {(c.method, c.tree, None if c.tree == "wide" else c.top_k) for c in cells
       if c.tree is not None})
  trees = {tree for _, tree, _ in lines[1:]}
  top_ks = {top_k for _, _, top_k in lines[1:] if top_k is not None}
  fig, axes = plt.subplots(2, len(temperatures), figsize=(5 * len(temperatures), 7),
                           squeeze=False)
  for column, temperature in enumerate(temperatures):
    for row, metric in enumerate(("tau", "speedup")):
      ax = axes[row, column]
      for method, tree, top_k in lines:
        mine = [c for c in cells if (c.method, c.tree) == (method, tree)
                and c.temperature == temperature and top_k in (None, c.top_k)]
        points = sorted((c.budget, getattr(c, metric)) for c in mine if c.budget != "auto")
        label = method + (f" {tree}" if len(trees) > 1 else "")
        label += f", top-k {top_k}" if len(top_ks) > 1 and top_k else ""
        if points:
          drawn = ax.plot(*zip(*points), marker="o", label=label)[0]
        for c in (c for c in mine if c.budget == "auto"):  # a level: it has no one budget
          ax.axhline(getattr(c, metric), linestyle="--", label=f"{label}, auto",
                     color=drawn.get_color() if points else None)
      ax.axhline(1.0, color="grey", linestyle=":", label="AR")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("tree budget (nodes)")
      ax.set_ylabel("tau (tokens / target forward)" if metric == "tau" else "speedup over AR")
      ax.set_title(f"T = {temperature:g}")
      ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
