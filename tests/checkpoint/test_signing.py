"""Checkpoint signatures: where the checkpoint key comes from, how an envelope is signed and
sealed as written, and the chained MACs of journal lines."""

from __future__ import annotations

import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import mk
from support.runs import TWO_STATES

from mklang.checkpoint.envelope import Envelope, MachineRef, load, save
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
from mklang.errors import CheckpointError

# --- where the checkpoint key comes from ---------------------------------------


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


def test_a_key_is_created_in_a_config_folder_that_already_exists(config_home):
    (config_home / "mklang").mkdir(parents=True)
    assert len(checkpoint_key()) == 64


# --- envelope signatures ---------------------------------------------------------

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
    assert raw.startswith(b'{"format":3,') and load(path).seal == "signed"  # field order, not sorted keys
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


# --- the chained MACs of journal lines -------------------------------------------


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


def test_the_key_file_is_read_again_once_it_is_replaced_rewritten_or_opened_to_others(config_home):
    path = config_home / "mklang" / "checkpoint.key"
    first = checkpoint_key()
    path.chmod(0o640)
    with pytest.raises(CheckpointError, match="readable or writable by others"):
        checkpoint_key()
    path.chmod(0o600)
    assert checkpoint_key() == first
    path.write_bytes(b"a longer key than the first one was, written in place\n")
    assert checkpoint_key() == b"a longer key than the first one was, written in place"
    other = path.with_name("other.key")
    other.write_bytes(b"a key put in its place by a rename\n")
    other.chmod(0o600)
    other.replace(path)
    assert checkpoint_key() == b"a key put in its place by a rename"
    path.unlink()
    path.symlink_to(other.with_name("elsewhere"))
    with pytest.raises(CheckpointError, match="cannot read or create the checkpoint key"):
        checkpoint_key()
