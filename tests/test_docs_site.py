"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, as CI builds it, so a broken
link, a missing page or a bad anchor fails here; every page of the nav is built; and no page under docs/ is left out
of the nav (an orphan page is one no reader finds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"


def load_config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def nav_pages(node) -> list[str]:
    """The page paths of a mkdocs nav (`Title: path` entries, nested in sections), in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_pages(value)]
    if isinstance(node, list):
        return [page for item in node for page in nav_pages(item)]
    return []


def built_page(site: Path, page: str) -> Path:
    """Where mkdocs writes a page with directory URLs: `a/index.md` -> `a/index.html`, `a/b.md` -> `a/b/index.html`."""
    path = Path(page).with_suffix("")
    return site / (path.parent if path.name == "index" else path) / "index.html"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    pathspec = pytest.importorskip("pathspec", reason="mkdocs' own dependency: pip install -e '.[docs]'")
    config = load_config()
    docs = ROOT / config["docs_dir"]
    pages = nav_pages(config["nav"])
    assert len(pages) == len(set(pages)), f"a page is in the nav twice: {pages}"
    missing = [page for page in pages if not (docs / page).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that docs/ lacks: {missing}"
    excluded = pathspec.GitIgnoreSpec.from_lines(config.get("exclude_docs", "").splitlines())
    orphans = sorted(
        str(path.relative_to(docs))
        for path in docs.rglob("*.md")
        if str(path.relative_to(docs)) not in pages and not excluded.match_file(str(path.relative_to(docs)))
    )
    assert not orphans, (
        f"pages under docs/ that are neither in mkdocs.yml's nav nor in its exclude_docs: {orphans}"
    )


def test_the_site_builds_strict_with_every_nav_page(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    result = mkdocs_build(CONFIG, site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    absent = [page for page in nav_pages(load_config()["nav"]) if not built_page(site, page).is_file()]
    assert not absent, f"pages of the nav missing from the built site: {absent}\n{result.stderr}"
    assert (site / "search" / "search_index.json").is_file(), "the search plugin wrote no index"


def test_a_broken_anchor_fails_the_build(tmp_path):
    """The build is strict about anchors too: a link to a heading that does not exist stops it, naming the link."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    config = load_config()
    shutil.copytree(ROOT / config["docs_dir"], tmp_path / "docs")
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as index:
        index.write("\n[a heading that is not there](getting-started.md#no-such-heading)\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"a broken anchor did not fail the strict build:\n{output}"
    assert "no-such-heading" in output, output
