#!/usr/bin/env bash
# Screenshot of the notebook widgets (config form + training panel) -> docs/img/widgets.png
#
#   1. execute notebooks/widgets_demo.ipynb (CPU only, no engines) and export it to HTML with the
#      widget state stored in the page (nbconvert's ExecutePreprocessor.store_widget_state);
#   2. render that page with headless Chromium and save the screenshot.
#
# Live ipywidgets in static HTML need @jupyter-widgets/html-manager, which the page loads from a
# CDN (unpkg / jsdelivr). Offline the widget views stay empty, so widgets_demo.ipynb also shows
# static HTML snapshots of both (ConfigForm.html(), TrainingPanel._repr_html_), which render
# without any JavaScript. Needs: nbconvert in the venv, and chromium
# (`apt-get install -y chromium` on Debian/Ubuntu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/screenshot}
PNG=${PNG:-docs/img/widgets.png}
mkdir -p "$OUT" "$(dirname "$PNG")"

"$PY" -m jupyter nbconvert --to html --execute --ExecutePreprocessor.store_widget_state=True \
  --ExecutePreprocessor.timeout=300 --output-dir "$OUT" --output widgets_demo notebooks/widgets_demo.ipynb

CHROME=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$CHROME" ]; then
  echo "no chromium found: install it (apt-get install -y chromium); the HTML is at $OUT/widgets_demo.html" >&2
  exit 1
fi
# --virtual-time-budget lets the page's scripts (the widget manager, when reachable) finish first.
"$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=10000 \
  --window-size=1200,1600 --screenshot="$PNG" "file://$PWD/$OUT/widgets_demo.html"
echo "wrote $PNG (from $OUT/widgets_demo.html)"
