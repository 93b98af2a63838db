"""The documentation site (ADR 0055): Sphinx with MyST over docs/*.md, the ADRs and the changelog.

Built from the repository's root so that the pages' links between docs/ and adr/ are the same
paths on the site as in the repository:

    sphinx-build -W --keep-going -c docs . build/site
"""

from __future__ import annotations

project = "mklang"
author = "the mklang authors"
copyright = "2026, the mklang authors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"
# Only these are pages; the rest of the tree (code, tests, examples) is what the pages link to.
include_patterns = ["docs/**", "adr/**", "CHANGELOG.md"]
# Folders never walked: CI's virtual environment (.venv) and the caches are in the tree.
exclude_patterns = ["docs/conf.py", ".*", "build", "dist", "mutants", "tests"]

# GitHub's heading anchors (`page.md#a-heading`), so links that work on the forge work here.
myst_heading_anchors = 6
myst_enable_extensions = ["deflist"]

# ```mk blocks: the `mk` lexer the package registers with Pygments (mklang.highlight).
pygments_style = "friendly"
html_theme = "furo"
html_title = "mklang"
html_extra_path = ["site-root"]  # the site's own index.html, which sends readers to docs/index.html

# The guide's last entry, `*`, puts a page added to docs/ in the navigation without editing the
# index; while every page is listed by name, it matches nothing, which is no fault.
suppress_warnings = ["toc.empty_glob"]


def _nest_the_adrs(app: object, docname: str, source: list[str]) -> None:
    """The ADRs in the navigation under their index, which lists them in a table: the toctree is
    added as the site is built, so that adr/README.md reads on the forge as it is written."""
    if docname == "adr/README":
        source[0] += "\n\n```{toctree}\n:hidden:\n:glob:\n\n0*\n```\n"


def setup(app: object) -> None:
    app.connect("source-read", _nest_the_adrs)  # type: ignore[attr-defined]
