"""The runs package: the one door through which a run is started, opened and driven.

Each module does one job:

    request    `RunRequest`: a run to start or continue, as its caller asks for it (`Words`)
    hosting    `build_host`: the one way a run's host is made from a request
    starting   `start`: a run in memory through the engine, or durably at a checkpoint
    opening    `open_run` / `opened`: lock -> read -> verify -> rebuild -> recover -> fit
    driving    `proceed`: continue an opened run with a host; `drive`, what both persist with
    resuming   `resume`: open a stored run, build its host, drive it (the one recipe)
    lanes      `in_lane`: a run awaited in an event loop, on a thread of one bounded pool
    migrating  `migrate`: a parked run classified against, and moved to, a new machine version
    claims     `outcome` / `claim`: what a store's run came to, and taking it under its lock
    removal    `remove_run`: removing a stored run, decided from its signed envelope
    notes      signed notes (run records, worker reports) a fleet exchanges (ADR 0024)
    places     `location`: where a store's run is, named as commands name it
    inspection what `show`, `runs` and the console tell of a stored run (imported by its readers)

The CLI, the Python API, batches, workers and `mklang show` reach stored runs
only through this package.
"""

from mklang.runs.claims import Claim, Outcome, claim, outcome
from mklang.runs.driving import RunSettings, proceed
from mklang.runs.hosting import build_host
from mklang.runs.migrating import migrate, migrate_store, resume_migrated
from mklang.runs.notes import fleet_mac, read_signed, record_key, report_key, verified, write_signed
from mklang.runs.opening import OpenOptions, Resumable, open_run, opened
from mklang.runs.places import location
from mklang.runs.removal import FINISHED, Removal, remove_run
from mklang.runs.request import FLAGS, KEYWORDS, RunRequest, Tell, Words, on_stderr
from mklang.runs.resuming import resume
from mklang.runs.starting import start

__all__ = [
    "FINISHED",
    "FLAGS",
    "KEYWORDS",
    "Claim",
    "OpenOptions",
    "Outcome",
    "Removal",
    "Resumable",
    "RunRequest",
    "RunSettings",
    "Tell",
    "Words",
    "build_host",
    "claim",
    "fleet_mac",
    "location",
    "migrate",
    "migrate_store",
    "on_stderr",
    "open_run",
    "opened",
    "outcome",
    "proceed",
    "read_signed",
    "record_key",
    "remove_run",
    "report_key",
    "resume",
    "resume_migrated",
    "start",
    "verified",
    "write_signed",
]
