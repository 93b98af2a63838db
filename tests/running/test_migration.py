"""Parked runs and a new machine version (ADR 0061): `resume --machine NEW --check / --migrate`
and `runs migrate`, over the file store and PostgreSQL, against a real model server that counts calls.

The run is examples/approval parked on its decision (at `draft`, waiting for a choice in `approval`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, model_config, refused
from support.fakeserver import Request, answer

APPROVAL = ROOT / "examples" / "approval" / "approval.mk"
HOST = ("--config", "mklang.toml", "--plugin", "tools.py")


def _model(request: Request):
    """The approval machine's one model call: the draft."""
    return answer("Maintenance on Saturday\nLogins may fail.")


@pytest.fixture(params=["file", "postgres"])
def store(request) -> str:
    """A folder store, or a fresh PostgreSQL schema."""
    return "runs" if request.param == "file" else request.getfixturevalue("postgres_uri")


def _target(store: str, run: str) -> str:
    return f"{store}/{run}" if store == "runs" else f"{store}#{run}"


@pytest.fixture
def parked(tmp_path: Path, server, store: str) -> tuple[Path, str]:
    """A folder with the approval machine, a host on the counting server, and the target of a run
    parked on its question in `store`."""
    shutil.copy(APPROVAL, tmp_path / "approval.mk")
    (tmp_path / "v2").mkdir()
    (tmp_path / "tools.py").write_text("TOOLS = {'publish': lambda args: 'https://status.example.com/1'}\n")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    server.handler = _model
    (tmp_path / "runs").mkdir()
    target = _target(store, "parked")
    _park(tmp_path, target)
    assert server.count == 1  # the draft; the run waits at `draft` for the reviewer's choice
    return tmp_path, target


def _park(folder: Path, target: str) -> None:
    done = cli("run", "approval.mk", "--hitl", "--checkpoint", target, *HOST, "--format", "json", cwd=folder)
    assert done.returncode == 3, done.stderr


def _new_version(folder: Path, *edits: tuple[str, str]) -> str:
    """v2/approval.mk: the machine with each `(old, new)` of `edits` replaced."""
    text = APPROVAL.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    (folder / "v2" / "approval.mk").write_text(text)
    return "v2/approval.mk"


def _check(folder: Path, target: str, machine: str, *more: str) -> tuple[int, str]:
    done = cli("resume", target, "--machine", machine, "--check", *more, "--format", "text", cwd=folder)
    return done.returncode, done.stdout.strip() or done.stderr.strip()


EDITED_PROMPT = [("The reviewer's notes on the previous version", "Notes from the reviewer on the last version")]
RENAMED = [("entry draft", "entry compose"), ("state draft", "state compose"), ("-> draft", "-> compose")]
ANSWER = ("--answer", "approve")


