"""Attacks on checkpoints handed to someone else (ADR 0014).

A checkpoint is data. Whoever edits one may not make `mklang resume` import
code, send the resuming user's API key to a server the file names, run a
machine other than the hashed ones, or strip the data fences; and no
edited field ends in an internal error. Every test is one attack, run
through the CLI's entry function on real files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli, cli_env, refused
from support.examples import EXAMPLES, HITL
from support.fakeserver import FakeServer, answer

from mklang.checkpoint.signing import checkpoint_key, sign
from mklang.stores import locate

KEY = "sk-resuming-users-own-key"
SCRIPT = ["--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish"]


def mklang(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in this process as the resuming user: no MKLANG_ variables unless given; never a traceback."""
    done = cli(*args, cwd=cwd, env=cli_env(**(env or {})))
    assert "internal error" not in done.stderr, done.stderr
    return done


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The free-text approval flow (tests/support/hitl) suspended at its human question, checkpoint `cp.json` beside the folder."""
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    done = mklang("run", "approval/approval.mk", *SCRIPT, "--hitl", "--checkpoint", "cp.json", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    return tmp_path


def edit(checkpoint: Path, change, *, resign: bool = False) -> None:
    """Edit the checkpoint's JSON in place; `resign` signs it again with this user's key."""
    document = json.loads(checkpoint.read_text(encoding="utf-8"))
    change(document)
    if resign:
        document["signature"] = sign(document, checkpoint_key())[1]
    checkpoint.write_text(json.dumps(document), encoding="utf-8")


def set_host(**settings):
    def change(document: dict) -> None:
        document["host"].update(settings)

    return change


# --- item 2: only checkpoints signed with this user's key resume without --trust


def test_an_edited_checkpoint_is_refused_in_one_line(project):
    edit(project / "cp.json", lambda d: d["frames"][0]["context"].update(topic="something else"))
    line = refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project))
    assert "edited after it was signed" in line and "--trust" in line


def test_an_unsigned_checkpoint_is_refused_in_one_line(project):
    edit(project / "cp.json", lambda d: d.pop("signature"))
    line = refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project))
    assert "not signed" in line and "--trust" in line


def test_a_checkpoint_of_another_key_is_refused_and_a_shared_fleet_key_resumes_it(project, tmp_path):
    fleet = {"MKLANG_CHECKPOINT_KEY": "fleet-secret-shared-by-every-worker-0123"}
    shutil.copytree(HITL / "approval", tmp_path / "fleet" / "approval")
    run = mklang(
        "run", "approval/approval.mk", *SCRIPT, "--hitl", "--checkpoint", "cp.json", cwd=tmp_path / "fleet", env=fleet
    )
    assert run.returncode == 3
    line = refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=tmp_path / "fleet"))
    assert "signed with another checkpoint key" in line
    done = mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=tmp_path / "fleet", env=fleet)
    assert done.returncode == 0, done.stderr


def test_the_key_file_is_created_owner_only_under_the_config_folder(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    done = mklang("run", "approval/approval.mk", *SCRIPT, "--hitl", "--checkpoint", "cp.json", cwd=tmp_path, env=env)
    assert done.returncode == 3
    key = tmp_path / "config" / "mklang" / "checkpoint.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_text().strip()) == 64
    assert (
        KEY not in (tmp_path / "cp.json").read_text()
        and key.read_text().strip() not in (tmp_path / "cp.json").read_text()
    )


def test_an_edited_journal_line_of_a_crashed_run_is_refused(project):
    checkpoint = project / "cp.json"
    # Make the suspended run look crashed: a running envelope and a journal with one step.
    from mklang.checkpoint.journal import StoreJournal
    from mklang.checkpoint.paths import MachinePaths
    from mklang.runs import open_run

    resumable = open_run(checkpoint, lock=False)
    root = resumable.chain[0].machine.path
    journal = StoreJournal(
        locate(checkpoint), resumable.envelope, hashes=resumable.loader.hashes, paths=MachinePaths(root)
    )
    journal.snapshot(resumable.chain, status="running")
    journal.record("x:1.0", "tool", "paid answer")
    journal.store.close()
    lines = (project / "cp.json.journal").read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"paid answer", b"forged answer")
    (project / "cp.json.journal").write_bytes(b"\n".join(lines))
    line = refused(mklang("resume", "cp.json", cwd=project))
    assert "journal line 2" in line and "edited" in line


# --- item 1: an untrusted checkpoint never chooses code, endpoints or keys


def test_an_edited_plugin_list_never_imports_code(project):
    marker = project / "pwned"
    (project / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nTOOLS = {{}}\n")
    edit(project / "cp.json", set_host(plugins=[str(project / "evil.py")]))
    refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project))
    assert not marker.exists()
    done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *SCRIPT, cwd=project)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert "ignored its recorded plugins" in done.stderr


def test_an_edited_config_and_provider_never_send_the_key_to_the_files_server(project):
    with FakeServer() as attacker, FakeServer() as own:
        attacker.fallback = answer("approve")
        own.fallback = answer("approve")
        (project / "evil.toml").write_text(
            f'[providers.openai]\nbase_url = "{attacker.openai_url}"\napi_key_env = "OPENAI_API_KEY"\n'
        )
        edit(
            project / "cp.json",
            set_host(script=None, scenario=None, provider="openai", model="m", config=str(project / "evil.toml")),
        )
        user = {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": own.openai_url}
        refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project, env=user))
        done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", cwd=project, env=user)
        refused(done, "no model configured")  # the file chose nothing
        assert "ignored its recorded provider, model, config\n" in done.stderr
        (project / "tools.py").write_text('TOOLS = {"publish": lambda input: "https://status.example.test/1"}\n')
        own_flags = ["--provider", "openai", "--model", "m", "--plugin", str(project / "tools.py")]
        done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *own_flags, cwd=project, env=user)
        assert attacker.count == 0
        assert own.count >= 1 and own.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_edited_replay_and_record_paths_are_neither_read_nor_written(project):
    stolen = project / "stolen.json"
    edit(project / "cp.json", set_host(script=None, scenario=None, replay="/etc/passwd", record=str(stolen)))
    done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *SCRIPT, cwd=project)
    assert done.returncode == 0, done.stderr
    assert not stolen.exists()
    done = mklang("show", "cp.json", "--summary", "--format", "json", cwd=project)
    shown = json.loads(done.stdout)
    assert shown["signature"]["seal"] == "signed"  # the resumed run re-signed it with this user's own settings
    assert "replay" not in shown["host"] and "record" not in shown["host"]


def test_show_prints_the_recorded_host_settings_and_whether_the_file_is_signed(project):
    shown = json.loads(mklang("show", "cp.json", "--summary", "--format", "json", cwd=project).stdout)
    assert shown["signature"]["seal"] == "signed"
    assert shown["host"]["script"] == str(project / "approval" / "scenarios.yaml")
    edit(project / "cp.json", set_host(plugins=["os"]))
    text = mklang("show", "cp.json", "--summary", "--format", "text", cwd=project).stdout
    assert "edited after it was signed" in text and "recorded plugins: ['os']" in text


def test_a_signed_checkpoint_reuses_its_recorded_host_as_today(project):
    done = mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "ignored" not in done.stderr


# --- items 2 and 7: frames run only hashed files; the checkpoint moves with the project


def test_an_edited_frame_path_pointing_to_another_file_is_refused(project):
    (project / "evil.mk").write_text((project / "approval" / "approval.mk").read_text())
    edit(project / "cp.json", lambda d: d["frames"][0].update(path="../evil.mk"), resign=True)
    line = refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project))
    assert "names ../evil.mk, which is not one of the checkpoint's hashed machine files" in line
    line = refused(mklang("resume", "cp.json", "--trust", "--force", *SCRIPT, cwd=project))
    assert "not one of the checkpoint's hashed machine files" in line


def test_an_edited_machines_map_pointing_to_another_file_is_refused(project):
    from mklang.syntax.machines import file_sha256

    evil = project / "approval" / "evil.mk"
    evil.write_text((project / "approval" / "approval.mk").read_text().replace("status page", "attacker page"))

    def change(document: dict) -> None:
        document["machines"]["evil.mk"] = file_sha256(evil)
        document["frames"][0]["path"] = "evil.mk"

    edit(project / "cp.json", change)
    line = refused(mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *SCRIPT, cwd=project))
    assert "does not run the root machine" in line


def test_a_sub_frame_pointed_at_another_hashed_machine_is_refused(tmp_path):
    shutil.copytree(EXAMPLES / "nested", tmp_path / "nested")
    nested = ["--script", "nested/scenarios.yaml", "--scenario", "two-sections-one-corrected"]
    run = mklang("run", "nested/brief.mk", *nested, "--checkpoint", "cp.json", "--max-tokens", "300", cwd=tmp_path)
    assert run.returncode == 3
    edit(tmp_path / "cp.json", lambda d: d["frames"][1].update(path="fact_check.mk"))
    line = refused(mklang("resume", "cp.json", "--trust", "--max-tokens", "100000", *nested, cwd=tmp_path))
    assert "frame 1 (brief at add_section): calls 'section', but the next frame runs 'fact_check'" in line


def test_a_moved_project_folder_resumes_and_a_moved_root_takes_its_sub_machines_along(tmp_path):
    shutil.copytree(EXAMPLES / "nested", tmp_path / "here" / "nested")
    nested = ["--script", "nested/scenarios.yaml", "--scenario", "two-sections-one-corrected", "--format", "json"]
    reference = json.loads(mklang("run", "nested/brief.mk", *nested, cwd=tmp_path / "here").stdout)
    run = mklang(
        "run", "nested/brief.mk", *nested, "--checkpoint", "cp.json", "--max-tokens", "300", cwd=tmp_path / "here"
    )
    assert run.returncode == 3
    recorded = json.loads((tmp_path / "here" / "cp.json").read_text())
    assert recorded["machine"]["path"] == "nested/brief.mk"
    assert sorted(recorded["machines"]) == ["brief.mk", "fact_check.mk", "section.mk"]
    assert [frame["path"] for frame in recorded["frames"]] == ["brief.mk", "section.mk"]
    shutil.copy(tmp_path / "here" / "cp.json", tmp_path / "cp.json")
    shutil.copytree(tmp_path / "here", tmp_path / "copy")
    shutil.move(tmp_path / "here", tmp_path / "moved")
    # A copy of a run already resumed is an older generation of it: it runs again only when allowed.
    for folder, again in (("moved", []), ("copy", ["--allow-rollback"])):
        done = mklang("resume", "cp.json", "--max-tokens", "100000", *again, *nested, cwd=tmp_path / folder)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["result"] == reference["result"]
    # The checkpoint stays behind, the project goes: --machine names the root, the sub-machines follow.
    assert "--machine" in refused(
        mklang("resume", "cp.json", "--max-tokens", "100000", "--allow-rollback", cwd=tmp_path)
    )
    moved_root = ["--machine", "copy/nested/brief.mk", "--script", "copy/nested/scenarios.yaml", *nested[2:4]]
    done = mklang("resume", "cp.json", "--max-tokens", "100000", "--allow-rollback", *moved_root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_format_1_checkpoint_with_absolute_paths_migrates_and_resumes(project):
    from mklang.checkpoint.signing import checkpoint_key  # noqa: F401 - the suite's own key signs nothing here

    folder = project / "approval"

    def to_format_1(document: dict) -> None:
        document["format"] = 1
        document.pop("signature")
        document["machine"]["path"] = str(folder / "approval.mk")
        document["machines"] = {str(folder / name): digest for name, digest in document["machines"].items()}
        for frame in document["frames"]:
            frame["path"] = str(folder / frame["path"])

    edit(project / "cp.json", to_format_1)
    done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *SCRIPT, cwd=project)
    assert done.returncode == 0, done.stderr


# --- item 1: cleared taint is harmless


def test_cleared_taint_is_refused_or_every_value_is_fenced(project):
    edit(project / "cp.json", lambda d: d["frames"][0].update(tainted=[]))
    refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", cwd=project))
    done = mklang("resume", "cp.json", "--trust", "--set", "approval.answer=yes", *SCRIPT, cwd=project)
    assert done.returncode == 0, done.stderr
    tainted = set(json.loads((project / "cp.json").read_text())["frames"][0]["tainted"])
    assert {"topic", "audience", "approval", "announcement"} <= tainted


# --- item 6: structure is checked before any provider; --force never skips it


def rename_state(project: Path) -> None:
    machine = project / "approval" / "approval.mk"
    machine.write_text(machine.read_text().replace("decide", "choose"))


def test_a_renamed_state_with_force_is_one_line_exit_2(project):
    rename_state(project)
    assert "changed" in refused(mklang("resume", "cp.json", "--set", "approval.answer=yes", *SCRIPT, cwd=project))
    line = refused(mklang("resume", "cp.json", "--force", "--set", "approval.answer=yes", *SCRIPT, cwd=project))
    assert line.endswith(
        "frame 1 (approval at decide): state 'decide' no longer exists in " + str(project / "approval" / "approval.mk")
    )
    assert refused(mklang("resume", "--check", "cp.json", "--force", cwd=project)) == line


def test_resume_check_sets_up_no_provider_and_spends_nothing(project):
    before = (project / "cp.json").read_bytes()
    done = mklang(
        "resume", "--check", "cp.json", "--provider", "openai", "--model", "m", "--format", "text", cwd=project
    )
    assert (done.returncode, done.stdout.strip()) == (0, "compatible (approval:decide)")
    assert (project / "cp.json").read_bytes() == before


def test_a_repair_counter_of_a_gate_that_is_gone_is_one_line_exit_2(project):
    edit(project / "cp.json", lambda d: d["frames"][0].update(repair_left=[["draft", 0, 1]]), resign=True)
    line = refused(mklang("resume", "--check", "cp.json", cwd=project))
    assert "repair counter of gate 0 of 'draft', which is not a repair gate" in line


BAD_VALUES = [None, -1, "x", [], [[1, 2]], {"a": 1}]


def _mutations(document: dict):
    """(label, edit) for every field of the envelope and of its frame, with every value of another type."""
    frame = document["frames"][0]
    for name in sorted(document):
        for value in BAD_VALUES:
            if name != "signature" and json.dumps(document[name]) != json.dumps(value):
                yield f"{name}={value!r}", lambda d, n=name, v=value: d.__setitem__(n, v)
    for name in sorted(frame):
        for value in BAD_VALUES:
            if json.dumps(frame[name]) != json.dumps(value):
                yield f"frames.0.{name}={value!r}", lambda d, n=name, v=value: d["frames"][0].__setitem__(n, v)


def test_every_field_tampered_with_any_type_is_refused_or_resumes_never_an_internal_error(project):
    """Signed by someone else (here: re-signed, so only the content is judged) or not at all."""
    pristine = (project / "cp.json").read_text()
    outcomes: dict[int, int] = {}
    for number, (label, change) in enumerate(_mutations(json.loads(pristine))):
        for resign in (False, True) if number % len(BAD_VALUES) == 0 else (True,):
            (project / "cp.json").write_text(pristine)
            edit(project / "cp.json", change, resign=resign)
            done = mklang("resume", "cp.json", "--set", "approval.answer=yes", *SCRIPT, cwd=project)
            assert done.returncode in (0, 1, 2, 3), (label, done.returncode, done.stdout, done.stderr)
            assert "internal error" not in done.stdout, (label, done.stdout)  # stderr: checked by mklang()
            if done.returncode == 2:
                assert "internal error" not in refused(done), label
            if not resign:
                assert done.returncode == 2, label  # unsigned edits never run
            outcomes[done.returncode] = outcomes.get(done.returncode, 0) + 1
    assert outcomes[2] > 0 and outcomes.get(0, 0) > 0, outcomes


# --- what a checkpoint may decide about the host that resumes it (ADR 0014) ---

NOTHING_GIVEN = dict.fromkeys(("script", "scenario", "provider", "model", "config", "replay", "plugins"))


def _recorded(**fields: Any) -> Any:
    from mklang.checkpoint.envelope import HostSettings

    return HostSettings(**fields)


def test_a_trusted_checkpoint_answers_as_the_run_did_when_the_command_line_gives_no_way():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", model="m", replay="c.yaml", record="new.yaml", plugins=["p"])
    reused, ignored = host_choice(recorded, NOTHING_GIVEN, trusted=True)
    assert ignored == []
    assert reused == {
        "script": "s.yaml",
        "scenario": "a",
        "provider": None,
        "model": "m",
        "config": None,
        "replay": "c.yaml",
        "plugins": ["p"],
    }  # never re-recording
    chosen, _ = host_choice(recorded, {**NOTHING_GIVEN, "scenario": "b"}, trusted=True)
    assert (chosen["script"], chosen["scenario"]) == ("s.yaml", "b")


def test_an_untrusted_checkpoint_decides_nothing_and_names_what_it_would_have():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", model="m", replay="c.yaml", plugins=["p"])
    assert host_choice(recorded, NOTHING_GIVEN, trusted=False) == (
        NOTHING_GIVEN,
        ["script", "scenario", "model", "replay", "plugins"],
    )
    assert host_choice(_recorded(), NOTHING_GIVEN, trusted=False) == (NOTHING_GIVEN, [])  # nothing recorded


def test_one_way_of_answering_given_keeps_every_recorded_one_out():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", plugins=["p"])
    for name in ("script", "provider", "model", "config", "replay"):
        given = {**NOTHING_GIVEN, name: "given"}
        reused, _ = host_choice(recorded, given, trusted=True)
        assert reused == {**given, "plugins": ["p"]}
        assert host_choice(recorded, given, trusted=False) == (given, ["plugins"])
    given = {**NOTHING_GIVEN, "provider": "given", "plugins": []}  # --plugin given: the recorded ones stay out
    assert host_choice(recorded, given, trusted=True) == (given, [])
