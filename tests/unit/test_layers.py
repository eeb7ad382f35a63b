"""The package floors of docs/architecture.md, read from the source: every import
(top-level or inside a function) of every product module goes down, never up
and never sideways between the siblings ``training`` and ``engines``; Prefect,
Ray and torch stay out of the packages that must run without them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package: (project packages it may import, outside packages it must never import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    "storage": (set(), {"prefect", "ray", "torch"}),
    "rollout": ({"storage"}, {"prefect", "ray", "torch"}),
    "wire": ({"storage"}, {"prefect", "ray"}),
    "actors": ({"storage"}, {"prefect"}),
    "engines": ({"wire", "actors", "storage", "rollout"}, {"prefect"}),
    "training": ({"wire", "actors", "storage", "rollout"}, {"prefect"}),
    "tasks": ({"training", "engines", "wire", "actors", "storage", "rollout"}, {"prefect"}),
    "flows": ({"tasks", "training", "engines", "wire", "actors", "storage", "rollout"}, set()),
}


def imported_packages(path: Path) -> dict[str, int]:
    """Top-level package of every absolute import in ``path``, with its first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


@pytest.mark.parametrize("package", sorted(RULES))
def test_a_package_imports_only_the_floors_below_it(package):
    allowed, banned = RULES[package]
    ours = set(RULES)
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in imported_packages(path).items():
            if name == package:
                continue
            if (name in ours and name not in allowed) or name in banned:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, (
        f"{package} may import {sorted(allowed) or 'no project package'} and never "
        f"{sorted(banned) or 'nothing else'} (docs/architecture.md, Packages and imports); "
        "move what both sides need into a package below them:\n" + "\n".join(wrong)
    )
