"""`--plugin`: host tools and hooks from a Python module or file, without packaging.

A plugin is an importable module name (`mytools`) or a path to a `.py` file;
it exposes `TOOLS` and/or `HOOKS`, maps of name to callable. Entry points
(`mklang.tools`, `mklang.hooks`) remain the way to ship tools in a package.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from mklang.errors import UsageError


def _import(spec: str) -> ModuleType:
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).resolve()
        if not path.is_file():
            raise UsageError(f"--plugin {spec}: no such file")
        module_spec = importlib.util.spec_from_file_location(f"mklang_plugin_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None, "a .py path always has a loader"
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ImportError as error:
        raise UsageError(f"--plugin {spec}: cannot import it: {error}") from None


def load_plugins(specs: list[str]) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """The tools and hooks of every plugin, later plugins winning."""
    tools: dict[str, Callable] = {}
    hooks: dict[str, Callable] = {}
    for spec in specs:
        module = _import(spec)
        found = False
        for attribute, target in (("TOOLS", tools), ("HOOKS", hooks)):
            table = getattr(module, attribute, None)
            if table is None:
                continue
            if not isinstance(table, dict) or not all(callable(f) for f in table.values()):
                raise UsageError(f"--plugin {spec}: {attribute} must map names to callables")
            target.update(table)
            found = True
        if not found:
            raise UsageError(f"--plugin {spec}: defines neither TOOLS nor HOOKS")
    return tools, hooks
