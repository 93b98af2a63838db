"""What every bench prints first: the machine's load, which its figures depend on."""

from __future__ import annotations

import os


def print_load() -> None:
    one, five, fifteen = os.getloadavg()
    print(f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores")
