"""Host tools and hooks: built-ins, entry points, the Python API and --plugin."""

from __future__ import annotations

import textwrap

import pytest
from support.commands import cli, refused
from support.plugins import install_entry_points

from mklang.errors import UsageError
from mklang.host.plugins import load_plugins
from mklang.host.registry import BUILTIN_TOOLS, Registry, calc


@pytest.mark.parametrize(
    ("expression", "value"), [("6 * 7", "42"), ("2 ** 10 - 24", "1000"), ("7 / 2", "3.5"), ("-(3 + 4) % 5", "3")]
)
def test_calc_evaluates_arithmetic(expression, value):
    assert calc({"expression": expression}) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "open('x')", "a + 1", "2 ** 999", "1 / 0"])
def test_calc_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        calc({"expression": expression})


def test_entry_points_register_tools_and_the_host_api_wins(tmp_path, monkeypatch):
    install_entry_points(
        tmp_path,
        "shout_plugin",
        "def shout(arguments):\n    return arguments['text'].upper()\n",
        {"mklang.tools": "shout"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("mklang.tools", BUILTIN_TOOLS)
    assert registry.get("shout")({"text": "hi"}) == "HI"
    assert registry.get("calc") is calc
    assert registry.get("missing") is None
    given = Registry("mklang.tools", BUILTIN_TOOLS, {"shout": lambda arguments: "given"})
    assert given.get("shout")({"text": "hi"}) == "given"


def test_a_plugin_file_provides_tools_and_hooks(tmp_path):
    plugin = tmp_path / "host_plugin.py"
    plugin.write_text("TOOLS = {'echo': lambda a: a['text']}\nHOOKS = {'always': lambda c, o: True}\n")
    tools, hooks = load_plugins([str(plugin)])
    assert tools["echo"]({"text": "x"}) == "x" and hooks["always"]({}, "o") is True


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("X = 1\n", "defines neither TOOLS nor HOOKS"),
        ("TOOLS = {'a': 1}\n", "TOOLS must map names to callables"),
    ],
)
def test_a_bad_plugin_is_one_clear_error(tmp_path, source, message):
    plugin = tmp_path / "bad_plugin.py"
    plugin.write_text(source)
    with pytest.raises(UsageError, match=message):
        load_plugins([str(plugin)])


def test_run_uses_a_plugin_tool_from_the_command_line(tmp_path):
    plugin = tmp_path / "tools.py"
    plugin.write_text("TOOLS = {'reverse': lambda a: a['text'][::-1]}\n")
    machine = tmp_path / "m.mk"
    machine.write_text(
        textwrap.dedent("""\
        machine m
        entry flip
        budget 2
        tool reverse "Reverse text. Input: {text}."
        state flip {
          tool reverse { text: "{{word}}" }
          output flipped
          otherwise -> END
        }
        """)
    )
    done = cli("run", str(machine), "--plugin", str(plugin), "--set", "word=stressed", "--script", "/dev/null")
    refused(done)  # an empty script is a usage error, reported once
    script = tmp_path / "s.yaml"
    script.write_text("scenarios:\n  - name: only\n")
    done = cli(
        "run",
        str(machine),
        "--plugin",
        str(plugin),
        "--set",
        "word=stressed",
        "--script",
        str(script),
        "--format",
        "json",
    )
    assert done.returncode == 0, done.stderr
    assert '"result": "desserts"' in done.stdout
