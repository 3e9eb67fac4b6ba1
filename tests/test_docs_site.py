"""The documentation site (MkDocs + Material, `mkdocs.yml` at the root, pages under docs/) builds in strict
mode without a warning, every page is in the navigation, and the README links to the pages.

Pages include files that live next to what they describe (deploy/README.md, perf/README.md,
perf/RESULTS.md, a section of README.md) with pymdownx.snippets lines, `--8<-- "path[:section]"`.
`site_sources()` lists the Markdown a reader meets in order (README.md, then each page in the navigation's
order, each followed by the files it includes); tests/test_readme_examples.py runs their examples in that
order.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
INCLUDE = re.compile(r'^--8<--\s+"([^":]+)(?::([\w-]+))?"\s*$', re.M)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's `nav`, in order, as paths under docs/."""
    def walk(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [page for item in entry for page in walk(item)]
        return [page for value in entry.values() for page in walk(value)]

    return walk(yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"])


def includes(file: str) -> list[tuple[str, str | None]]:
    """The (file, section) pairs a Markdown file includes with snippet lines, in order."""
    return INCLUDE.findall((REPO_ROOT / file).read_text())


def site_sources() -> list[str]:
    """README.md, then every page in navigation order, each followed by the files it includes (once each)."""
    order: list[str] = []
    for file in ["README.md", *(f"docs/{page}" for page in nav_pages())]:
        for name in (file, *(included for included, _ in includes(file))):
            if name not in order:
                order.append(name)
    return order


def test_every_page_is_in_the_nav_and_every_nav_page_exists():
    pages = nav_pages()
    assert len(pages) == len(set(pages)), "a page is listed twice"
    for page in pages:
        assert (DOCS / page).is_file(), f"mkdocs.yml lists {page}, which is not in docs/"
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk


def test_includes_name_files_and_sections_that_exist():
    """Checked here too, so a moved file fails without mkdocs installed."""
    for page in nav_pages():
        for file, section in includes(f"docs/{page}"):
            assert (REPO_ROOT / file).is_file(), f"docs/{page} includes {file}, which does not exist"
            if section:
                text = (REPO_ROOT / file).read_text()
                for end in ("start", "end"):
                    assert f"--8<-- [{end}:{section}]" in text, f"docs/{page}: {file} has no [{end}:{section}]"


def test_the_readme_links_to_every_page():
    """Relative links (docs/...md), so they work on GitHub and in a checkout as well as beside the site."""
    links = {link.split("#")[0] for link in MARKDOWN_LINK.findall((REPO_ROOT / "README.md").read_text())}
    to_docs = {link for link in links if link.startswith("docs/")}
    for link in to_docs:
        assert (REPO_ROOT / link).is_file(), f"README.md links to {link}, which does not exist"
    missing = [page for page in nav_pages() if f"docs/{page}" not in to_docs]
    assert missing == [], f"README.md does not link to {missing}"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[Path, str]:
    """`mkdocs build --strict` into a scratch folder: (the site, what mkdocs printed)."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed: pip install 'mkdocs>=1.6' 'mkdocs-material>=9.5' (the docs extra)")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2, not about the pages
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    return site, output


def test_the_site_builds_in_strict_mode_without_a_warning(built_site):
    site, output = built_site
    warnings = [line for line in output.splitlines() if re.search(r"(?i)\bwarn(ing)?s?\b|error", line)]
    assert warnings == [], output
    for page in nav_pages():
        folder = page.removesuffix(".md").removesuffix("index").rstrip("/")  # mkdocs' directory URLs
        assert (site / folder / "index.html").is_file(), f"{page} was not built"


def test_every_include_was_expanded(built_site):
    """No snippet line is left as text, and no `\\|` from a GitHub table shows (Python-Markdown keeps the
    backslash inside code)."""
    site, _ = built_site
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "--8&lt;--" not in text and "--8<--" not in text, f"{html.relative_to(site)}: an include was left"
        assert "\\|" not in text, f"{html.relative_to(site)}: a table cell shows \\|"
