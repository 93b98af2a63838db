"""Host tools for the crash tests: a side effect that can be counted.

`record` appends one line per execution to the file named by
CRASH_LEDGER, with the idempotency key it was given; once the line is
durable the call is *in flight* (done, not yet returned): the crash point
`call.inflight` (mklang.faults).
"""

import hashlib
import os

from mklang import faults


def record(arguments, idempotency_key):
    note = str(arguments.get("note", ""))
    with open(os.environ["CRASH_LEDGER"], "a", encoding="utf-8") as ledger:
        ledger.write(f"{idempotency_key}\n")
        ledger.flush()
        os.fsync(ledger.fileno())
    faults.reach("call.inflight")
    return "receipt-" + hashlib.sha256(note.encode()).hexdigest()[:8]


TOOLS = {"record": record}
