"""Broken links in the built docs site: `python scripts/check_site.py build/site` (ADR 0055).

Every relative `href` and `src` of every page must name a file of the site, and a `#fragment`
an element id of the page it names; links to other hosts are not followed (CI has no network).
Sphinx's strict build already refuses a Markdown link to a missing page or heading; this reads
what it wrote, so that a link in raw HTML, a theme template or a copied file is held to the same.
Prints one line per broken link, `page: target (why)`, and exits 1 when there is one.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The ids a page defines and the relative links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src") and not urlsplit(value).scheme and not value.startswith("//"):
                self.links.append(value)


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken(site: Path) -> list[str]:
    """Every broken link of the site, as `page: target (why)`, in page order."""
    pages = {path: _read(path) for path in sorted(site.rglob("*.html"))}
    found = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path.resolve()
            if parts.path.endswith("/") or target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site)}: {link}"
            if site.resolve() not in target.parents:
                found.append(f"{where} (outside the site)")
            elif not target.is_file():
                found.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _read(target).ids
                if unquote(parts.fragment) not in ids:
                    found.append(f"{where} (no such anchor)")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/check_site.py SITE_FOLDER", file=sys.stderr)
        return 2
    site = Path(argv[0])
    found = broken(site)
    for line in found:
        print(line)
    pages = sum(1 for _ in site.rglob("*.html"))
    print(f"{len(found)} broken links in {pages} pages", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
