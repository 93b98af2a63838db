"""The package finds its grammar and standard library when installed, not only in a checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from support import ROOT

import mklang

PROBE = """
from mklang.syntax import parse
from mklang.syntax.grammar import grammar_path
from mklang.syntax.resolve import find_machine
import mklang.syntax._parser as standalone
print(grammar_path())
print(find_machine("chain_of_thought", "."))
print(standalone.__file__)
print(parse("machine m\\nentry a\\nbudget 1\\nstate a {\\n  tool t\\n  output o\\n  otherwise -> END\\n}\\n").name)
"""


def _probe(site: Path, cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_wheel_configuration_ships_grammar_and_library():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert include["grammar"] == "mklang/grammar" and include["machines"] == "mklang/machines"
    assert config["project"]["scripts"]["mklang"] == "mklang.cli:main"


def test_installed_layout_finds_its_own_grammar_and_library(tmp_path):
    """Lay the package out as the wheel does (force-include) and load from there only."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "mklang", site / "mklang", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "grammar", site / "mklang" / "grammar")
    shutil.copytree(ROOT / "machines", site / "mklang" / "machines")
    grammar, library, parser_module, name = _probe(site, tmp_path)
    assert Path(grammar) == site / "mklang" / "grammar" / "mklang.lark"
    assert Path(library).parent == (site / "mklang" / "machines").resolve()
    assert Path(parser_module).parent == site / "mklang" / "syntax"
    assert name == "m"


def test_checkout_finds_the_top_level_grammar(tmp_path):
    grammar, library, _, _ = _probe(ROOT, tmp_path)
    assert Path(grammar) == ROOT / "grammar" / "mklang.lark"
    assert Path(library).parent == ROOT / "machines"


def test_built_wheel_contains_grammar_parser_and_library(tmp_path):
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"mklang/grammar/mklang.lark", "mklang/syntax/_parser.py", "mklang/machines/chain_of_thought.mk"} <= names
    # Type information and the licence notices ship with the code.
    assert {"mklang/py.typed", "mklang/syntax/PARSER-NOTICE"} <= names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)


def _built(kind: str, directory: Path) -> Path:
    from hatchling.builders.sdist import SdistBuilder
    from hatchling.builders.wheel import WheelBuilder

    builder = WheelBuilder if kind == "wheel" else SdistBuilder
    (artifact,) = builder(str(ROOT)).build(directory=str(directory), versions=["standard"])
    return Path(artifact)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_an_installed_package_works_in_a_fresh_environment_outside_the_checkout(tmp_path, kind):
    """Build the wheel or the sdist, install it with its console extra into a fresh environment, as
    pipx would, and use it from another folder: its version, a run of an example, `serve --help`."""
    artifact = _built(kind, tmp_path / "dist")
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python, command = env / "bin" / "python", env / "bin" / "mklang"
    # The dependencies come from this interpreter's environment (a venv or not), after the new one's own
    # site-packages, where the package goes: --system-site-packages would reach the base interpreter's.
    # pip resolves the package's requirements and its console extra's against them (there is no index).
    (new_site,) = (env / "lib").glob("python*/site-packages")
    (new_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = ["install", "-q", "--no-index", "--no-build-isolation", f"mklang[console] @ {artifact.as_uri()}"]
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *install], check=True)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "examples" / "triage", elsewhere)
    (elsewhere / "uses_stdlib.mk").write_text(
        "machine uses_stdlib\nentry think\nbudget 5\n"
        'state think {\n  call chain_of_thought { question: "why?" }\n  output answer\n  otherwise -> END\n}\n'
    )
    isolated = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # no checkout on the path

    def installed(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(command), *args], cwd=elsewhere, env=isolated, capture_output=True, text=True)

    probe = "import mklang, mklang.syntax.grammar as g; print(mklang.__file__); print(g.grammar_path())"
    located = subprocess.run(
        [str(python), "-c", probe], cwd=elsewhere, env=isolated, capture_output=True, text=True, check=True
    )
    module, grammar = located.stdout.split()
    assert module.startswith(str(env)) and grammar.startswith(str(env))
    version = installed("--version")
    assert version.stdout == f"mklang {mklang.__version__}\n" and version.stdout.startswith("mklang 2.")
    checked = installed("check", "uses_stdlib.mk")
    assert checked.returncode == 0, checked.stderr  # `call chain_of_thought` resolved in the installed library
    ran = installed("run", "triage.mk", "--script", "scenarios.yaml", "--scenario", "small-refund-answered-directly")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["status"] == "done"
    served = installed("serve", "--help")
    assert served.returncode == 0 and "--store" in served.stdout, served.stderr


def test_version_is_printed_by_the_console_entry_point():
    done = subprocess.run([sys.executable, "-m", "mklang", "--version"], capture_output=True, text=True, check=True)
    assert done.stdout == f"mklang {mklang.__version__}\n"


def test_lark_is_a_development_dependency_only():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any(dep.startswith("lark") for dep in config["project"]["dependencies"])
    assert any(dep.startswith("lark") for dep in config["project"]["optional-dependencies"]["dev"])


BLOCK_LARK = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("lark", "interegular"):
            raise ImportError(name + " is not installed")
sys.meta_path.insert(0, Blocked())
from mklang.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "args",
    [
        ["check", "examples/triage/triage.mk"],
        ["fmt", "--check", "examples/triage/triage.mk"],
        ["test", "examples/triage/triage.mk", "--script", "examples/triage/scenarios.yaml"],
    ],
)
def test_the_tool_runs_without_lark(args):
    """The parser is generated: checking, formatting and running a machine never import lark."""
    done = subprocess.run([sys.executable, "-c", BLOCK_LARK, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_version_is_2_or_later_in_the_metadata_and_the_package():
    """mklang 1.x is published at 1.4.0 under the same name: this successor must sort above it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["version"] == mklang.__version__
    assert int(mklang.__version__.split(".")[0]) >= 2
    assert f"## {mklang.__version__}" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_every_install_hint_asks_for_this_line_not_1x():
    """A hint `pip install 'mklang[extra]'` (or `'mklang'`) says `>=2`, so that no resolver picks the published 1.x for it."""
    texts = [*ROOT.glob("mklang/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    hints = [hint for path in texts for hint in re.findall(r"pip install\s+['\"]?mklang[^\s'\"`)]*", path.read_text())]
    assert len(hints) >= 8
    assert all(re.fullmatch(r"pip install\s+['\"]mklang(\\*\[[\w{}]+\])?>=2", hint) for hint in hints), hints
