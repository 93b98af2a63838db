"""Write the published JSON schemas: docs/checkpoint.schema.json (the checkpoint envelope) and
docs/scenarios.schema.json (scenario scripts).

Run it after changing `mklang.checkpoint.envelope` or the tables of `mklang.scenarios`; a test
fails while a committed file differs from what this script writes.

Usage: python scripts/write_schema.py [--check]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mklang.checkpoint.envelope import json_schema
from mklang.scenario_schema import script_schema

DOCS = Path(__file__).resolve().parent.parent / "docs"
SCHEMA_PATH = DOCS / "checkpoint.schema.json"


def envelope_schema() -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **json_schema()}


SCHEMAS: dict[Path, Callable[[], dict[str, Any]]] = {
    SCHEMA_PATH: envelope_schema,
    DOCS / "scenarios.schema.json": script_schema,
}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for path, schema in SCHEMAS.items():
        text = render(schema())
        if "--check" not in argv:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        elif (path.read_text(encoding="utf-8") if path.exists() else "") != text:
            stale.append(path)
    for path in stale:
        print(f"{path} is stale: run python scripts/write_schema.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
