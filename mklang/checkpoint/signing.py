"""Checkpoint signatures: HMAC-SHA256 with the user's (or fleet's) checkpoint key.

A checkpoint is data that anyone could have written. A signature made with
the resuming user's key says this user (or their fleet, sharing one key via
`MKLANG_CHECKPOINT_KEY`) wrote it and nobody edited it since; only then may
it choose host settings (ADR 0014).

- The envelope carries `signature: {key_id, hmac}`, the HMAC of its JSON
  as written, without the signature itself and without its trace context
  (`UNSIGNED`; ADR 0036): in field order now, canonical JSON (sorted keys,
  no spaces) before; a reader checks the bytes as they are, and re-encodes
  only a file laid out anew since.
- Every journal line ends with `"h": <hmac>`, chained: the MAC of a line
  covers the MAC before it (the envelope's for the first line), so lines can
  be neither edited, reordered, dropped in the middle nor moved to another
  checkpoint, and each line costs one HMAC whatever the length of the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mklang.errors import CheckpointError

KEY_VARIABLE = "MKLANG_CHECKPOINT_KEY"
Seal = Literal["signed", "unsigned", "foreign", "tampered"]

SEAL_TEXT: dict[str, str] = {
    "signed": "signed with your checkpoint key",
    "unsigned": "not signed",
    "foreign": "signed with another checkpoint key",
    "tampered": "edited after it was signed with your checkpoint key",
}

_MAC_SUFFIX_LENGTH = len(',"h":""}') + 64


def key_file() -> Path:
    """Where the per-user key lives: $XDG_CONFIG_HOME/mklang, else ~/.config/mklang."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config_home, "mklang", "checkpoint.key")


MIN_KEY_BYTES = 32


def checkpoint_key() -> bytes:
    """The key from MKLANG_CHECKPOINT_KEY, else the per-user key file (created 0600 on first use)."""
    shared = os.environ.get(KEY_VARIABLE)
    if shared:
        if len(shared.encode("utf-8")) < MIN_KEY_BYTES:
            raise CheckpointError(
                f"{KEY_VARIABLE} is shorter than {MIN_KEY_BYTES} bytes: anyone could guess it and sign checkpoints; "
                "set it to a random secret, e.g. `openssl rand -hex 32`"
            )
        return shared.encode("utf-8")
    path = key_file()
    try:
        return _read_or_create(path)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read or create the checkpoint key: {error.strerror}") from None


