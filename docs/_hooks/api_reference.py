"""MkDocs hook: the API reference, one page per module, generated at build time.

The packages are walked on disk (:data:`PACKAGES`), so a module another change adds,
moves or renames appears in the reference without an edit here. Each page is one
mkdocstrings directive (``::: package.module``); mkdocstrings reads the source statically
(griffe), so nothing is imported and no service is needed. The pages go under
``reference/`` and into the nav's "API reference" section.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

PACKAGES = ("protocol", "moe_model", "edge_sdk", "cloud", "fedmoe")
"""The importable packages, lowest layer first."""

_modules: list[str] = []


def _walk(root: Path, package: str) -> list[str]:
    """Dotted names of ``package`` and its public modules and subpackages, sorted."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue  # private modules, __main__
        if not (root.joinpath(*rel.parts[:-1]) / "__init__.py").is_file():
            continue  # a directory of scripts or data, not a package
        found.append(".".join(parts))
    return found


def _uri(module: str) -> str:
    return f"reference/{module.replace('.', '/')}.md"


def _nav(modules: list[str]) -> list:
    """Nested nav entries: a package is a section whose first page is its own module."""
    tree: dict = {}
    for module in modules:
        node = tree
        for part in module.split("."):
            node = node.setdefault(part, {})
    def entries(node: dict, prefix: str) -> list:
        out = []
        for name, children in node.items():
            dotted = f"{prefix}{name}"
            if children:
                out.append({dotted: [{dotted: _uri(dotted)}] + entries(children, dotted + ".")})
            else:
                out.append({dotted: _uri(dotted)})
        return out
    return [{"Overview": "reference/index.md"}] + entries(tree, "")


def on_config(config):
    global _modules
    root = Path(config.config_file_path).resolve().parent
    _modules = [m for p in PACKAGES if (root / p / "__init__.py").is_file() for m in _walk(root, p)]
    config.nav = [e for e in (config.nav or []) if "API reference" not in e] + [{"API reference": _nav(_modules)}]
    return config


def on_files(files: Files, config) -> Files:
    lines = ["# API reference", "",
             "Generated from the docstrings at build time, one page per module. The layers, lowest first: "
             + " ← ".join(f"`{p}`" for p in PACKAGES) + " (a package imports only its own layer and those below; "
             "see [the architecture](../architecture.md)).", ""]
    lines += [f"- [`{m}`]({_uri(m)[len('reference/'):]})" for m in _modules]
    files.append(File.generated(config, "reference/index.md", content="\n".join(lines) + "\n"))
    for module in _modules:
        files.append(File.generated(config, _uri(module), content=f"# `{module}`\n\n::: {module}\n"))
    return files
