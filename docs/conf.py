"""Sphinx configuration of fedlight's documentation site.

Build it from the project root (the site takes ``docs/`` and the results pages of ``results/``, so the links between
them are ordinary relative links):

    python -m sphinx -W -c docs . _site

``tests/test_docs_site.py`` runs this build with warnings as errors. The navigation is docs/nav.yaml; the
reference pages for the command line and the settings are generated from the parsers while the site builds
(``docs/_ext/fedlight_site.py``), the API reference from the docstrings (autodoc).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(DOCS / "_ext"), str(ROOT)]  # the extension, and this checkout's fedlight

project = "fedlight"
author = "the fedlight authors"
copyright = "the fedlight authors, Apache-2.0"
release = version = __import__("fedlight").__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "fedlight_site"]

root_doc = "docs/index"
source_suffix = {".md": "markdown"}
# only docs/ and the results pages are sources; everything else at the top is left out of the walk
include_patterns = ["docs/**", "results/*.md"]
exclude_patterns = ["docs/README.md", "docs/_ext/**", "docs/_build/**", "**/.ipynb_checkpoints",
                    *(p.name for p in ROOT.iterdir() if p.name not in ("docs", "results"))]  # not walked at all

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "attrs_inline"]
myst_heading_anchors = 4
suppress_warnings = []

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_numpy_docstring = False  # the docstrings are Google style (Args:)
napoleon_use_ivar = True  # "Attributes:" as fields, so an attribute with its own docstring is described once

html_theme = "furo"
html_title = f"fedlight {release}"
html_static_path = []
html_last_updated_fmt = None

# The sidebar: docs/nav.yaml (sections of pages); every user page is in one section (tests/test_docs_site.py checks
# it); docs/contributing/ is built but kept out of this navigation.
_nav = yaml.safe_load((DOCS / "nav.yaml").read_text())
fedlight_nav = _nav["sections"]
fedlight_nav_optional = tuple(_nav.get("optional", ()))