def _read_or_create(path: Path) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        return _read_key(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")  # one per writer: threads race here too
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
        with contextlib.suppress(FileExistsError):  # another process created it first: use theirs
            os.link(temp, path)
    finally:
        os.unlink(temp)
    return _read_key(path)


# The key file read last: which file it was (`_identity`) and its key. A run signs and checks with
# the key several times; the file is read again only when it is another file or has changed since.
_last_read: tuple[tuple[object, ...], bytes] | None = None


def _identity(path: Path, status: os.stat_result) -> tuple[object, ...]:
    """What changes when the key file is replaced, rewritten, or its owner or mode changed."""
    return str(path), status.st_dev, status.st_ino, status.st_mtime_ns, status.st_size, status.st_mode, status.st_uid


def _read_key(path: Path) -> bytes:
    """The key in `path`, refused (as ssh refuses a private key) unless only this user can read or write it:
    a key another user planted or can read lets them sign checkpoints that choose code and endpoints."""
    global _last_read
    last = _last_read
    if last is not None and last[0] == _identity(path, os.stat(path, follow_symlinks=False)):
        return last[1]  # the same file, unchanged: checked when it was read
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(handle.fileno())
        if status.st_uid != os.getuid():
            raise CheckpointError(
                f"{path}: the checkpoint key file belongs to another user (uid {status.st_uid}): "
                "remove it and mklang creates a key of your own"
            )
        if status.st_mode & 0o077:
            raise CheckpointError(
                f"{path}: the checkpoint key file is readable or writable by others "
                f"(mode {stat.S_IMODE(status.st_mode):04o}): chmod 600 {path}, or remove it if you did not make it"
            )
        key = handle.read().strip()
    if not key:
        raise CheckpointError(f"{path}: the checkpoint key file is empty")
    _last_read = _identity(path, status), key
    return key


def key_id(key: bytes) -> str:
    """A public name of a key, so a file signed with another key is told from an edited one."""
    return hmac.new(key, b"mklang checkpoint key id", hashlib.sha256).hexdigest()[:16]


# The top-level fields a signature leaves out: itself, and the trace context of an envelope,
# which only says where the run's spans go (ADR 0034), so editing it changes nothing else.
UNSIGNED = ("signature", "trace")


def canonical(document: dict[str, Any]) -> bytes:
    """The bytes an envelope signature covers: the document without its `UNSIGNED` fields."""
    signed = {name: value for name, value in document.items() if name not in UNSIGNED}
    return _compact(signed)


def _compact(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sign(document: dict[str, Any], key: bytes) -> tuple[bytes, dict[str, str]]:
    """The bytes of a document signed with `key` (its canonical JSON), and its `signature` field."""
    return sign_encoded(canonical(document), key, document.get("trace"))


def sign_encoded(body: bytes, key: bytes, trace: Any = None) -> tuple[bytes, dict[str, str]]:
    """The bytes of a document signed with `key`, and its `signature` field; `body` is the
    document's JSON object without its `UNSIGNED` fields, in any layout.

    The MAC covers `body` as it is; the trace context (if any), then the
    signature, are added last, so the document is encoded once and a reader
    checks the bytes as they are.
    """
    signature = {"key_id": key_id(key), "hmac": hmac.new(key, body, hashlib.sha256).hexdigest()}
    return body[:-1] + _trace_member(trace) + _signature_suffix(signature), signature


def _trace_member(trace: Any) -> bytes:
    """The unsigned trace member as `sign_encoded` writes it (nothing without one)."""
    return b"" if trace is None else b',"trace":' + _compact(trace)


def _signature_suffix(signature: dict[str, str]) -> bytes:
    return b',"signature":' + json.dumps(signature, separators=(",", ":")).encode("ascii") + b"}"


def seal_of(document: dict[str, Any], key: bytes, raw: bytes = b"", encoded: Callable[[], bytes] | None = None) -> Seal:
    """Whether a document (as read from `raw`, before migration) is signed with `key`.

    Bytes laid out as `sign_encoded` writes them are checked as they are; any
    other layout of the same document (a file laid out anew after it was
    signed) is checked through its canonical JSON, as `sign` encodes it, and
    through `encoded()`, the document as its writer encodes it without its `UNSIGNED` fields.
    """
    signature = document.get("signature")
    if not isinstance(signature, dict) or not isinstance(signature.get("hmac"), str):
        return "unsigned"
    if signature.get("key_id") != key_id(key):
        return "foreign"
    if signed_as_written(raw, key) == signature["hmac"]:
        return "signed"
    for encode in (lambda: canonical(document), encoded):
        if encode is not None and _same_mac(hmac.new(key, encode(), hashlib.sha256).hexdigest(), signature["hmac"]):
            return "signed"
    return "tampered"


_UNSIGNED_AT_END = re.compile(rb'(?:,"trace":(\{[^{}]*\}))?,"signature":(\{[^{}]*\})\}\Z')
_MAX_SUFFIX_LENGTH = 4096  # a signature is about 120 bytes, a trace context at most a few hundred


def signed_as_written(raw: bytes, key: bytes) -> str | None:
    """The MAC of `raw` if it is laid out as `sign_encoded` writes it and the MAC is made with `key`, else None.

    Checked on the bytes alone, before anything decodes them, so a
    checkpoint this user wrote is known as such before its size or depth matter.
    """
    written = raw.rstrip()
    found = _UNSIGNED_AT_END.search(written[-_MAX_SUFFIX_LENGTH:])
    if found is None:
        return None
    try:
        trace = None if found[1] is None else json.loads(found[1])
        signature = json.loads(found[2])
    except ValueError:
        return None
    if not isinstance(signature, dict) or signature.get("key_id") != key_id(key):
        return None
    given = signature.get("hmac")
    if not isinstance(given, str):
        return None
    suffix = _trace_member(trace) + _signature_suffix({"key_id": key_id(key), "hmac": given})
    if not written.endswith(suffix):
        return None
    mac = hmac.new(key, memoryview(written)[: len(written) - len(suffix)], hashlib.sha256)  # no copy of megabytes
    mac.update(b"}")
    return given if _same_mac(mac.hexdigest(), given) else None


def _same_mac(expected: str, given: str) -> bool:
    """Whether a MAC read from a file (any text, perhaps edited) is the hex MAC computed now."""
    return given.isascii() and hmac.compare_digest(expected, given)  # compare_digest refuses non-ASCII text


def sign_line(body: bytes, previous: str, key: bytes) -> tuple[bytes, str]:
    """A journal line (`body` is its JSON object, no newline) with its chained MAC appended."""
    mac = hmac.new(key, previous.encode("ascii") + b"\n" + body, hashlib.sha256).hexdigest()
    return body[:-1] + b',"h":"' + mac.encode("ascii") + b'"}\n', mac


def check_lines(lines: list[bytes], previous: str, key: bytes) -> int | None:
    """The index of the first journal line whose chained MAC is wrong, or None."""
    for index, line in enumerate(lines):
        if len(line) <= _MAC_SUFFIX_LENGTH or not line[-_MAC_SUFFIX_LENGTH:].startswith(b',"h":"'):
            return index
        body = line[:-_MAC_SUFFIX_LENGTH] + b"}"
        mac = line[-66:-2].decode("ascii", errors="replace")
        expected = hmac.new(key, previous.encode("ascii") + b"\n" + body, hashlib.sha256).hexdigest()
        if not _same_mac(expected, mac):
            return index
        previous = mac
    return None