def test_an_edited_prompt_is_compatible_and_the_migrated_run_finishes_without_paying_again(parked, server):
    folder, target = parked
    machine = _new_version(folder, *EDITED_PROMPT)
    assert _check(folder, target, machine) == (0, "compatible")
    refused(cli("resume", target, *ANSWER, "--machine", machine, *HOST, cwd=folder), "--migrate", "--force")
    done = cli(
        "resume", target, *ANSWER, "--machine", machine, "--migrate", *HOST,
        "--format", "json", cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["result"] == "https://status.example.com/1"
    assert [step["state"] for step in result["trace"]] == ["draft", "publish"]
    assert server.count == 1  # the draft is never paid again


def test_a_renamed_state_is_migratable_with_a_map_and_incompatible_without(parked, server):
    folder, target = parked
    machine = _new_version(folder, *RENAMED)
    code, line = _check(folder, target, machine)
    assert code == 2 and line == (
        f"incompatible at frame 1: approval at draft: state 'draft' no longer exists in {folder / machine}"
    )
    assert _check(folder, target, machine, "--map", "draft=compose") == (0, "migratable")
    done = cli(
        "resume", target, *ANSWER, "--machine", machine, "--map", "draft=compose",
        "--migrate", *HOST, "--format", "json", cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [step["state"] for step in json.loads(done.stdout)["trace"]] == [
        "draft",
        "publish",
    ]  # the trace keeps the names it ran under
    assert server.count == 1


MOVED = [*RENAMED, ("\nstate compose", '\nmoved "draft" -> "compose"\n\nstate compose')]


def test_a_renamed_state_declared_moved_is_migratable_without_a_map_and_finishes_without_paying_again(
    parked, store, server
):
    folder, target = parked
    machine = _new_version(folder, *MOVED)
    assert cli("check", machine, cwd=folder).returncode == 0
    assert _check(folder, target, machine) == (0, "migratable")
    listed = cli("runs", "migrate", "--store", store, "--machine", machine, "--dry-run", cwd=folder)
    assert (listed.returncode, listed.stdout) == (0, "parked: migratable\n")
    done = cli(
        "resume", target, *ANSWER, "--machine", machine, "--migrate", *HOST,
        "--format", "json", cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [step["state"] for step in json.loads(done.stdout)["trace"]] == ["draft", "publish"]
    assert server.count == 1  # the draft is never paid again


def test_a_moved_state_must_still_continue_the_frame(parked):
    """`moved` renames; it does not excuse a state that no longer continues what the run stood at."""
    folder, target = parked
    machine = _new_version(folder, *MOVED, ("output announcement", "output notice"))
    code, line = _check(folder, target, machine)
    assert code == 2 and line.startswith("incompatible at frame 1: approval at compose: the state's output key")
    machine = _new_version(folder, *MOVED, ('moved "draft" -> "compose"', 'moved "draft" -> "publish"'))
    code, line = _check(folder, target, machine)  # moved onto a tool state: renamed, then refused
    assert code == 2 and "approval at publish: the state was a produce state and is now a tool state" in line


def test_a_removed_state_is_incompatible_at_its_frame_and_is_never_migrated(parked, server):
    folder, target = parked
    text = APPROVAL.read_text()
    draft = text[text.index("state draft") : text.index("state publish")]
    (folder / "v2" / "approval.mk").write_text(text.replace(draft, "").replace("entry draft", "entry publish"))
    code, line = _check(folder, target, "v2/approval.mk")
    assert code == 2 and line.startswith("incompatible at frame 1: approval at draft: state 'draft' no longer")
    done = cli(
        "resume", target, *ANSWER, "--machine", "v2/approval.mk", "--migrate", *HOST,
        cwd=folder,
    )  # fmt: skip
    refused(done, "incompatible at frame 1", "not migrated")
    assert server.count == 1
    shown = json.loads(cli("show", target, "--summary", "--format", "json", cwd=folder).stdout)
    assert (shown["status"], shown["lineage"]) == ("suspended", [])  # left as it was


def test_a_changed_output_key_or_decision_is_incompatible(parked):
    folder, target = parked
    machine = _new_version(folder, ("output announcement", "output notice"))
    code, line = _check(folder, target, machine)
    assert code == 2 and "output key changed from 'announcement' to 'notice'" in line
    machine = _new_version(folder, ('    choice "revise" -> draft\n', ""))
    code, line = _check(folder, target, machine)
    assert code == 2 and line.endswith(
        "the decision it waits on (gate 0) offered approve, revise, reject and now offers approve, reject"
    )


def test_runs_migrate_classifies_every_parked_run_of_the_machine_and_moves_the_movable_ones(parked, store, server):
    folder, target = parked
    _park(folder, _target(store, "second"))
    machine = _new_version(folder, *RENAMED)
    listed = cli("runs", "migrate", "--store", store, "--machine", machine, "--dry-run", cwd=folder)
    assert listed.returncode == 1 and listed.stdout.splitlines() == [
        f"{run}: incompatible at frame 1: approval at draft: state 'draft' no longer exists in {folder / machine}"
        for run in ("parked", "second")
    ]
    args = ("runs", "migrate", "--store", store, "--machine", machine, "--map", "draft=compose")
    assert cli(*args, "--dry-run", cwd=folder).stdout.splitlines() == ["parked: migratable", "second: migratable"]
    assert _check(folder, target, "approval.mk") == (0, "compatible")  # a dry run changes nothing
    moved = cli(*args, cwd=folder)
    assert (moved.returncode, moved.stdout.splitlines()) == (0, ["parked: migratable", "second: migratable"])
    for run in ("parked", "second"):  # each resumes under the new version as it is, no --machine needed
        shown = json.loads(cli("show", _target(store, run), "--summary", "--format", "json", cwd=folder).stdout)
        assert shown["signature"]["seal"] == "signed"
        assert [(frame["state"]) for frame in shown["frames"]] == ["compose"]
        (entry,) = shown["lineage"]
        assert (entry["run_id"], entry["step"]) == (shown["run_id"], "1")  # parked on step 1's question
    text = cli("show", target, "--summary", "--format", "text", cwd=folder).stdout
    assert "migrated to a new machine version at step 1" in text and "forked" not in text
    done = cli("resume", target, *ANSWER, *HOST, "--format", "json", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert server.count == 2  # the two drafts: nothing paid again


def test_a_migrated_run_is_signed_and_a_tampered_migration_record_is_refused(tmp_path: Path, server):
    shutil.copy(APPROVAL, tmp_path / "approval.mk")
    (tmp_path / "v2").mkdir()
    (tmp_path / "tools.py").write_text("TOOLS = {'publish': lambda args: 'https://status.example.com/1'}\n")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    server.handler = _model
    _park(tmp_path, "cp.json")
    old_digest = json.loads((tmp_path / "cp.json").read_text())["machines"]["approval.mk"]
    machine = _new_version(tmp_path, *EDITED_PROMPT)
    assert cli("runs", "migrate", "--store", ".", "--machine", machine, cwd=tmp_path).stdout == "cp.json: compatible\n"
    envelope = json.loads((tmp_path / "cp.json").read_text())
    assert envelope["lineage"][-1]["machines"] == {"approval.mk": old_digest}
    assert envelope["machines"] == {"approval.mk": hashlib.sha256((tmp_path / machine).read_bytes()).hexdigest()}
    assert _check(tmp_path, "cp.json", machine) == (0, "compatible")  # it verifies: signed with this user's key
    for forged in ({"approval.mk": "0" * 64}, {}):  # claim another old version, or hide the migration
        tampered = {**envelope, "lineage": [{**envelope["lineage"][-1], "machines": forged}]}
        (tmp_path / "cp.json").write_text(json.dumps(tampered))
        refused(cli("resume", "cp.json", *ANSWER, *HOST, cwd=tmp_path), "signed")
    assert server.count == 1


def test_the_console_shows_a_parked_run_of_an_edited_machine_with_the_class_runs_migrate_gives(
    parked, store, server, monkeypatch
):
    """The run page of a run parked on a machine edited in place since: its class against the file
    as it is now, the very line `runs migrate --dry-run` prints for it (one classifier), each time."""
    pytest.importorskip("starlette", reason="the console extra is not installed")
    from markupsafe import escape
    from starlette.testclient import TestClient

    from mklang.console.web import Console, create_app
    from mklang.stores import open_store

    folder, _ = parked
    monkeypatch.chdir(folder)
    uri = str(folder / "runs") if store == "runs" else store
    text = APPROVAL.read_text()
    draft = text[text.index("state draft") : text.index("state publish")]
    versions = {
        "compatible": EDITED_PROMPT,
        "migratable": MOVED,
        "incompatible at frame 1: approval at draft: state 'draft' no longer exists": [
            (draft, ""),
            ("entry draft", "entry publish"),
        ],
    }
    opened = open_store(uri, create=False)
    try:
        with TestClient(create_app(Console(opened, uri, "t")), follow_redirects=False) as browser:
            assert browser.get("/?token=t").status_code == 303
            assert "Its machine changed" not in browser.get("/runs/parked").text  # as it parked: nothing to say
            for expected, edits in versions.items():
                _new_version(folder, *edits)
                shutil.copy(folder / "v2" / "approval.mk", folder / "approval.mk")  # edited in place
                listed = cli("runs", "migrate", "--store", uri, "--machine", "approval.mk", "--dry-run", cwd=folder)
                (line,) = listed.stdout.splitlines()
                assert line.startswith(f"parked: {expected}"), line
                page = browser.get("/runs/parked").text
                assert "Its machine changed since it parked" in page, expected
                assert f"<strong>{escape(line.removeprefix('parked: '))}</strong>" in page
                shutil.copy(APPROVAL, folder / "approval.mk")
    finally:
        opened.close()
    assert server.count == 1  # classifying pays nothing
    shown = json.loads(cli("show", _target(store, "parked"), "--summary", "--format", "json", cwd=folder).stdout)
    assert (shown["status"], shown["lineage"]) == ("suspended", [])  # and moves nothing


SELF_CONSISTENCY = ROOT / "examples" / "self-consistency"
SCENARIO = ("--script", "scenarios.yaml", "--scenario", "majority-agrees")


def test_a_run_with_fan_out_and_a_repair_gate_is_compatible_with_its_prompt_edited_and_keeps_its_step(
    tmp_path: Path,
):
    """Five samples charge five calls to one step, and `solve`'s gate keeps a repair count: the
    migration records the loop-top (step 2, not the calls made), and a repair count read back from
    the envelope compares equal to the new machine's, so the run is compatible, not migratable."""
    for name in ("word_problem.mk", "scenarios.yaml"):
        shutil.copy(SELF_CONSISTENCY / name, tmp_path / name)
    parked = cli("run", "word_problem.mk", *SCENARIO, "--checkpoint", "cp.json", "--max-tokens", "500", cwd=tmp_path)
    assert parked.returncode == 3, parked.stderr
    text = (tmp_path / "word_problem.mk").read_text()
    assert "Keep the answer most attempts reached." in text
    (tmp_path / "v2.mk").write_text(text.replace("Keep the answer most attempts reached.", "Keep the majority answer."))
    moved = cli("runs", "migrate", "--store", ".", "--machine", "v2.mk", cwd=tmp_path)
    assert (moved.returncode, moved.stdout) == (0, "cp.json: compatible\n"), moved.stderr
    shown = json.loads(cli("show", "cp.json", "--summary", "--format", "json", cwd=tmp_path).stdout)
    (entry,) = shown["lineage"]
    assert (entry["run_id"], entry["step"]) == (shown["run_id"], "2")
    done = cli("resume", "cp.json", *SCENARIO, "--max-tokens", "1000", "--format", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["result"] == {"answer": 42, "expression": "6 * 7"}
    assert [step["state"] for step in result["trace"]] == ["solve", "vote", "verify"]
