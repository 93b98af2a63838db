"""A plugin distribution installed for one test: a module and its `mklang.*` entry points."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_entry_points(folder: Path, module: str, source: str, entry_points: dict[str, str]) -> None:
    """`module` (from `source`) and a distribution naming `module:NAME` for each group -> NAME of
    `entry_points`, in `folder`; the test puts `folder` on sys.path (monkeypatch.syspath_prepend)."""
    (folder / f"{module}.py").write_text(textwrap.dedent(source))
    info = folder / "mklang_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mklang-test-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n{name} = {module}:{name}\n" for group, name in entry_points.items())
    )
