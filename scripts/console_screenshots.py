"""Screenshots of the web console's pages for docs/console.md: `python scripts/console_screenshots.py`.

Makes a store of example runs (done, halted, parked on a question) in a temporary folder, starts
`mklang serve` on it, and has the system's Chromium (driven by Playwright, never a downloaded
browser) photograph the runs list and a run page into docs/console/. The inbox of 1,000 parked
runs is photographed by its browser test: `MKLANG_CONSOLE_SHOTS=docs/console pytest
tests/console/test_console_browser.py`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "console"
sys.path.insert(0, str(ROOT / "tests"))

from support.console import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

# (run name, example machine, scenario, parks on its question)
RUNS = [
    ("refund-42", "triage/triage.mk", "small-refund-answered-directly", False),
    ("bug-kb", "triage/triage.mk", "bug-answered-from-kb-after-one-repair", False),
    ("brief", "nested/brief.mk", "two-sections-one-corrected", False),
    ("digest", "map-reduce/digest.mk", "three-sections", False),
    ("headline", "repair-loop/headline.mk", "repairs-run-out", False),
    ("unknown-bug", "triage/triage.mk", "unknown-bug-waits-for-a-human", True),
    ("status-post", "approval/approval.mk", "ask-then-publish", True),
]


def mklang(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "mklang", *args], cwd=cwd, capture_output=True, check=False)


def make_store(folder: Path) -> None:
    shutil.copytree(ROOT / "examples", folder / "examples")
    for run, machine, scenario, parks in RUNS:
        example = machine.split("/")[0]
        mklang(
            "run", f"examples/{machine}", "--script", f"examples/{example}/scenarios.yaml",
            "--scenario", scenario, "--checkpoint", f"sqlite:///runs.db#{run}", *(["--hitl"] if parks else []),
            cwd=folder,
        )  # fmt: skip


def main() -> None:
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mklang-console-") as name:
        folder = Path(name)
        make_store(folder)
        server = subprocess.Popen(
            [sys.executable, "-m", "mklang", "serve", "--store", "sqlite:///runs.db", "--port", "0"],
            cwd=folder,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            found = re.search(r"http://\S+", server.stdout.readline())
            assert found, "mklang serve printed no URL"
            url = found.group(0)
            base = url.split("/?", 1)[0]
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1200, "height": 760}, device_scale_factor=1)
                page.goto(url)
                page.screenshot(path=OUT / "runs.png")
                page.goto(f"{base}/runs/bug-kb")
                page.wait_for_selector("img.graph")
                page.screenshot(path=OUT / "run.png", full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
    for shot in sorted(OUT.glob("*.png")):
        print(shot.relative_to(ROOT))


if __name__ == "__main__":
    main()
