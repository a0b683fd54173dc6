"""List every reach into another module's private names inside ``te_fl_attention/``.

A reach is ``from X import _name`` (absolute or relative, lazy in-function imports included),
``X._name`` where ``X`` is a module bound by an import in the same file (``import a.b as X``,
``from . import X``), or an import of a private module (``pkg._mod``) from outside ``pkg``.
Dunder names (``__version__``) are not private. Exits 1 when it finds any;
``tests/test_layout.py`` runs it. Usage: ``python scripts/check_private_imports.py [ROOT]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "te_fl_attention"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute name ``from <level dots><module> import ...`` refers to in ``current``."""
    if level == 0:
        return module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _outside_private(current: str, is_package: bool, target: str) -> bool:
    """Is ``target`` a private module (``pkg._mod``) imported from outside ``pkg``?"""
    parts = target.split(".")
    here = current if is_package else current.rpartition(".")[0]
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            if here != owner and not here.startswith(owner + "."):
                return True
    return False


def _is_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def reaches(root: Path) -> list[str]:
    """``file:line: text`` for every private reach across modules under ``root/te_fl_attention``."""
    found: list[str] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        current = _module_name(root, path)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules: set[str] = set()  # local names bound to one of our modules
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(current, is_package, node.module, node.level)
                if not target.startswith(PACKAGE):
                    continue
                if _outside_private(current, is_package, target):
                    found.append(f"{where}:{node.lineno}: from {target} import ...")
                for alias in node.names:
                    if _is_module(root, f"{target}.{alias.name}"):
                        modules.add(alias.asname or alias.name)
                        if _outside_private(current, is_package, f"{target}.{alias.name}"):
                            found.append(f"{where}:{node.lineno}: from {target} import "
                                         f"{alias.name}")  # fmt: skip
                    elif _private(alias.name) and target != current:
                        found.append(f"{where}:{node.lineno}: from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE) and alias.asname:
                        modules.add(alias.asname)
                    if alias.name.startswith(PACKAGE) and _outside_private(current, is_package,
                                                                           alias.name):
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found = reaches(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} reach(es) into other modules' private names", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
