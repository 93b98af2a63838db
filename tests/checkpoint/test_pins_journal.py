"""Pins for the run journal, checkpoint signatures and old-format checkpoints.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import mk, write_machines
from support.runs import TWO_STATES

from mklang.checkpoint.compat import first_misfit, frame_shape_error, rebuild
from mklang.checkpoint.envelope import Envelope, MachineRef, load, save
from mklang.checkpoint.journal import (
    DURABILITY_VARIABLE,
    StoreJournal,
    durability_setting,
    read_journal,
    recover,
    resume_change,
)
from mklang.checkpoint.paths import MachinePaths
from mklang.checkpoint.signing import (
    KEY_VARIABLE,
    SEAL_TEXT,
    canonical,
    check_lines,
    checkpoint_key,
    key_file,
    key_id,
    seal_of,
    sign,
    sign_line,
    signed_as_written,
)
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError, UsageError
from mklang.providers.base import Produced, Usage
from mklang.stores import locate

# --- compat: does a recorded frame chain fit the machines loaded now ----------

PARENT = """
    machine parent
    entry pick
    budget 9
    context {{ xs: [1, 2] }}
    state pick {{
      structure "s"
      prompt "p"
      output o
      when "bad" repair 2 -> pick
      when "worse" repair 1 -> pick
      otherwise -> each
    }}
    state each {{
      {each}
      output o
      otherwise -> sub
    }}
    state sub {{
      call child
      output c
      otherwise -> END
    }}
"""

CHILD = """
    machine child
    entry t
    budget 3
    state t {
      structure "s"
      prompt "p"
      output o
      otherwise -> END
    }
"""


def _chain(tmp_path, each: str = 'sample 3\n      structure "s"\n      prompt "p"') -> list[Frame]:
    """A parent paused at its call state `sub`, and the child level it started."""
    parent = write_machines(tmp_path, PARENT.format(each=each), CHILD)
    child = write_machines(tmp_path, CHILD)
    top = Frame.start(parent)
    top.state = "sub"
    return [top, Frame.start(child)]


def test_a_chain_that_fits_its_machines_has_no_misfit_even_with_a_finished_innermost_level(tmp_path):
    chain = _chain(tmp_path)
    assert first_misfit(chain) is None
    chain[1].state = "END"
    assert first_misfit(chain) is None  # the parent completes the call on resume
    chain[0].repair_left[("pick", 0)] = 0
    chain[0].repair_left[("pick", 1)] = 1  # a counter anywhere in 0..repair fits
    assert first_misfit(chain) is None


def test_a_misfit_names_the_frame_by_depth_machine_and_state(tmp_path):
    chain = _chain(tmp_path)
    chain[1].state = "gone"
    path = tmp_path / "child.mk"
    assert first_misfit(chain) == f"frame 2 (child at gone): state 'gone' no longer exists in {path}"
    chain[1].state = "t"
    chain[0].state = "gone"
    assert first_misfit(chain) == f"frame 1 (parent at gone): state 'gone' no longer exists in {tmp_path / 'parent.mk'}"


def test_a_machine_without_a_file_is_named_by_its_name_in_a_misfit():
    frame = Frame.start(mk(CHILD))
    frame.state = "gone"
    assert first_misfit([frame]) == "frame 1 (child at gone): state 'gone' no longer exists in child"


def test_a_level_that_reached_end_with_a_deeper_frame_after_it_does_not_fit(tmp_path):
    chain = _chain(tmp_path)
    chain[0].state = "END"
    assert first_misfit(chain) == "frame 1 (parent at END): a sub-machine frame follows a level that reached END"


def test_visits_of_a_state_that_is_gone_name_the_first_such_state(tmp_path):
    chain = _chain(tmp_path)
    chain[1].visits = {"t": 1, "zeta": 1, "beta": 2}
    assert first_misfit(chain) == (
        f"frame 2 (child at t): visits state 'beta', which no longer exists in {tmp_path / 'child.mk'}"
    )


def test_repair_counters_must_match_the_repair_gates_and_stay_within_their_budget(tmp_path):
    where = f"in {tmp_path / 'parent.mk'}"
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 2)] = 0
    assert first_misfit(chain) == (
        f"frame 1 (parent at sub): repair counter of gate 2 of 'pick', which is not a repair gate {where}"
    )
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 0)] = 3
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 3 of gate 0 of 'pick' is outside 0..2"
    chain[0].repair_left[("pick", 0)] = -1
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter -1 of gate 0 of 'pick' is outside 0..2"
    chain[0].repair_left[("pick", 0)] = 2
    chain[0].repair_left[("pick", 1)] = 2
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 2 of gate 1 of 'pick' is outside 0..1"
    chain = _chain(tmp_path)
    del chain[0].repair_left[("pick", 0)]
    del chain[0].repair_left[("pick", 1)]
    assert first_misfit(chain) == f"frame 1 (parent at sub): no repair counter for gate 0 of 'pick' {where}"
    chain = _chain(tmp_path)
    del chain[0].repair_left[("pick", 1)]
    assert first_misfit(chain) == f"frame 1 (parent at sub): no repair counter for gate 1 of 'pick' {where}"


def test_the_first_repair_counter_in_gate_order_is_the_one_reported(tmp_path):
    chain = _chain(tmp_path)
    chain[0].repair_left = {("pick", 1): 5, ("pick", 0): 5}
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 5 of gate 0 of 'pick' is outside 0..2"


def test_a_repair_counter_of_a_plain_gate_is_not_a_repair_gate(tmp_path):
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 2)] = 0  # `otherwise -> each` is gate 2 and does not repair
    assert "which is not a repair gate" in (first_misfit(chain) or "")
    chain = _chain(tmp_path)
    chain[0].repair_left[("each", 0)] = 0
    assert "repair counter of gate 0 of 'each', which is not a repair gate" in (first_misfit(chain) or "")


def test_kept_fan_out_branches_need_a_fan_out_state_and_a_sample_index_within_it(tmp_path):
    chain = _chain(tmp_path)
    chain = chain[:1]
    chain[0].state = "each"
    branch = {"output": "x", "usage": {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}}
    chain[0].branches = {0: branch, 2: branch}
    assert first_misfit(chain) is None
    chain[0].branches = {3: branch}
    assert first_misfit(chain) == "frame 1 (parent at each): holds a fan-out branch outside the 3 samples of 'each'"
    chain[0].branches = {-1: branch}
    assert first_misfit(chain) == "frame 1 (parent at each): holds a fan-out branch outside the 3 samples of 'each'"
    chain[0].state = "pick"
    chain[0].branches = {0: branch}
    assert first_misfit(chain) == (
        f"frame 1 (parent at pick): holds finished fan-out branches, but 'pick' does not fan out "
        f"in {tmp_path / 'parent.mk'}"
    )


def test_branches_of_a_fan_out_over_a_list_are_not_bounded_by_a_sample_count(tmp_path):
    [top, _] = _chain(tmp_path, each='over xs\n      structure "s"\n      prompt "p"')
    top.state = "each"
    top.branches = {7: {"output": "x", "usage": {}}}
    assert first_misfit([top]) is None


def test_a_deeper_frame_hangs_only_off_a_plain_call_to_its_machine(tmp_path):
    chain = _chain(tmp_path)
    chain[0].state = "pick"
    assert first_misfit(chain) == (
        f"frame 1 (parent at pick): a sub-machine frame follows, but 'pick' is not a call state "
        f"in {tmp_path / 'parent.mk'}"
    )
    chain = _chain(tmp_path, each="over xs\n      call child")
    chain[0].state = "each"
    assert first_misfit(chain) == (
        "frame 1 (parent at each): a sub-machine frame follows, but 'each' fans out (fan-out branches never suspend)"
    )
    chain = _chain(tmp_path)
    other = write_machines(tmp_path, CHILD.replace("machine child", "machine other"))
    chain[1] = Frame.start(other)
    assert first_misfit(chain) == "frame 1 (parent at sub): calls 'child', but the next frame runs 'other'"


# --- compat: the shape of a recorded frame -------------------------------------


def _recorded() -> dict[str, Any]:
    return {**Frame.start(mk(CHILD)).to_json(), "path": "child.mk"}


def test_a_recorded_frame_of_the_right_shape_has_no_shape_error():
    assert frame_shape_error(_recorded()) is None


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ([], "a frame must be a JSON object, not list"),
        ("x", "a frame must be a JSON object, not str"),
        ({**_recorded(), "steps": -1}, "field steps: Input should be greater than or equal to 0"),
        ({**_recorded(), "usage": {"input_tokens": 2}}, "field usage.output_tokens: Field required"),
        ({**_recorded(), "path": None}, "field path: names no machine file to run"),
        ({**_recorded(), "sha256": "abc", "surprise": 1}, "field surprise: Extra inputs are not permitted"),
        ({**_recorded(), "repair_left": [["a", 0]]}, "field repair_left.0.2: Field required"),
    ],
)
def test_a_malformed_recorded_frame_says_which_field_and_why(frame, message):
    assert frame_shape_error(frame) == message


def test_a_frame_the_model_lets_through_but_cannot_rebuild_is_one_checkpoint_error():
    machine = mk(CHILD)
    assert rebuild(_recorded(), machine, "cp.json").state == "t"
    with pytest.raises(CheckpointError) as caught:
        rebuild({"machine": "child"}, machine, "cp.json")
    assert str(caught.value) == "cp.json: malformed frame: KeyError: 'state'"
    negative = {**_recorded(), "usage": {"input_tokens": -2, "output_tokens": 0, "cost_usd": 0.0}}
    with pytest.raises(CheckpointError) as caught:  # spend numbers are `Usage.from_json`'s to check
        rebuild(negative, machine, "cp.json")
    assert str(caught.value) == (
        "cp.json: malformed frame: ValueError: usage input_tokens is -2, not a count from 0 to 1,000,000,000,000,000"
    )


# --- signing: where the checkpoint key comes from -----------------------------


@pytest.fixture
def config_home(tmp_path, monkeypatch) -> Path:
    """A fresh config folder of this user's, and no fleet key in the environment."""
    home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    return home


