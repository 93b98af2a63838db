"""What the console's tests share: the system's Chromium, driven by Playwright."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.console import CHROMIUM, CHROMIUM_ARGS


def missing(what: str) -> None:
    """Skip outside CI, with one line naming what is missing; under CI=true it must be there."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI must run the browser test: .ci/run installs it)")
    pytest.skip(what)


@pytest.fixture
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        missing("no browser: /usr/bin/chromium is not installed (apt-get install chromium chromium-driver)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("no playwright: pip install playwright (the dev extra has it)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()
