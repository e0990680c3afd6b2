"""Sphinx configuration of the jetflow_jax docs: `make docs` builds them into docs/_build/html.

Sphinx with MyST, as Flax, Optax and Orbax build theirs: autodoc reads the docstrings the code
already has (Google style, through napoleon), and the pages stay Markdown, like the README they
came from. Nothing is fetched: the build runs offline.
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)  # this checkout's jetflow_jax, whatever else is installed
sys.path.insert(0, os.path.join(DOCS, "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jetflow_jax"
author = "jetflow_jax authors"
copyright = "2026, jetflow_jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxcontrib.programoutput",
    "cells",
    "public_names",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# `name` in a docstring is code, linked when it names something documented here.
default_role = "py:obj"
autodoc_preserve_defaults = True
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
autodoc_class_signature = "separated"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# programoutput runs commands from the repository root, with this checkout first on the path
# and `python` the interpreter running Sphinx (the .venv's under `make docs`).
programoutput_use_ansi = False
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
os.environ["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), os.environ["PATH"]))

html_theme = "sphinx_book_theme"
html_title = "jetflow_jax"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["cells.css"]
