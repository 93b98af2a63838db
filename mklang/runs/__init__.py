"""The runs package: the one door through which a run is started, opened and driven.

Each module does one job:

    starting   `start`: a run in memory through the engine, or durably at a checkpoint
    opening    `open_run` / `opened`: lock -> read -> verify -> rebuild -> recover -> fit
    driving    `proceed`: continue an opened run with a host; `drive`, what both persist with
    resuming   `resume`: open a stored run, then drive it
    claims     `outcome` / `claim`: what a store's run came to, and taking it under its lock
    removal    `remove_run`: removing a stored run, decided from its signed envelope
    notes      signed notes (run records, worker reports) a fleet exchanges (ADR 0024)

The CLI, the Python API, batches, workers and `mklang show` reach stored runs
only through this package.
"""

from mklang.runs.claims import Claim, Outcome, claim, outcome
from mklang.runs.driving import RunSettings, proceed
from mklang.runs.notes import fleet_mac, read_signed, record_key, report_key, verified, write_signed
from mklang.runs.opening import OpenOptions, Resumable, open_run, opened
from mklang.runs.removal import FINISHED, Removal, remove_run
from mklang.runs.resuming import resume
from mklang.runs.starting import start

__all__ = [
    "FINISHED",
    "Claim",
    "OpenOptions",
    "Outcome",
    "Removal",
    "Resumable",
    "RunSettings",
    "claim",
    "fleet_mac",
    "open_run",
    "opened",
    "outcome",
    "proceed",
    "read_signed",
    "record_key",
    "remove_run",
    "report_key",
    "resume",
    "start",
    "verified",
    "write_signed",
]
