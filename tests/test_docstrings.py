"""Every public definition of the shipped packages has a docstring.

Walks (with ``ast``, nothing is imported) every ``.py`` file under the packages below and lists
the public classes, functions and methods (``name`` not starting with ``_``; methods and nested
classes only inside public classes) that have no docstring. A method is exempt when it overrides a
method of the same name that has a docstring on one of its base classes defined in these packages
(resolved by name: the same file first, then ``from ... import`` of a scanned module, then any
scanned class of that name; transitively). ``forward``/``extra_repr`` are *not* exempt by being
torch overrides: they document their shapes themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "moe_model", "edge_sdk", "cloud", "fedmoe")

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level(body):
    """Module-level definitions, including those under ``if``/``try`` blocks."""
    for node in body:
        if isinstance(node, _DEFS):
            yield node
        elif isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


def _base_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Subscript):  # Generic[T], Protocol[T]
        expr = expr.value
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


class _Index:
    def __init__(self) -> None:
        self.files: dict[str, ast.Module] = {}
        self.modules: dict[str, str] = {}  # dotted module -> rel path
        for pkg in PACKAGES:
            for path in sorted((ROOT / pkg).rglob("*.py")):
                rel = path.relative_to(ROOT).as_posix()
                self.files[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
                self.modules[_module_name(path)] = rel
        # class name -> [(rel, ClassDef)], module-level classes only
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.imports: dict[str, dict[str, str]] = {}  # rel -> {local name: rel of source module}
        for rel, tree in self.files.items():
            for node in _top_level(tree.body):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((rel, node))
            imported: dict[str, str] = {}
            package = _module_name(ROOT / rel).split(".")
            if not rel.endswith("__init__.py"):
                package = package[:-1]
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = package[:len(package) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    if mod in self.modules:
                        for alias in node.names:
                            imported[alias.asname or alias.name] = self.modules[mod]
            self.imports[rel] = imported

    def resolve(self, rel: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The scanned classes a base-class name in file ``rel`` may refer to."""
        candidates = self.classes.get(name, [])
        same = [c for c in candidates if c[0] == rel]
        if same:
            return same
        src = self.imports.get(rel, {}).get(name)
        imported = [c for c in candidates if c[0] == src]
        return imported or candidates

    def inherits_doc(self, rel: str, cls: ast.ClassDef, method: str) -> bool:
        """True if a (transitive) scanned base class of ``cls`` defines ``method`` with a docstring."""
        seen: set[int] = set()
        todo = [(rel, b) for b in cls.bases]
        while todo:
            at, expr = todo.pop()
            name = _base_name(expr)
            if name is None:
                continue
            for base_rel, base in self.resolve(at, name):
                if id(base) in seen:
                    continue
                seen.add(id(base))
                for node in base.body:
                    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method
                            and ast.get_docstring(node)):
                        return True
                todo.extend((base_rel, b) for b in base.bases)
        return False

    def missing(self) -> list[str]:
        """``path:Qualified.name`` of every public definition without a docstring (sorted)."""
        out: list[str] = []

        def visit(rel: str, node, prefix: str, owner: ast.ClassDef | None) -> None:
            if node.name.startswith("_"):
                return
            qual = prefix + node.name
            if not ast.get_docstring(node):
                exempt = (owner is not None and not isinstance(node, ast.ClassDef)
                          and self.inherits_doc(rel, owner, node.name))
                if not exempt:
                    out.append(f"{rel}:{qual}")
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, _DEFS):
                        visit(rel, child, qual + ".", node)

        for rel, tree in self.files.items():
            for node in _top_level(tree.body):
                visit(rel, node, "", None)
        return sorted(set(out))


def test_public_definitions_have_docstrings():
    missing = _Index().missing()
    undocumented = list(missing)
    assert not undocumented, (f"{len(undocumented)} public definitions without a docstring:\n  "
                              + "\n  ".join(undocumented))
