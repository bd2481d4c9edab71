"""Sphinx configuration of mpifusion's documentation (``sphinx-build -W -b html docs OUT``;
tests/docs/test_docs_build.py builds it with warnings as errors)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "mpifusion"
author = "mpifusion contributors"
copyright = "2026, mpifusion contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
              "sphinx.ext.viewcode"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# the pages keep GitHub-style Markdown (the README's sections moved here as they were)
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# mpifusion imports mpi4py lazily: autodoc imports the package without starting MPI
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
