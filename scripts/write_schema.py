"""Write docs/checkpoint.schema.json, the published JSON schema of the checkpoint envelope.

Run it after changing `mklang.checkpoint.envelope`; a test fails while the
committed file differs from what this script writes.

Usage: python scripts/write_schema.py [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mklang.checkpoint.envelope import json_schema

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "checkpoint.schema.json"


def render() -> str:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **json_schema()}
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is stale: run python scripts/write_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