def test_the_fleet_key_in_the_environment_wins_over_the_key_file(config_home, monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, "fleet clé shared by every worker of it")
    assert checkpoint_key() == "fleet clé shared by every worker of it".encode()
    assert not config_home.exists()  # no key file is made when the fleet key is set
    monkeypatch.setenv(KEY_VARIABLE, "")
    assert checkpoint_key() == (config_home / "mklang" / "checkpoint.key").read_bytes().strip()


def test_the_key_file_lives_under_xdg_config_home_else_under_dot_config_in_home(config_home, tmp_path, monkeypatch):
    assert key_file() == config_home / "mklang" / "checkpoint.key"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.setenv("XDG_CONFIG_HOME", ""), lambda: monkeypatch.delenv("XDG_CONFIG_HOME")):
        unset()
        assert key_file() == tmp_path / "home" / ".config" / "mklang" / "checkpoint.key"


def test_the_first_use_creates_an_owner_only_random_key_file_and_later_uses_read_it(config_home):
    key = checkpoint_key()
    path = config_home / "mklang" / "checkpoint.key"
    assert path.read_bytes() == key + b"\n"
    assert len(key) == 64 and all(c in b"0123456789abcdef" for c in key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]  # no temp file left
    assert checkpoint_key() == key
    path.write_bytes(b"  my own key \n\n")
    assert checkpoint_key() == b"my own key"


def test_a_key_file_another_process_created_first_is_the_one_used(config_home, monkeypatch):
    path = config_home / "mklang" / "checkpoint.key"
    link = os.link

    def racing_link(source: Any, target: Any) -> None:
        Path(target).write_bytes(b"theirs\n")  # the other process won the race
        Path(target).chmod(0o600)
        link(source, target)

    monkeypatch.setattr(os, "link", racing_link)
    assert checkpoint_key() == b"theirs"
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]


def test_an_empty_key_file_is_refused_rather_than_signing_with_no_key(config_home):
    path = config_home / "mklang" / "checkpoint.key"
    path.parent.mkdir(parents=True)
    path.write_bytes(b" \n")
    path.chmod(0o600)
    with pytest.raises(CheckpointError) as caught:
        checkpoint_key()
    assert str(caught.value) == f"{path}: the checkpoint key file is empty"


def test_a_key_file_that_is_a_symbolic_link_is_not_followed(config_home, tmp_path):
    path = config_home / "mklang" / "checkpoint.key"
    path.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").write_bytes(b"planted key\n")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as caught:
        checkpoint_key()
    assert str(caught.value) == f"{path}: cannot read or create the checkpoint key: Too many levels of symbolic links"


def test_a_key_that_cannot_be_created_is_one_line_naming_the_file(config_home):
    config_home.write_text("a file where the config folder should be")
    with pytest.raises(CheckpointError) as caught:
        checkpoint_key()
    path = config_home / "mklang" / "checkpoint.key"
    assert str(caught.value) == f"{path}: cannot read or create the checkpoint key: Not a directory"


def test_a_temp_file_in_the_way_of_a_new_key_is_never_written_through(config_home, tmp_path):
    folder = config_home / "mklang"
    folder.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    (folder / f".checkpoint.key.{os.getpid()}.tmp").symlink_to(victim)  # the name once used: now unguessable
    assert len(checkpoint_key()) == 64
    assert victim.read_bytes() == b"precious\n"


