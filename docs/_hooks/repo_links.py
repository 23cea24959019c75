"""MkDocs hook: links from a docs page to repository files outside ``docs/`` resolve.

A page under ``docs/`` links to a file elsewhere in the repository by its relative path
from the page (``../results/fleet/fleet.md``, ``../PROTOCOL.md``, ``../examples/device.yaml``),
so the same link works on GitHub and in the site. The site is laid out as the repository
with ``docs/`` at its root: ``docs/methods/index.md`` is served as ``methods/index.md``, and every repository file
outside ``docs/`` that a page links to is added under its repository path
(``results/fleet/fleet.md``, ``PROTOCOL.md``). Markdown files added that way are pages
too, and their own links are followed the same way.

``on_page_markdown`` rewrites each such link to the file's place in the site; a link to a
file that does not exist is left as written, so ``mkdocs build --strict`` reports it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.repo_links")

# [text](target) and ![alt](target), with an optional "title"
_LINK = re.compile(r"(\]\()(<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^(```|~~~)")
_EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)

_root: Path | None = None
_docs: Path | None = None


def _split_code(markdown: str) -> list[tuple[bool, str]]:
    """The markdown as (is_code, text) blocks: fenced code blocks are left alone."""
    blocks, current, code = [], [], False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line.lstrip()):
            if not code:
                blocks.append((False, "".join(current)))
                current = [line]
                code = True
            else:
                current.append(line)
                blocks.append((True, "".join(current)))
                current = []
                code = False
            continue
        current.append(line)
    blocks.append((code, "".join(current)))
    return blocks


def _targets(markdown: str) -> list[str]:
    out = []
    for code, text in _split_code(markdown):
        if not code:
            out += [m.group(3) for m in _LINK.finditer(text)]
    return out


def _resolve(real: Path, target: str) -> Path | None:
    """The repository file a relative link in the file ``real`` points to, or None."""
    if _EXTERNAL.match(target):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    resolved = Path(posixpath.normpath(posixpath.join(real.parent.as_posix(), path)))
    try:
        resolved.relative_to(_root)
    except ValueError:
        return None
    return resolved


def _site_uri(path: Path) -> str:
    """Where a repository file lives in the site: relative to docs/ inside it, else to the root."""
    try:
        return path.relative_to(_docs).as_posix()
    except ValueError:
        return path.relative_to(_root).as_posix()


def _real(file: File) -> Path:
    return Path(file.abs_src_path).resolve() if file.abs_src_path else _docs / file.src_uri


def on_config(config):
    global _root, _docs
    _docs = Path(config.docs_dir).resolve()
    _root = Path(config.config_file_path).resolve().parent
    return config


def _nav_paths(nav) -> list[str]:
    """Every page path the nav names."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_paths(v)]
    if isinstance(nav, list):
        return [p for v in nav for p in _nav_paths(v)]
    return []


def on_files(files: Files, config) -> Files:
    """Add every repository file outside docs/ that a page links to (transitively), and
    the nav's pages that live at the repository root (PROTOCOL.md)."""
    queue = [p for p in (_real(f) for f in files.documentation_pages()) if p.is_file()]  # not generated pages
    for uri in _nav_paths(config.nav):
        if files.get_file_from_path(uri) is None and (_root / uri).is_file():
            files.append(File.generated(config, uri, abs_src_path=str(_root / uri)))
            queue.append(_root / uri)
    seen = set(queue)
    while queue:
        real = queue.pop()
        for target in _targets(real.read_text(encoding="utf-8")):
            path = _resolve(real, target)
            if path is None or path in seen or not path.is_file():
                continue
            seen.add(path)
            try:
                path.relative_to(_docs)
                continue  # a docs file: mkdocs has it already
            except ValueError:
                pass
            uri = _site_uri(path)
            if files.get_file_from_path(uri) is not None:
                raise ValueError(f"repository file {uri} would replace the docs file of the same name")
            files.append(File.generated(config, uri, abs_src_path=str(path)))
            if path.suffix == ".md":
                queue.append(path)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrite links that leave docs/ to the linked file's place in the site."""
    real = _real(page.file)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(target: str) -> str:
        path = _resolve(real, target)
        if path is None or not path.is_file():
            return target  # external, an anchor, or broken: mkdocs judges it
        anchor = target[len(target.split("#", 1)[0]):]
        return posixpath.relpath(_site_uri(path), here or ".") + anchor

    out = []
    for code, text in _split_code(markdown):
        if not code:
            text = _LINK.sub(lambda m: m.group(1) + m.group(2) + rewrite(m.group(3)) + m.group(4), text)
        out.append(text)
    return "".join(out)
