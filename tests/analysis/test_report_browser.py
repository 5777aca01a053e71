"""`moekit report` with no arguments on the bundled model (what a fresh clone runs), opened in headless
Chromium: a screenshot that is not blank, every plot decoded, no console errors, and nothing the
page would fetch from a network.

Chromium is Debian's `chromium` package; `./dev test` installs it when it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PLOTS = {"share", "load", "entropy", "router-health", "domains", "coactivation", "hitrate", "pareto"}
# After load, the page's own images are counted; written into the DOM that --dump-dom prints.
PROBE = ('<script>window.addEventListener("load", () => { const imgs = [...document.querySelectorAll("figure.plot img")];'
         ' document.body.setAttribute("data-loaded", imgs.filter(i => i.complete && i.naturalWidth > 0).length'
         ' + "/" + imgs.length); });</script></body>')


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    import sys

    from moekit import cli

    out = tmp_path_factory.mktemp("report") / "report.html"
    argv, sys.argv = sys.argv, ["moekit", "report", "--out", str(out)]
    try:
        with pytest.raises(SystemExit) as done:
            cli.main()
    finally:
        sys.argv = argv
    assert (done.value.code or 0) == 0
    return out


def _chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe is not None, "chromium is not installed: `./dev test` installs Debian's chromium package"
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--log-level=0", *args], capture_output=True, text=True,
                          timeout=180)


def test_the_report_is_one_self_contained_file(report):
    html = report.read_text()
    assert set(re.findall(r'data-name="([\w-]+)"', html)) == PLOTS
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched
    assert html.count("data:image/png;base64,") == len(PLOTS)
    assert "mean 9.35%" in html  # the bundled model's measured active share, stated in the summary


def test_the_report_opens_in_chromium(report, tmp_path):
    shot = tmp_path / "shot.png"
    done = _chromium("--window-size=1000,2000", f"--screenshot={shot}", "--virtual-time-budget=5000", report.as_uri())
    assert shot.is_file(), done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert errors == []
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.std() > 0.05  # not a blank page
    assert (pixels.reshape(-1, 3).std(axis=1) > 0.1).mean() > 0.01  # and some of it in colour: the plots

    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE))
    dom = _chromium("--virtual-time-budget=5000", "--dump-dom", probe.as_uri()).stdout
    assert f'data-loaded="{len(PLOTS)}/{len(PLOTS)}"' in dom
