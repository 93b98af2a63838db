"""Layering: modules that work together without importing each other, at any level of the file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mklang"


def imported(module: str) -> set[str]:
    """Every mklang module `module` imports, at the top or inside a function."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mklang"):
            found.add(node.module.removeprefix("mklang."))
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("mklang.") for alias in node.names if alias.name.startswith("mklang")}
    return found


@pytest.mark.parametrize(
    ("one", "other"),
    [("engine.gates", "engine.runner"), ("syntax.parser", "syntax.build"), ("syntax.build", "syntax.yaml_front")],
)
def test_no_import_cycle(one, other):
    assert not (other in imported(one) and one in imported(other)), f"{one} and {other} import each other"


def test_the_yaml_front_end_uses_no_private_name_of_the_builder():
    source = (PACKAGE / "syntax" / "yaml_front.py").read_text(encoding="utf-8")
    assert "builder._" not in source and "import Builder, _" not in source
