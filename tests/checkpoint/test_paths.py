"""Machine files as a checkpoint names them."""

from __future__ import annotations

from pathlib import Path

from mklang.checkpoint.paths import MachinePaths
from mklang.syntax.resolve import stdlib_dirs


def test_a_standard_library_name_is_a_bare_file_name_looked_up_in_the_library_only():
    library = stdlib_dirs()[0]
    paths = MachinePaths(None)
    assert paths.name(str(library / "debate.mk")) == "stdlib:debate.mk"
    assert paths.file("stdlib:debate.mk") == library / "debate.mk"
    assert paths.file("stdlib:nowhere.mk") == Path("nowhere.mk")  # not in the library: reported missing as is
    escaping = f"../{library.name}/debate.mk"
    assert (library / escaping).is_file()
    assert paths.file(f"stdlib:{escaping}") == Path(escaping)  # never a path out of the library