# --- signing: envelope signatures ------------------------------------------------

KEY = b"the resuming user's key"


def test_a_key_is_named_by_a_stable_public_id_that_tells_keys_apart():
    assert key_id(b"k") == "91bce6165a8d19ab"  # files signed before keep their key's name
    assert key_id(b"fleet secret") == "0b290817bbf8c586"


def test_a_signature_covers_the_canonical_json_without_the_signature_itself():
    document = {"b": [1, 2.5, None], "a": "été", "signature": {"key_id": "x", "hmac": "y"}}
    assert canonical(document) == '{"a":"été","b":[1,2.5,null]}'.encode()
    signed, signature = sign(document, KEY)
    assert signature == {"key_id": key_id(KEY), "hmac": hmac.new(KEY, canonical(document), "sha256").hexdigest()}
    assert (
        signed
        == canonical(document)[:-1] + b',"signature":' + json.dumps(signature, separators=(",", ":")).encode() + b"}"
    )
    assert json.loads(signed) == {**document, "signature": signature}


def test_the_trace_context_is_written_before_the_signature_and_left_out_of_it():
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    document = {"status": "suspended", "trace": {"traceparent": traceparent}}
    signed, signature = sign(document, KEY)
    assert signature["hmac"] == hmac.new(KEY, b'{"status":"suspended"}', "sha256").hexdigest()
    assert signed == (
        b'{"status":"suspended","trace":{"traceparent":"'
        + traceparent.encode()
        + b'"},"signature":'
        + json.dumps(signature, separators=(",", ":")).encode()
        + b"}"
    )
    stored = json.loads(signed)
    assert seal_of(stored, KEY, signed) == "signed"
    assert seal_of(stored, KEY, json.dumps(stored, indent=2).encode()) == "signed"
    moved = signed.replace(b"-01", b"-00")  # an edited trace context moves the spans, nothing else
    assert seal_of(json.loads(moved), KEY, moved) == "signed"
    assert seal_of({**stored, "trace": None}, KEY) == "signed"
    assert seal_of({**stored, "status": "done"}, KEY) == "tampered"


@pytest.mark.parametrize("trace", [5, "00-x", {"traceparent": 1}, [], None])
def test_a_trace_context_that_is_not_a_map_of_texts_reads_as_none(trace):
    document = Envelope(
        mklang_version="t",
        run_id="r",
        status="running",
        machine=MachineRef(name="m", path=None, sha256=None),
        frames=[],
    ).model_dump(mode="json")
    assert Envelope.model_validate({**document, "trace": trace}).trace is None


def _signed(document: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    raw, signature = sign(document, KEY)
    return {**document, "signature": signature}, raw


def test_a_signed_document_reads_as_signed_as_written_and_in_any_other_layout():
    document, raw = _signed({"status": "suspended", "n": 1})
    assert seal_of(document, KEY, raw) == "signed"
    assert seal_of(document, KEY, raw + b"\n") == "signed"
    assert seal_of(document, KEY, json.dumps(document, indent=2).encode()) == "signed"
    assert seal_of(document, KEY) == "signed"


def test_bytes_laid_out_as_signed_are_checked_as_they_are():
    raw = b'{"n":1,"a":2}'  # not canonical: its keys are not sorted
    signature = {"key_id": key_id(KEY), "hmac": hmac.new(KEY, raw, "sha256").hexdigest()}
    signed = raw[:-1] + b',"signature":' + json.dumps(signature, separators=(",", ":")).encode() + b"}"
    assert seal_of(json.loads(signed), KEY, signed) == "signed"
    assert seal_of(json.loads(signed), KEY, signed.replace(b'"a":2', b'"a":3')) == "tampered"


def test_an_edited_document_is_tampered_whatever_its_layout():
    document, raw = _signed({"status": "suspended", "n": 1})
    edited = raw.replace(b'"n":1', b'"n":2')
    assert seal_of(json.loads(edited), KEY, edited) == "tampered"
    assert seal_of({**document, "n": 2}, KEY) == "tampered"
    assert seal_of({**document, "signature": {**document["signature"], "hmac": "0" * 64}}, KEY, raw) == "tampered"


@pytest.mark.parametrize("forged", ["é" + "0" * 63, "\ud800", "", "été"])
def test_a_signature_edited_into_any_text_is_tampered_not_an_internal_error(forged):
    document, raw = _signed({"n": 1})
    edited = {**document, "signature": {**document["signature"], "hmac": forged}}
    assert seal_of(edited, KEY, json.dumps(edited).encode()) == "tampered"
    laid_out_as_signed = raw.replace(document["signature"]["hmac"].encode(), json.dumps(forged)[1:-1].encode())
    assert seal_of(json.loads(laid_out_as_signed), KEY, laid_out_as_signed) == "tampered"


def test_a_checkpoint_whose_signature_was_edited_into_non_ascii_text_loads_as_tampered(tmp_path):
    path = tmp_path / "cp.json"
    machine = MachineRef(name="m", path=None, sha256=None)
    save(path, Envelope(mklang_version="t", run_id="r", status="running", machine=machine, frames=[]))
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["signature"]["hmac"] = "é" * 64
    path.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
    assert load(path).seal == "tampered"


@pytest.mark.parametrize("signature", [None, "abc", [], {"key_id": "x"}, {"key_id": "x", "hmac": 5}, {"hmac": None}])
def test_a_document_without_a_signature_of_the_right_shape_is_unsigned(signature):
    document = {"n": 1} if signature is None else {"n": 1, "signature": signature}
    assert seal_of(document, KEY, json.dumps(document).encode()) == "unsigned"


def test_a_document_signed_with_another_key_is_foreign_not_tampered():
    document, raw = _signed({"n": 1})
    assert seal_of(document, b"another key", raw) == "foreign"
    edited = {**document, "n": 2}
    assert seal_of(edited, b"another key") == "foreign"
    assert seal_of({"n": 1, "signature": {"hmac": document["signature"]["hmac"]}}, KEY, raw) == "foreign"


def test_each_seal_reads_as_its_sentence():
    assert SEAL_TEXT == {
        "signed": "signed with your checkpoint key",
        "unsigned": "not signed",
        "foreign": "signed with another checkpoint key",
        "tampered": "edited after it was signed with your checkpoint key",
    }


# --- signing: the chained MACs of journal lines ------------------------------------


def _lines(*bodies: bytes, previous: str = "envelope mac", key: bytes = KEY) -> list[bytes]:
    """Journal lines as read back (no newline), each chained to the one before."""
    lines = []
    for body in bodies:
        line, previous = sign_line(body, previous, key)
        assert line.endswith(b"\n")
        lines.append(line[:-1])
    return lines


BODIES = (b'{"k":"gen","g":1}', b'{"k":"call","v":"paid"}', b'{"k":"step","d":0}')


def test_journal_lines_signed_in_a_chain_check_out_and_carry_their_mac_last():
    lines = _lines(*BODIES)
    assert check_lines(lines, "envelope mac", KEY) is None
    assert check_lines([], "envelope mac", KEY) is None
    first, mac = sign_line(BODIES[0], "envelope mac", KEY)
    assert first == b'{"k":"gen","g":1,"h":"' + mac.encode() + b'"}\n'
    assert json.loads(first)["h"] == mac and len(mac) == 64


def test_a_journal_line_edited_reordered_or_dropped_is_found_by_its_index():
    lines = _lines(*BODIES)
    edited = [lines[0], lines[1].replace(b"paid", b"free"), lines[2]]
    assert check_lines(edited, "envelope mac", KEY) == 1
    assert check_lines([lines[0], lines[2], lines[1]], "envelope mac", KEY) == 1
    assert check_lines([lines[0], lines[2]], "envelope mac", KEY) == 1
    assert check_lines(lines[1:], "envelope mac", KEY) == 0


def test_journal_lines_cannot_move_to_another_checkpoint_or_key():
    lines = _lines(*BODIES)
    assert check_lines(lines, "another envelope's mac", KEY) == 0
    assert check_lines(lines, "envelope mac", b"another key") == 0


@pytest.mark.parametrize(
    "bad",
    [
        b'{"k":"step"}',  # no MAC at all
        b'{"k":"step","x":"' + b"0" * 64 + b'"}',  # a MAC-sized tail that is not one
        b'{"k":"step","h":"' + b"0" * 64 + b'"}',  # a forged MAC
        b"",
    ],
)
def test_a_journal_line_without_its_mac_is_refused(bad):
    lines = _lines(*BODIES)
    assert check_lines([*lines[:2], bad, lines[2]], "envelope mac", KEY) == 2


@pytest.mark.parametrize("forged", ["é".encode(), b"\xff", b"\xff\xfe"])
def test_a_journal_mac_edited_into_any_bytes_is_refused_not_an_internal_error(forged):
    lines = _lines(*BODIES)
    mac = json.loads(lines[1])["h"].encode()
    edited = lines[1].replace(mac, forged + mac[len(forged) :])
    assert len(edited) == len(lines[1])
    assert check_lines([lines[0], edited, lines[2]], "envelope mac", KEY) == 1


def test_a_line_that_is_only_a_mac_is_refused_even_with_the_right_mac():
    mac = hmac.new(KEY, b"envelope mac\n}", "sha256").hexdigest()
    assert check_lines([b',"h":"' + mac.encode() + b'"}'], "envelope mac", KEY) == 0


# --- journal: what a run's journal holds, line by line ------------------------------


def _run_journal(tmp_path: Path, **options: Any) -> tuple[StoreJournal, Frame]:
    """A journal of a run of `proj/m.mk` (hashed "abc") checkpointed to `cp.json`, and its first frame."""
    (tmp_path / "proj").mkdir(exist_ok=True)
    machine = write_machines(tmp_path / "proj", TWO_STATES)
    envelope = Envelope(
        mklang_version="test",
        run_id="r",
        status="running",
        machine=MachineRef(name="m", path=None, sha256="abc"),
        frames=[],
    )
    options.setdefault("hashes", {str(machine.path): "abc"})
    options.setdefault("paths", MachinePaths(machine.path))
    return StoreJournal(locate(tmp_path / "cp.json"), envelope, **options), Frame.start(machine)


def _journal_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "cp.json.journal").read_bytes().splitlines()]


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    """The journal's records after its header, each line's chained MAC checked against the envelope."""
    envelope = load(tmp_path / "cp.json")
    assert envelope.signature is not None
    return read_journal(locate(tmp_path / "cp.json"), envelope.generation, chain_from=envelope.signature.hmac)


