"""Sphinx configuration of mpifusion's documentation (``sphinx-build -W -b html docs OUT``;
tests/docs/test_docs_build.py builds it with warnings as errors)."""
import builtins
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# the site's own extension (_ext/generated.py): the environment table and the pictures,
# written into _generated/ from their definitions in the code when the build starts
sys.path.insert(0, os.path.abspath("_ext"))

project = "mpifusion"
author = "mpifusion contributors"
copyright = "2026, mpifusion contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
              "sphinx.ext.viewcode", "generated"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# _generated/ holds parts included by pages ({include}, {figure}), not pages of its own
exclude_patterns = ["_build", "_generated"]
# the pages keep GitHub-style Markdown (the README's sections moved here as they were)
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# mpifusion imports mpi4py lazily: autodoc imports the package without starting MPI
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# types only for the arguments and results the docstrings describe (all of them, as
# tests/docs/test_reference_complete.py checks): not a fixture's own arguments
autodoc_typehints_description_target = "documented"
# a class's page shows its __init__'s docstring too (some describe the arguments there)
autoclass_content = "both"
# the test build is nitpicky (sphinx-build -n, tests/docs/conftest.py): every Python
# reference must resolve, but for Python's and other packages' types (no intersphinx: the
# build runs offline) and the internal types that signatures name
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|mpi4py|MPI|os|enum|collections|typing|torch|paddle|jax)\..*"),
    (r"py:.*", "|".join(n for n in dir(builtins) if not n.startswith("_"))),
    (r"py:class", r"mpifusion\.runtime\.(storage\.BufferMemory|options\.BufferOptions)"
                  r"|Engine|Collective|_Path"),
]
html_theme = "alabaster"
