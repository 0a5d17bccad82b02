"""One real-browser test of the demo page: headless Debian Chromium driven by Playwright.

Skips only when Chromium is not installed (``.ci/browser_setup.sh`` installs it and the ``playwright`` package; no
``playwright install``: Playwright drives the system Chromium through ``executable_path``). The screenshot goes to
``$HF_RETRACE_SCREENSHOT_DIR`` (or the test's tmp folder).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# headless as root, on a machine whose network is closed: no sandbox, no GPU, no background traffic
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def find_chromium() -> str | None:
    for path in CHROMIUM_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium, or run .ci/browser_setup.sh)"
    ),
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),  # gradio's own use of pandas 3
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

VISIBLE_TEXT = """(sel) => {
  const el = document.querySelector(sel);
  return el ? el.innerText : null;
}"""


def test_page_streams_both_answers_and_they_agree(tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - CI installs it
        pytest.fail("the playwright package is missing: run .ci/browser_setup.sh (pip install playwright)")
    from test_demo import build_tiny_pair, load_engine, start_server

    engine = load_engine(build_tiny_pair(tmp_path / "models"))
    blocks, url = start_server(engine)
    shots = Path(os.environ.get("HF_RETRACE_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(url, wait_until="domcontentloaded")
                page.locator("#hfr-prompt textarea").fill("Hello from a real browser.")
                page.locator("#hfr-run").click()
                page.wait_for_function(
                    "() => (document.querySelector('#hfr-status')?.innerText || '').startsWith('Done')",
                    timeout=120_000,
                )
                plain = page.evaluate(VISIBLE_TEXT, "#hfr-plain-output .hfr-tokens")
                drafted = page.evaluate(VISIBLE_TEXT, "#hfr-drafted-output .hfr-tokens")
                status = page.locator("#hfr-status").inner_text()
                legend = page.evaluate(VISIBLE_TEXT, "#hfr-legend")
                metrics = page.evaluate(VISIBLE_TEXT, "#hfr-metrics")
                rounds = page.locator("#hfr-drafted-output .hfr-round").count()
                fused = page.locator("#hfr-drafted-output .hfr-round.hfr-fused").count()
                page.screenshot(path=str(shots / "demo-browser.png"), full_page=True)
            finally:
                browser.close()
    finally:
        blocks.close()

    assert plain and plain.strip(), "the plain answer did not appear"
    assert drafted and drafted.strip(), "the speculative answer did not appear"
    assert plain == drafted  # T = 0 in fp32: identical text
    assert "identical to plain decoding" in status
    assert "drafted, accepted" in legend and "ReTrace-fused round" in legend
    assert "τ" in metrics and "speed-up" in metrics
    assert rounds > 1 and fused > 0  # coloured rounds, some of them fused by ReTrace
    assert (shots / "demo-browser.png").stat().st_size > 10_000