def _step(state: str, to: str | None, output: Any, tokens: int = 0) -> Any:
    usage = {"input_tokens": tokens, "output_tokens": 0, "cost_usd": 0.0}
    return {"step": {"state": state, "to": to, "output": output, "usage": usage}, "charge": 1}


def test_a_snapshot_writes_a_signed_envelope_of_the_next_generation_and_a_journal_chained_to_it(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert (envelope.seal, envelope.status, envelope.generation) == ("signed", "running", 1)
    # The root is named relative to the checkpoint's folder, every machine file relative to the root's.
    assert (envelope.machine.path, envelope.machines) == ("proj/m.mk", {"m.mk": "abc"})
    assert [f["path"] for f in envelope.frames] == ["m.mk"]
    assert [{k: v for k, v in line.items() if k != "h"} for line in _journal_lines(tmp_path)] == [{"k": "gen", "g": 1}]
    assert _records(tmp_path) == []
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").generation == 2
    assert _journal_lines(tmp_path)[0]["g"] == 2
    assert _records(tmp_path) == []


def test_a_snapshot_and_a_compaction_record_the_run_as_running_whatever_envelope_it_continues(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.envelope = journal.envelope.model_copy(update={"status": "suspended", "reason": "escalated"})
    journal.snapshot([frame], status="running", reason=None)
    assert (load(tmp_path / "cp.json").status, load(tmp_path / "cp.json").reason) == ("running", None)
    journal.envelope = journal.envelope.model_copy(update={"status": "suspended"})
    _grow(journal, tmp_path, COMPACT)
    journal.loop_top([frame])
    assert (load(tmp_path / "cp.json").status, load(tmp_path / "cp.json").generation) == ("running", 2)


def test_each_line_of_a_run_is_journaled_with_its_level_and_chained_to_the_last(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "produce", Produced("one", None, Usage(2, 1)))
    journal.step(0, _step("a", "b", "one"))
    journal.enter(1, frame)
    journal.halt(1, "gate-fail", Usage(3, 4, 0.5))
    records = _records(tmp_path)
    assert [{k: v for k, v in r.items() if k != "h"} for r in records] == [
        {
            "k": "call",
            "key": "r:1.0",
            "kind": "produce",
            "v": {"text": "one", "reasoning": None, "usage": Usage(2, 1).to_json()},
        },
        {"k": "step", "d": 0, "r": _step("a", "b", "one")},
        {"k": "enter", "d": 1, "f": {**frame.to_json(), "path": "m.mk", "sha256": "abc"}},
        {"k": "halt", "d": 1, "e": "gate-fail", "u": {"input_tokens": 3, "output_tokens": 4, "cost_usd": 0.5}},
    ]


class Counted:
    """A host state that counts the times it was saved."""

    def __init__(self) -> None:
        self.saves = 0

    def save(self) -> dict[str, Any]:
        self.saves += 1
        return {"saves": self.saves}

    def restore(self, saved: dict[str, Any]) -> None:
        self.saves = saved["saves"]


def test_every_line_and_envelope_carries_the_host_state_as_of_it_when_the_run_has_one(tmp_path):
    journal, frame = _run_journal(tmp_path, host_state=Counted())
    journal.snapshot([frame], status="running")
    journal.record("r:1.0.1", "tool", "t")
    journal.step(0, _step("a", "b", "one"))
    journal.halt(0, "gate-fail", Usage())
    assert load(tmp_path / "cp.json").host.state == {"saves": 1}
    assert [record["s"] for record in _records(tmp_path)] == [{"saves": 2}, {"saves": 3}, {"saves": 4}]
    (tmp_path / "plain").mkdir()
    plain, frame = _run_journal(tmp_path / "plain")
    plain.snapshot([frame], status="running")
    plain.step(0, _step("a", "b", "one"))
    assert "s" not in _records(tmp_path / "plain")[0]
    assert load(tmp_path / "plain" / "cp.json").host.state is None


def test_recovery_gives_back_the_host_state_of_the_last_line_that_holds_one(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    call = {"k": "call", "key": "r:1.0.1", "kind": "tool", "v": "t"}
    step = {"k": "step", "d": 0, "r": _step("a", "b", "one")}
    records = [{**call, "s": {"n": 1}}, {**step, "s": {"n": 2}}, {**call, "key": "r:2.0.1", "s": {"n": 3}}]
    assert recover([Frame.start(machine)], {}, records, lambda _: machine)[2] == {"n": 3}
    # Journals written before lines carried the state: the step lines carry it as `p`.
    earlier = [{**step, "p": {"llm": {"produce": 1}}}, {**call, "key": "r:2.0.1"}]
    assert recover([Frame.start(machine)], {}, earlier, lambda _: machine)[2] == {"llm": {"produce": 1}}
    assert recover([Frame.start(machine)], {}, [], lambda _: machine)[2] is None


class JournalFsyncs:
    """Records the kind of the journal's last line at each fsync of the journal file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, journal: Path):
        self.kinds: list[str] = []
        self._journal, self._fsync = journal, os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, descriptor: int) -> None:
        if os.readlink(f"/proc/self/fd/{descriptor}") == str(self._journal):
            self.kinds.append(json.loads(self._journal.read_bytes().splitlines()[-1])["k"])
        self._fsync(descriptor)


@pytest.mark.parametrize(("durability", "synced"), [("call", ["call", "call"]), ("step", ["step", "halt"])])
def test_durability_call_fsyncs_each_call_line_and_durability_step_each_step_and_halt_line(
    tmp_path, monkeypatch, durability, synced
):
    journal, frame = _run_journal(tmp_path, durability=durability)
    journal.snapshot([frame], status="running")
    spy = JournalFsyncs(monkeypatch, tmp_path / "cp.json.journal")
    journal.record("r:1.0", "produce", Produced("one", None, Usage()))
    journal.step(0, _step("a", "b", "one"))
    journal.enter(1, frame)
    journal.record("r:2.0", "tool", "text")
    journal.halt(1, "gate-fail", Usage())
    assert spy.kinds == synced


@pytest.mark.parametrize(("value", "durability"), [(None, "call"), ("call", "call"), ("step", "step")])
def test_the_durability_comes_from_mklang_durability_and_defaults_to_call(monkeypatch, value, durability):
    if value is None:
        monkeypatch.delenv(DURABILITY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(DURABILITY_VARIABLE, value)
    assert durability_setting() == durability


@pytest.mark.parametrize("value", ["", "Step", "fsync"])
def test_an_unknown_durability_is_a_usage_error_naming_the_choices(monkeypatch, value):
    monkeypatch.setenv(DURABILITY_VARIABLE, value)
    with pytest.raises(UsageError) as caught:
        durability_setting()
    assert str(caught.value) == f"MKLANG_DURABILITY must be call or step, not {value!r}"


# --- journal: answers paid by an earlier process ------------------------------------


def _paid(text: str, tokens: int) -> dict[str, Any]:
    return {"kind": "produce", "v": {"text": text, "reasoning": None, "usage": Usage(tokens, 1).to_json()}}


def test_a_replayed_answer_is_used_once_and_only_for_its_own_kind(tmp_path):
    replay = {"k1": _paid("one", 2), "k2": {"kind": "tool", "v": "text"}, "k3": {**_paid("c", 1), "consumed": True}}
    journal, _ = _run_journal(tmp_path, answers=replay)
    assert journal.replay("k1", "produce") == Produced("one", None, Usage(2, 1))
    assert journal.replay("k1", "produce") is None  # used once
    assert journal.replay("k2", "produce") is None  # recorded for another kind of call
    assert journal.replay("k2", "tool") is None  # ... and not used by another call either
    journal.answers["k4"] = {"kind": "tool", "v": "text"}
    assert journal.replay("k4", "tool") == "text"
    assert journal.replay("missing", "tool") is None
    assert journal.replay("k3", "produce") == Produced("c", None, Usage(1, 1))  # marked by an earlier version
    empty, _ = _run_journal(tmp_path)
    assert empty.replay("k1", "tool") is None


def test_an_answer_kept_under_a_key_of_an_earlier_version_answers_the_same_call(tmp_path):
    """Keys did not name a fan-out's branch count before: `r:3.2.1` is now `r:3.2of4.1`."""
    replay = {"r:3.2.1": {"kind": "tool", "v": "kept"}, "r:3.1/:1.0.1": _paid("below", 1)}
    journal, _ = _run_journal(tmp_path, answers=replay)
    assert journal.replay("r:3.2of4.1", "tool") == "kept"
    assert journal.replay("r:3.1of4/:1.0.1", "produce") == Produced("below", None, Usage(1, 1))
    assert journal.answers == {}


def test_a_snapshot_keeps_the_unreplayed_answers_and_counts_their_spend(tmp_path):
    replay = {"k1": _paid("one", 2), "k2": {"kind": "tool", "v": "text"}, "k3": _paid("three", 5)}
    journal, frame = _run_journal(tmp_path, answers=replay)
    frame.usage = Usage(10, 10, 1.0)
    assert journal.unreplayed() == Usage(7, 2)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert envelope.answers == replay
    assert envelope.usage == {"input_tokens": 17, "output_tokens": 12, "cost_usd": 1.0}
    journal.replay("k3", "produce")
    assert journal.unreplayed() == Usage(2, 1)


def test_a_step_or_halt_folds_the_answers_of_its_step_so_they_are_not_kept_again(tmp_path):
    journal, frame = _run_journal(tmp_path, answers={"k1": _paid("one", 2), "k2": _paid("two", 3)})
    journal.snapshot([frame], status="running")
    journal.replay("k1", "produce")
    journal.record("k4", "tool", "t")
    journal.step(0, _step("a", "b", "one"))
    assert journal.unreplayed() == Usage()
    journal.finish([frame], status="suspended")
    assert load(tmp_path / "cp.json").answers == {}
    journal, frame = _run_journal(tmp_path, answers={"k1": _paid("one", 2)})
    journal.snapshot([frame], status="running")
    journal.record("k4", "tool", "t")
    journal.halt(0, "gate-fail", Usage())
    journal.finish([frame], status="suspended")
    assert (load(tmp_path / "cp.json").answers, journal.unreplayed()) == ({}, Usage())


def test_a_suspended_envelope_keeps_the_answers_of_the_step_in_flight(tmp_path):
    replay = {"old": _paid("old", 1), "used": _paid("used", 2)}
    journal, frame = _run_journal(tmp_path, answers=replay)
    journal.snapshot([frame], status="running")
    journal.replay("used", "produce")
    journal.record("r:1.0#0/x", "tool", "paid")
    journal.finish([frame], status="suspended", reason="budget-exhausted")
    envelope = load(tmp_path / "cp.json")
    assert envelope.answers == {
        "old": _paid("old", 1),
        "used": _paid("used", 2),
        "r:1.0#0/x": {"kind": "tool", "v": "paid"},
    }
    assert (envelope.status, envelope.reason, envelope.generation, envelope.seal) == (
        "suspended",
        "budget-exhausted",
        2,
        "signed",
    )
    assert not (tmp_path / "cp.json.journal").exists()


@pytest.mark.parametrize("status", ["done", "halted"])
def test_a_finished_envelope_keeps_no_answers_and_no_journal(tmp_path, status):
    journal, frame = _run_journal(tmp_path, answers={"old": _paid("old", 1)})
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "tool", "paid")
    journal.finish([frame], status=status)
    envelope = load(tmp_path / "cp.json")
    assert (envelope.status, envelope.answers, envelope.generation) == (status, {}, 2)
    assert [f["path"] for f in envelope.frames] == ["m.mk"]
    assert (envelope.machine.path, envelope.machines) == ("proj/m.mk", {"m.mk": "abc"})
    assert not (tmp_path / "cp.json.journal").exists()


def test_a_finished_fan_out_branch_folds_only_its_own_answers(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    for key in ("r:1.0#1.0", "r:1.0#1/c:1.0", "r:1.0#1", "r:1.0#10.0", "r:1.0#2.0"):
        journal.record(key, "tool", key)
    journal.fold("r:1.0#1")
    journal.finish([frame], status="suspended")
    assert sorted(load(tmp_path / "cp.json").answers) == ["r:1.0#1", "r:1.0#10.0", "r:1.0#2.0"]


# --- journal: compaction -------------------------------------------------------------

COMPACT = 256 * 1024  # a journal is rewritten into a new envelope once it holds this much, or the envelope's size


def _grow(journal: StoreJournal, tmp_path: Path, size: int) -> None:
    """Journal call lines until the lines after the header add up to exactly `size` bytes."""
    header = len((tmp_path / "cp.json.journal").read_bytes())
    empty = len(b'{"k":"call","key":"k","kind":"tool","v":"","h":""}\n') + 64
    journal.record("k", "tool", "x" * (size - empty))
    assert len((tmp_path / "cp.json.journal").read_bytes()) - header == size


@pytest.mark.parametrize(("size", "compacted"), [(COMPACT - 1, False), (COMPACT, True)])
def test_a_journal_is_compacted_into_a_new_envelope_once_it_holds_256_kib(tmp_path, size, compacted):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    _grow(journal, tmp_path, size)
    journal.loop_top([frame])
    envelope = load(tmp_path / "cp.json")
    assert (envelope.generation, envelope.status) == ((2, "running") if compacted else (1, "running"))
    journal.loop_top([frame])  # a fresh generation starts counting again
    assert load(tmp_path / "cp.json").generation == envelope.generation


def test_a_journal_grows_as_large_as_a_large_envelope_before_it_is_compacted(tmp_path):
    journal, frame = _run_journal(tmp_path)
    frame.context["big"] = "y" * COMPACT
    journal.snapshot([frame], status="running")
    size = (tmp_path / "cp.json").stat().st_size
    _grow(journal, tmp_path, size - 1)
    journal.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == 1
    journal.record("k2", "tool", "z")
    journal.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == 2


def test_a_resumed_envelope_is_compacted_only_once_the_journal_is_as_large_as_it(tmp_path):
    journal, frame = _run_journal(tmp_path)
    frame.context["big"] = "y" * COMPACT
    journal.finish([frame], status="suspended")
    envelope = load(tmp_path / "cp.json")
    resumed, _ = _run_journal(tmp_path)
    resumed.envelope = envelope
    resumed.resume({"set": {}}, envelope.stored_bytes)
    _grow(resumed, tmp_path, envelope.stored_bytes - 1)
    resumed.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == envelope.generation
    resumed.record("k2", "tool", "z")
    resumed.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == envelope.generation + 1


# --- journal: reading it back after a crash -------------------------------------------


def _journaled(tmp_path: Path) -> tuple[StoreJournal, Frame, Path]:
    """A snapshot and three journal lines: a call, a step, a call."""
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "tool", "first")
    journal.step(0, _step("a", "b", "one"))
    journal.record("r:2.0", "tool", "second")
    return journal, frame, tmp_path / "cp.json.journal"


def test_a_journal_line_cut_mid_way_is_ignored_on_recovery(tmp_path):
    _, _, path = _journaled(tmp_path)
    whole = path.read_bytes()
    assert [r["k"] for r in _records(tmp_path)] == ["call", "step", "call"]
    path.write_bytes(whole[:-1])  # the last newline never reached the file
    assert [r["k"] for r in _records(tmp_path)] == ["call", "step"]
    path.write_bytes(whole[: whole.index(b"\n") + 1] + b'{"k":"call","key":"r:1.0","kind":"to')
    assert _records(tmp_path) == []


@pytest.mark.parametrize("damage", [b"not json\n", b"[1, 2]\n", b'"text"\n'])
def test_the_journal_is_read_up_to_the_first_line_that_is_not_a_record(tmp_path, damage):
    _, _, path = _journaled(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:2], damage, *lines[2:]]))
    location = locate(tmp_path / "cp.json")
    assert [r["k"] for r in read_journal(location, 1)] == ["call"]


