#!/usr/bin/env bash
# Screenshot of the REAL notebook widgets (config form + training panel) -> docs/img/widgets.png
#
#   1. execute notebooks/widgets_demo.ipynb (CPU only, no engines) and export it to HTML with the
#      widget state stored in the page (nbconvert's ExecutePreprocessor.store_widget_state);
#   2. point the page's two CDN scripts at local copies fetched from the npm registry by
#      scripts/widget_assets.sh: require.js (cdnjs) and @jupyter-widgets/html-manager's
#      dist/embed-amd.js (unpkg; it bundles @jupyter-widgets/base, /controls and /output, so it
#      needs nothing else from a CDN for these widgets);
#   3. render the page with headless Chromium (file://, no network needed), save the screenshot,
#      and check that the widget manager really drew the widgets: the DOM Chromium produced must
#      hold ipywidgets' text fields, dropdowns and checkboxes, the red ConfigError in a widget,
#      and the training panel's loss curve and tokens/s table in a widget (without the widget JS
#      none of these exist); the PNG must be 1200x1600 and show red error text.
#
# Re-runnable; installs what is missing (apt: chromium, npm; pip: nbconvert into the venv). Needs
# no network beyond the package registries. Not part of `make test` (CI has no chromium); see
# tests/test_widget_screenshot.py, which skips without chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/screenshot}
PNG=${PNG:-docs/img/widgets.png}
ASSETS=${ASSETS:-runs/widget_assets}
mkdir -p "$OUT" "$(dirname "$PNG")"

CHROME=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$CHROME" ]; then
  echo "no chromium: installing it (apt-get install -y chromium)" >&2
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  CHROME=$(command -v chromium)
fi
"$PY" -c "import nbconvert, nbclient, ipykernel, ipywidgets" 2>/dev/null \
  || "$PY" -m pip install -q nbconvert nbclient ipykernel ipywidgets
ASSETS=$(ASSETS=$ASSETS bash scripts/widget_assets.sh)

# 1. execute + export with widget state
"$PY" -m jupyter nbconvert --to html --execute --ExecutePreprocessor.store_widget_state=True \
  --ExecutePreprocessor.timeout=300 --output-dir "$OUT" --output widgets_demo notebooks/widgets_demo.ipynb
HTML=$OUT/widgets_demo.html

# 2. CDN script URLs -> local files
"$PY" - "$HTML" "$ASSETS" <<'EOF'
import pathlib, re, sys
page, assets = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).resolve().as_uri()
text = page.read_text()
text, n_require = re.subn(r"https://cdnjs\.cloudflare\.com/ajax/libs/require\.js/[^\"']*",
                          f"{assets}/requirejs/require.js", text)
text, n_manager = re.subn(r"https://unpkg\.com/@jupyter-widgets/html-manager@[^/\"']*/dist/embed-amd\.js",
                          f"{assets}/html-manager/dist/embed-amd.js", text)
if n_require != 1 or n_manager != 1:
    sys.exit(f"expected one require.js and one embed-amd.js URL in {page}, found {n_require} and {n_manager}")
page.write_text(text)
EOF

# 3. render, screenshot, check
URL="file://$(realpath "$HTML")"
FLAGS=(--headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=10000 --window-size=1200,1600)
"$CHROME" "${FLAGS[@]}" --dump-dom "$URL" 2>/dev/null >"$OUT/widgets_demo.dom.html"
"$CHROME" "${FLAGS[@]}" --screenshot="$PNG" "$URL" 2>/dev/null
"$PY" - "$OUT/widgets_demo.dom.html" "$PNG" <<'EOF'
import re, sys
import numpy as np
from PIL import Image
dom, png = open(sys.argv[1]).read(), sys.argv[2]
count = lambda cls: len(re.findall(rf'class="[^"]*\b{cls}\b', dom))
n = {c: count(c) for c in ("widget-text", "widget-dropdown", "widget-checkbox", "widget-html-content")}
# the HTML widgets' rendered content (the static copies further down are not inside these)
contents = re.findall(r'class="[^"]*\bwidget-html-content\b[^"]*">(.*?)</div>', dom, re.S)
problems = []
if n["widget-text"] < 7 or n["widget-dropdown"] < 3 or n["widget-checkbox"] < 2:
    problems.append(f"config form widgets missing from the rendered DOM: {n}")
if not any("ConfigError" in c and "tensor_model_parallel_size=0" in c for c in contents):
    problems.append("no ConfigError in a rendered HTML widget")
if not any("<polyline" in c and "tokens/s" in c for c in contents):
    problems.append("no training panel (loss curve + tokens/s) in a rendered HTML widget")
img = Image.open(png).convert("RGB")
px = np.asarray(img).astype(int)
red = int(((px[..., 0] > 170) & (px[..., 1] < 90) & (px[..., 2] < 90)).sum())   # ConfigError text, #c62828
if img.size != (1200, 1600) or red < 200:
    problems.append(f"screenshot {img.size} shows {red} red error-text pixels")
if problems:
    sys.exit("widgets did not render:\n  " + "\n  ".join(problems))
print(f"rendered widgets: {n}; {red} red error-text pixels in {png}")
EOF
echo "wrote $PNG (from $HTML, widget JS from $ASSETS)"
