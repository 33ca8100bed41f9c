"""The real ipywidgets render in a browser: scripts/screenshot_widgets.sh executes
notebooks/widgets_demo.ipynb, exports it with widget state, renders it offline in headless Chromium
with @jupyter-widgets/html-manager from npm, and checks the DOM and the PNG. Skips without
chromium (CI) or without a way to get the widget JS (npm, or runs/widget_assets/ already there)."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROME = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
HAVE_ASSETS = (ROOT / "runs/widget_assets/html-manager/dist/embed-amd.js").exists() and \
    (ROOT / "runs/widget_assets/requirejs/require.js").exists()


@pytest.mark.skipif(CHROME is None, reason="no chromium")
@pytest.mark.skipif(importlib.util.find_spec("nbconvert") is None, reason="no nbconvert")
@pytest.mark.skipif(not HAVE_ASSETS and shutil.which("npm") is None, reason="no npm to fetch the widget JS")
def test_widgets_render_in_headless_chromium(tmp_path):
    png = tmp_path / "widgets.png"
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "html"), "PNG": str(png)}
    proc = subprocess.run(["bash", str(ROOT / "scripts/screenshot_widgets.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rendered widgets:" in proc.stdout
    assert png.stat().st_size > 50_000