def test_a_journal_line_may_nest_values_as_deep_as_a_checkpoint(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    deep: Any = "leaf"
    for _ in range(64 + 10):
        deep = [deep]
    journal.record("r:1.0", "tool", deep)
    assert [r["v"] for r in _records(tmp_path)] == [deep]


def test_a_journal_of_another_generation_or_without_its_header_is_stale(tmp_path):
    _, _, path = _journaled(tmp_path)
    location = locate(tmp_path / "cp.json")
    assert [r["k"] for r in read_journal(location, 1)] == ["call", "step", "call"]
    assert read_journal(location, 0) == []
    assert read_journal(location, 2) == []
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[1:]))  # the header is gone
    assert read_journal(location, 1) == []
    path.write_bytes(b"")
    assert read_journal(location, 1) == []
    path.unlink()
    assert read_journal(location, 1) == []


def test_a_journal_line_edited_after_it_was_signed_is_refused_naming_its_line(tmp_path):
    _, _, path = _journaled(tmp_path)
    signature = load(tmp_path / "cp.json").signature
    assert signature is not None
    mac = signature.hmac
    location = locate(tmp_path / "cp.json")
    path.write_bytes(path.read_bytes().replace(b'"second"', b'"forged"'))
    with pytest.raises(CheckpointError) as caught:
        read_journal(location, 1, chain_from=mac)
    assert str(caught.value) == (
        f"{location}: journal line 4 was edited after it was signed (resume with --trust to use it as untrusted data)"
    )
    assert [r["v"] for r in read_journal(location, 1) if r["k"] == "call"] == ["first", "forged"]  # read as data


