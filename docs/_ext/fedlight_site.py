"""fedlight's Sphinx extension: generated reference text, the navigation, and the site's front door.

* ``<!-- generated: MODULE:FUNCTION -->`` in a page is replaced, while the site builds, by the Markdown that
  ``MODULE.FUNCTION()`` returns (the command line and the settings come from the parsers:
  :mod:`fedlight.config.reference`; the algorithm table from :mod:`fedlight.config.catalog`), so a reference page
  cannot drift from the code.
* ``fedlight_nav`` (``docs/nav.yaml``, read by ``docs/conf.py``): the site's sections, each a list of pages, become
  hidden toctrees of the root page (the sidebar). A page named there must exist, except those listed in
  ``fedlight_nav_optional`` (pages that other work adds; they appear once they exist).
* A link to a Markdown file of the repository that the site does not contain (the project's ``README.md``,
  ``recipes/README.md``) becomes the file's path in code: the site has no page to send the reader to, and a link to
  a file that does not exist at all still fails the build.
* The HTML build gets an ``index.html`` at its top that forwards to the root page.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

GENERATED = re.compile(r"<!-- generated: ([\w.]+):(\w+) -->")
MD_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s:#]+\.md)(#[^)\s]*)?\)")


def generated(match: re.Match) -> str:
    return getattr(importlib.import_module(match[1]), match[2])()


def nav_markdown(app) -> str:
    """The hidden toctrees of the root page: one per section of ``fedlight_nav``."""
    root = Path(app.srcdir) / Path(app.config.root_doc).parent
    out = []
    for caption, pages in app.config.fedlight_nav.items():
        present = []
        for page in pages:
            if (root / f"{page}.md").is_file():
                present.append(page)
            elif page not in app.config.fedlight_nav_optional:
                raise FileNotFoundError(f"fedlight_nav ({caption}) names {page}.md, which is not in {root}")
        out.append(f"\n:::{{toctree}}\n:hidden:\n:caption: {caption}\n\n" + "\n".join(present) + "\n:::\n")
    return "".join(out)


def outside_links(app, docname: str, text: str) -> str:
    """``text`` with its links to repository Markdown files that are not pages of the site as ``label (`path`)``."""
    src = Path(app.srcdir).resolve()
    here = (src / docname).parent

    def replace(m: re.Match) -> str:
        target = (here / m[2]).resolve()
        try:
            rel = target.relative_to(src)
        except ValueError:
            return m[0]
        if not target.is_file() or rel.with_suffix("").as_posix() in app.env.found_docs:
            return m[0]  # a page of the site, or a file that is not there (the build says so)
        label = m[1].strip()
        return f"{label} (`{rel.as_posix()}`)" if label.strip("`") != rel.as_posix() else f"`{rel.as_posix()}`"

    return MD_LINK.sub(replace, text)


def source_read(app, docname: str, source: list[str]) -> None:
    text = outside_links(app, docname, GENERATED.sub(generated, source[0]))
    if docname == app.config.root_doc:
        text += nav_markdown(app)
    source[0] = text


def front_door(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    target = f"{app.config.root_doc}.html"
    Path(app.outdir, "index.html").write_text(
        f'<!DOCTYPE html>\n<meta charset="utf-8">\n<meta http-equiv="refresh" content="0; url={target}">\n'
        f'<link rel="canonical" href="{target}">\n<a href="{target}">fedlight documentation</a>\n')


def setup(app):
    app.add_config_value("fedlight_nav", {}, "env")
    app.add_config_value("fedlight_nav_optional", (), "env")
    app.connect("source-read", source_read)
    app.connect("build-finished", front_door)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
