"""Host tools for the crash tests: a side effect that can be counted.

`record` appends one line per execution to the file named by
CRASH_LEDGER, with the idempotency key it was given.
"""

import hashlib
import os


def record(arguments, idempotency_key):
    note = str(arguments.get("note", ""))
    with open(os.environ["CRASH_LEDGER"], "a", encoding="utf-8") as ledger:
        ledger.write(f"{idempotency_key}\n")
        ledger.flush()
        os.fsync(ledger.fileno())
    return "receipt-" + hashlib.sha256(note.encode()).hexdigest()[:8]


TOOLS = {"record": record}