def test_a_journal_mac_edited_into_non_ascii_text_is_refused_as_an_edit(tmp_path):
    _, _, path = _journaled(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    mac = json.loads(lines[2])["h"].encode()
    lines[2] = lines[2].replace(mac, "é".encode() + mac[2:])
    path.write_bytes(b"".join(lines))
    with pytest.raises(CheckpointError) as caught:
        _records(tmp_path)
    assert "journal line 3 was edited after it was signed" in str(caught.value)


def test_a_torn_line_is_not_checked_against_its_mac(tmp_path):
    _, _, path = _journaled(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])
    assert [r["k"] for r in _records(tmp_path)] == ["call", "step"]


# --- journal: a resume continues a suspended envelope in place -------------------------


def _suspended_journal(tmp_path: Path) -> tuple[StoreJournal, Frame]:
    journal, frame = _run_journal(tmp_path)
    journal.finish([frame], status="suspended", reason="escalated")
    resumed, _ = _run_journal(tmp_path)
    resumed.envelope = load(tmp_path / "cp.json")
    return resumed, frame


CHANGE = {"budget": 9, "set": {"go": "yes"}}


def test_a_resume_journals_what_it_changed_against_the_signed_envelope_it_leaves_as_it_was(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    before = (tmp_path / "cp.json").read_bytes()
    journal.resume(CHANGE, journal.envelope.stored_bytes)
    journal.record("r:1.0", "tool", "paid")
    assert (tmp_path / "cp.json").read_bytes() == before
    header = _journal_lines(tmp_path)[0]
    assert (header["k"], header["g"], header["resume"]) == ("gen", 1, CHANGE)
    assert [r["k"] for r in _records(tmp_path)] == ["call"]  # chained from the envelope's signature
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", journal.envelope) == CHANGE


def test_what_a_resume_changed_is_read_only_from_the_head_of_its_own_generation(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    envelope = journal.envelope
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", envelope) is None  # no resume began
    journal.resume(CHANGE, envelope.stored_bytes)
    path = tmp_path / "cp.json.journal"
    whole = path.read_bytes()
    assert resume_change(store, "cp.json", envelope.model_copy(update={"status": "running"})) is None
    assert resume_change(store, "cp.json", envelope.model_copy(update={"generation": 2})) is None
    for head in (
        whole[:-1],  # the head line is torn
        b"not json\n",
        b"[1]\n",
        b'{"k":"step","g":1,"resume":{"set":{}}}\n',
        b'{"k":"gen","g":1}\n',
        b'{"k":"gen","g":1,"resume":[1]}\n',
    ):
        path.write_bytes(head)
        assert resume_change(store, "cp.json", envelope) is None, head
    path.write_bytes(b'{"k":"gen","g":1,"resume":{"set":{}}}\n{"k":"call"}\n')
    assert resume_change(store, "cp.json", envelope) == {"set": {}}


def test_a_resume_change_may_nest_values_as_deep_as_a_checkpoint(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    deep: Any = "leaf"
    for _ in range(64 + 10):
        deep = [deep]
    journal.resume({"set": {"x": deep}}, journal.envelope.stored_bytes)
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", journal.envelope) == {"set": {"x": deep}}


# --- journal: replaying its records onto the envelope's frames --------------------------


def test_recovery_replays_steps_entered_levels_halts_and_the_calls_of_the_step_in_flight(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    top, child = Frame.start(machine), Frame.start(machine)
    child.context["from"] = "journal"
    loaded: list[dict[str, Any]] = []

    def machine_for(frame: dict[str, Any]) -> Any:
        loaded.append(frame)
        return machine

    answers = {"old": {"kind": "tool", "v": "kept"}}
    records = [
        {"k": "call", "key": "r:1.0", "kind": "tool", "v": "one", "h": "mac"},
        {"k": "step", "d": 0, "r": _step("a", "b", "x1", tokens=2), "p": {"llm": 1}},
        {"k": "enter", "d": 1, "f": child.to_json()},
        {"k": "step", "d": 1, "r": _step("a", "b", "y1", tokens=3)},
        {"k": "call", "key": "r:2.0", "kind": "produce", "v": {"text": "t"}, "h": "mac"},
        {"k": "future kind"},
    ]
    chain, calls, host_state = recover([top], answers, records, machine_for)
    assert answers == {"old": {"kind": "tool", "v": "kept"}}  # the envelope's own record is not touched
    assert [(f.state, f.steps, f.usage.input_tokens) for f in chain] == [("b", 1, 2), ("b", 1, 3)]
    assert (chain[0].context["x"], chain[1].context["x"], chain[1].context["from"]) == ("x1", "y1", "journal")
    assert loaded == [child.to_json()]
    assert calls == {"r:2.0": {"kind": "produce", "v": {"text": "t"}}}
    assert host_state == {"llm": 1}  # a step without a state keeps the last one


def test_recovery_keeps_the_unreplayed_answers_until_a_step_and_no_host_state_without_one(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    answers = {"old": {"kind": "tool", "v": "kept"}}
    records = [{"k": "call", "key": "r:1.0", "kind": "tool", "v": "one"}]
    chain, calls, host_state = recover([Frame.start(machine)], answers, records, lambda f: machine)
    assert calls == {"old": {"kind": "tool", "v": "kept"}, "r:1.0": {"kind": "tool", "v": "one"}}
    assert (host_state, chain[0].state) == (None, "a")
    steps = [{"k": "step", "d": 0, "r": _step("a", "b", 1)}]
    _, calls, host_state = recover([Frame.start(machine)], answers, steps, lambda f: machine)
    assert (calls, host_state) == ({}, None)


def test_a_level_entered_at_a_depth_replaces_the_levels_from_that_depth_on(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    chain = [Frame.start(machine), Frame.start(machine), Frame.start(machine)]
    entered = Frame.start(machine)
    entered.state = "b"
    recovered, _, _ = recover(chain, {}, [{"k": "enter", "d": 1, "f": entered.to_json()}], lambda f: machine)
    assert [f.state for f in recovered] == ["a", "b"]


def test_a_step_or_halt_at_a_level_drops_the_levels_below_it(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    chain = [Frame.start(machine), Frame.start(machine), Frame.start(machine)]
    recovered, _, _ = recover(chain, {}, [{"k": "step", "d": 1, "r": _step("a", "b", 1)}], lambda f: machine)
    assert [f.state for f in recovered] == ["a", "b"]
    assert len(chain) == 3  # the caller's chain is not changed
    records = [
        {"k": "call", "key": "r:1.0", "kind": "tool", "v": "one"},
        {"k": "halt", "d": 0, "e": "gate-fail", "u": {"input_tokens": 4, "output_tokens": 1, "cost_usd": 0.25}},
    ]
    recovered, calls, _ = recover(chain, {"old": {"kind": "tool", "v": "x"}}, records, lambda f: machine)
    assert [(f.halted, f.usage) for f in recovered] == [("gate-fail", Usage(4, 1, 0.25))]
    assert calls == {}


def test_the_callers_replay_map_is_not_used_up_by_the_run(tmp_path):
    replay = {"k1": {"kind": "tool", "v": "text"}}
    journal, _ = _run_journal(tmp_path, answers=replay)
    assert journal.replay("k1", "tool") == "text"
    assert replay == {"k1": {"kind": "tool", "v": "text"}}


def test_a_machine_loaded_after_the_journal_started_is_named_in_the_next_snapshot(tmp_path):
    hashes: dict[str, str] = {}
    journal, frame = _run_journal(tmp_path, hashes=hashes)
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").machines == {}
    hashes[str(tmp_path / "proj" / "child.mk")] = "def"
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").machines == {"child.mk": "def"}
    hashes[str(tmp_path / "proj" / "sub" / "other.mk")] = "ghi"
    journal.finish([frame], status="done")
    assert load(tmp_path / "cp.json").machines == {"child.mk": "def", "sub/other.mk": "ghi"}


def test_a_journal_without_a_root_names_machine_files_relative_to_the_current_folder(tmp_path):
    journal, frame = _run_journal(tmp_path, paths=None, hashes=None)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert (envelope.machine.path, envelope.machines) == (None, {})
    assert [f["path"] for f in envelope.frames] == [os.path.relpath(tmp_path / "proj" / "m.mk")]


def test_journal_lines_are_compact_json_that_keeps_non_ascii_text(tmp_path):
    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("k", "tool", "été")
    line = (tmp_path / "cp.json.journal").read_bytes().splitlines()[1]
    assert line.startswith('{"k":"call","key":"k","kind":"tool","v":"été","h":"'.encode())


def test_each_journal_line_is_a_crash_point_reached_once_the_line_is_in_the_file(tmp_path):
    from mklang import faults

    journal, frame = _run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    reached: list[tuple[str, str]] = []

    def watch(point: str) -> None:
        if point.startswith("journal."):
            reached.append((point, json.loads((tmp_path / "cp.json.journal").read_bytes().splitlines()[-1])["k"]))

    faults.watch(watch)
    try:
        journal.record("r:1.0", "tool", "t")
        journal.step(0, _step("a", "b", "one"))
        journal.enter(1, frame)
        journal.halt(1, "gate-fail", Usage())
    finally:
        faults.disarm()
    assert reached == [
        ("journal.call", "call"),
        ("journal.step", "step"),
        ("journal.enter", "enter"),
        ("journal.halt", "halt"),
    ]


def test_a_key_is_created_in_a_config_folder_that_already_exists(config_home):
    (config_home / "mklang").mkdir(parents=True)
    assert len(checkpoint_key()) == 64


def _saved_with_a_trace(path: Path) -> bytes:
    frame = Frame(machine=mk(TWO_STATES), state="a", context={"topic": "x"}, tainted=set(), budget=4)
    frame.trace.extend({"state": "a", "output": f"line {n}"} for n in range(3))
    machine = MachineRef(name="m", path=None, sha256=None)
    envelope = Envelope(mklang_version="t", run_id="r", status="suspended", machine=machine, frames=[frame.to_json()])
    save(path, envelope)
    return path.read_bytes()


def test_an_envelope_is_checked_as_written_and_laid_out_anew_and_an_edit_in_its_trace_is_tampered(tmp_path):
    path = tmp_path / "cp.json"
    raw = _saved_with_a_trace(path)
    assert raw.startswith(b'{"format":2,') and load(path).seal == "signed"  # field order, not sorted keys
    path.write_text(json.dumps(json.loads(raw), indent=2), encoding="utf-8")
    assert load(path).seal == "signed"
    for edited in (
        raw.replace(b'"line 1"', b'"line 9"'),
        json.dumps(json.loads(raw)).encode().replace(b"line 1", b"x"),
    ):
        path.write_bytes(edited)
        assert load(path).seal == "tampered"


def test_an_edited_envelope_nested_too_deep_is_refused_before_it_is_decoded(tmp_path):
    path = tmp_path / "cp.json"
    raw = _saved_with_a_trace(path)
    path.write_bytes(raw.replace(b'"line 1"', b"[" * 200 + b"1" + b"]" * 200))
    with pytest.raises(CheckpointError, match="holds values nested more than"):
        load(path)


def test_an_envelope_with_a_trace_context_is_signed_as_written_and_its_trace_context_is_unsigned(tmp_path):
    path = tmp_path / "cp.json"
    machine = MachineRef(name="m", path=None, sha256=None)
    context = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    save(path, Envelope(mklang_version="t", run_id="r", status="running", machine=machine, frames=[], trace=context))
    raw = path.read_bytes()
    assert signed_as_written(raw, checkpoint_key()) is not None and load(path).trace == context
    path.write_bytes(raw.replace(b"-01", b"-00"))
    assert load(path).seal == "signed"
    path.write_bytes(raw.replace(b'"run_id":"r"', b'"run_id":"s"'))
    assert load(path).seal == "tampered"
