"""report.html in a real headless browser (Debian's chromium): no errors, every figure shown.

Skipped where chromium is absent; CI installs it (.ci/run).
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from bench_lib.report.build import write_report
from tests.test_report import synthetic_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.integration,  # a chromium process per page
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium "
                                 "(apt-get install chromium; .ci/run installs it)")]

# Injected into a copy of the page: counts errors (script errors, and resources that fail to
# load, caught in the capture phase) and images decoded with a size, into the DOM.
PROBE = """<script>
window.__errors = [];
window.addEventListener("error",
  e => window.__errors.push(String(e.message || e.target.src).slice(0, 120)), true);
const origError = console.error;
console.error = (...a) => { window.__errors.push(a.join(" ")); origError(...a); };
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const shown = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.width > 0);
  const p = document.createElement("div");
  p.id = "probe";
  p.dataset.images = imgs.length;
  p.dataset.shown = shown.length;
  p.dataset.errors = window.__errors.length;
  p.textContent = window.__errors.join(" | ");
  document.body.appendChild(p);
});
</script>"""


def chromium(tmp_path: Path, url: str, *flags: str) -> subprocess.CompletedProcess:
    """Run headless chromium once, offline-minded, with a fresh profile."""
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--force-device-scale-factor=1", "--force-color-profile=srgb",
           "--hide-scrollbars", f"--user-data-dir={profile}", "--enable-logging=stderr",
           "--v=0", *flags, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def probe(tmp_path: Path, html: str) -> dict:
    page = tmp_path / "probed.html"
    page.write_text(html.replace("<head>", "<head>" + PROBE, 1))
    proc = chromium(tmp_path, page.as_uri(), "--virtual-time-budget=5000", "--dump-dom")
    match = re.search(r'<div id="probe" data-images="(\d+)" data-shown="(\d+)" '
                      r'data-errors="(\d+)">([^<]*)</div>', proc.stdout)
    assert match, f"probe missing from the DOM: {proc.stderr[-2000:]}"
    images, shown, errors, text = match.groups()
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    return {"images": int(images), "shown": int(shown), "errors": int(errors), "text": text,
            "console": console}


@pytest.fixture(scope="module")
def report_html(tmp_path_factory) -> Path:
    return write_report([synthetic_run(tmp_path_factory.mktemp("runs"))])


def test_report_loads_without_errors_and_shows_every_figure(report_html, tmp_path):
    seen = probe(tmp_path, report_html.read_text())
    assert seen["images"] == 7
    assert seen["shown"] == 7, seen
    assert seen["errors"] == 0 and seen["console"] == [], seen


def test_probe_notices_a_broken_figure(report_html, tmp_path):
    html = report_html.read_text()
    broken = html.replace("data:image/png;base64,iVBOR", "data:image/png;base64,XXXXX", 1)
    seen = probe(tmp_path, broken)
    assert seen["images"] == 7 and seen["shown"] == 6
    assert seen["errors"] >= 1


def _figures(html: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'src="data:image/png;base64,([^"]+)"',
                                                    html)]


def screenshot_matches(tmp_path: Path, png: bytes, src: str) -> float:
    """Mean absolute RGB difference between a figure and a screenshot of it in a page."""
    fig = tmp_path / "figure.png"
    fig.write_bytes(png)
    expected = matplotlib.image.imread(fig)[..., :3]
    h, w = expected.shape[:2]
    page = tmp_path / "one.html"
    page.write_text(f'<!DOCTYPE html><html><body style="margin:0;background:#fff">'
                    f'<img src="{src}" style="display:block"></body></html>')
    shot = tmp_path / "shot.png"
    proc = chromium(tmp_path, page.as_uri(), f"--window-size={w},{h}",
                    f"--screenshot={shot}")
    assert shot.exists(), proc.stderr[-2000:]
    got = matplotlib.image.imread(shot)[..., :3]
    assert got.shape[:2] == (h, w), f"screenshot {got.shape[:2]} != figure {(h, w)}"
    return float(np.abs(got - expected).mean())


def test_screenshot_of_each_figure_matches_its_png(report_html, tmp_path):
    html = report_html.read_text()
    for i, png in enumerate(_figures(html)):
        src = "data:image/png;base64," + base64.b64encode(png).decode()
        assert screenshot_matches(tmp_path, png, src) < 0.02, f"figure {i + 1}"


def test_screenshot_fails_on_a_broken_image(report_html, tmp_path):
    png = _figures(report_html.read_text())[0]
    assert screenshot_matches(tmp_path, png, "data:image/png;base64,XXXXbroken") > 0.05


def test_full_page_screenshot_is_not_blank(report_html, tmp_path):
    shot = tmp_path / "page.png"
    chromium(tmp_path, report_html.as_uri(), "--window-size=1300,3000", f"--screenshot={shot}")
    pixels = matplotlib.image.imread(shot)[..., :3]
    colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert (pixels < 0.9).any(axis=-1).mean() > 0.03  # ink, not an empty page
    assert colours > 200  # figures (bars, heatmap), not just text
