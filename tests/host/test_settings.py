"""The host settings are declared once (`mklang.host.settings`, ADR 0039): every other place that
names them (the checkpoint's fields, the API's keywords, the command-line options, which ones
name files and which ones a checkpoint signed with your key fills in) agrees with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.core
import typer.main

import mklang

# Importing a command module registers its commands.
import mklang.cli.console_cmds
import mklang.cli.mcp_cmds
import mklang.cli.run_cmds
import mklang.cli.scale_cmds
from mklang.checkpoint.envelope import HostSettings
from mklang.checkpoint.paths import checkpoint_folder, located_host, portable_host
from mklang.checkpoint.trust import host_choice
from mklang.cli.app import app
from mklang.host.settings import CHOSEN, SETTINGS, given

NAMES = [setting.name for setting in SETTINGS]
LISTS = {setting.name for setting in SETTINGS if setting.many}
CHOSEN_NAMES = [setting.name for setting in CHOSEN]


def test_the_checkpoint_records_every_setting_in_the_declared_order():
    # The envelope's JSON is signed as written: its field order is the declaration's.
    assert list(HostSettings.model_fields) == NAMES
    written = HostSettings(**{name: None for name in NAMES if name not in LISTS}).model_dump_json()
    assert written.startswith('{"script":') and written.endswith('"plugins":[],"mcp":[]}')


def _refused(call, keyword: str) -> bool:
    """Whether `call` refuses `keyword` as Python refuses an unknown one (it fails otherwise, on a missing file)."""
    try:
        call(**{keyword: None})
    except TypeError as error:
        assert f"unexpected keyword argument '{keyword}'" in str(error)
        return True
    except mklang.MklangError:
        return False
    raise AssertionError(f"{keyword}=None ran a missing machine")


@pytest.mark.parametrize(("function", "left_out"), [("run", ()), ("resume", ()), ("batch", ("record",))])
def test_the_api_takes_every_setting_a_caller_chooses_as_a_keyword(function, left_out, tmp_path):
    missing = tmp_path / "nowhere"
    calls = {
        "run": lambda **keywords: mklang.run(missing, **keywords),
        "resume": lambda **keywords: mklang.resume(missing, **keywords),
        "batch": lambda **keywords: mklang.batch(missing, [], store=missing, **keywords),
    }
    assert [name for name in CHOSEN_NAMES if _refused(calls[function], name)] == list(left_out)


def _options(command: str) -> set[str]:
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    return {option for parameter in group.commands[command].params for option in parameter.opts}


@pytest.mark.parametrize(
    ("command", "left_out"),
    [
        ("run", ()),
        ("resume", ()),
        ("batch", ("--record",)),
        ("serve", ("--record",)),
        ("mcp", ("--record",)),
        ("worker", ("--scenario", "--record")),
    ],
)
def test_the_command_line_has_an_option_for_every_setting_a_caller_chooses(command, left_out):
    options = _options(command)
    assert [setting.option for setting in CHOSEN if setting.option not in options] == list(left_out)
    assert "--plugin" in options  # a list's option is singular: given once per entry


def test_every_setting_but_the_hosts_own_state_is_chosen_by_a_caller():
    assert [name for name in NAMES if name not in CHOSEN_NAMES] == ["state"]
    assert list(given()) == CHOSEN_NAMES
    assert given(script=Path("s.yaml"), plugins=("p", Path("t.py")))["plugins"] == ["p", "t.py"]
    with pytest.raises(TypeError, match="not a host setting: state"):
        given(state={})


def test_the_settings_declared_to_name_files_move_with_the_checkpoint(tmp_path):
    checkpoint = tmp_path / "project" / "cp.json"
    files = {setting.name for setting in SETTINGS if setting.names_file}
    assert files == {"script", "config", "replay", "record", "plugins"}
    absolute = {name: str(tmp_path / "project" / f"{name}.py") for name in files - {"plugins"}}
    recorded = HostSettings(**absolute, provider="openai", plugins=["module", str(tmp_path / "project" / "p.py")])
    portable = portable_host(recorded, checkpoint_folder(checkpoint))
    assert portable.model_dump(exclude={"state"}) == {
        **{name: f"{name}.py" for name in absolute},
        "scenario": None,
        "provider": "openai",
        "model": None,
        "pool": None,
        "plugins": ["module", "p.py"],
        "mcp": [],
    }
    assert located_host(portable, checkpoint) == recorded


def test_a_signed_checkpoint_fills_in_what_the_caller_leaves_out_as_each_setting_declares():
    every = HostSettings(**{name: [name] if name in LISTS else name for name in CHOSEN_NAMES})
    reused, ignored = host_choice(every, given(), trusted=True)
    filled = [setting.name for setting in CHOSEN if setting.resumed != "never"]
    assert [name for name in CHOSEN_NAMES if reused[name] is not None] == filled
    assert "record" not in filled  # a resume never re-records
    assert ignored == []
    _, ignored = host_choice(every, given(), trusted=False)
    assert ignored == filled  # an unsigned one decides none of them, and says so in the declared order


def test_every_place_that_names_the_run_settings_names_the_declared_ones():
    """The run settings are declared once (`host.settings.RUN_SETTINGS`): the run request, the
    command line's flags, the API's keywords, what `start` and `proceed` take and the envelope
    name the same ones, the budgets among them in the envelope's `budgets`."""
    from mklang._api import Bounds
    from mklang.checkpoint.envelope import Budgets, Envelope
    from mklang.cli.run_cmds import RunFlags
    from mklang.host.settings import BUDGETS, RUN_NAMES
    from mklang.runs import RunRequest, RunSettings

    names = set(RUN_NAMES)
    assert names <= set(RunRequest.__dataclass_fields__)
    assert set(RunFlags._fields) == names | {"replace"}
    assert set(Bounds.__optional_keys__) == names - {"hitl"} | {"observer"}  # `hitl` is a keyword of run and resume
    assert names <= set(RunSettings.__optional_keys__)
    assert list(Budgets.model_fields) == list(BUDGETS)
    assert names - set(BUDGETS) <= set(Envelope.model_fields)


def test_an_untrusted_checkpoint_decides_a_run_setting_only_as_its_declaration_says():
    from mklang.checkpoint.trust import run_settings
    from mklang.host.settings import RUN_NAMES
    from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY as DEFAULT

    recorded = {"max_tokens": 10, "max_cost": 0.5, "max_time": 60.0, "concurrency": 500, "hitl": False}
    recorded["untrusted_flow"] = "halt"
    unset = dict.fromkeys(RUN_NAMES)
    assert run_settings(recorded, unset, trusted=True) == (recorded, [])
    chosen, ignored = run_settings(recorded, unset, trusted=False)
    assert chosen == {**recorded, "hitl": True, "concurrency": DEFAULT}
    assert ignored == [
        "hitl false (human gates stay on; --no-hitl turns them off)",
        f"concurrency 500 (at most {DEFAULT}; --concurrency N)",
    ]
    given = {**unset, "hitl": False, "concurrency": 64}
    assert run_settings(recorded, given, trusted=False) == ({**recorded, "concurrency": 64}, [])
