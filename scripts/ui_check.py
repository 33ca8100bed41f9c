"""The notebooks seen live in a real browser: headless Chromium runs them through JupyterLab's UI.

    python scripts/ui_check.py                    # 00_cluster, 02_sft, widgets_demo; screenshots + report in runs/ui_check/
    python scripts/ui_check.py --docs             # also refresh the README's docs/img/ screenshots (DOCS_IMAGES)
    python scripts/ui_check.py --notebooks 00_cluster --out /tmp/ui

An exported HTML page only shows widget state someone saved; it cannot tell whether the widgets
work against a kernel. This drives the path a user takes instead:
  1. copy the notebooks (without outputs) into a temporary folder, so JupyterLab's autosave never
     writes into notebooks/, and start JupyterLab the kit's way (`mfsdp_kit.notebook.lab.start`: 127.0.0.1,
     a token), with its own settings folder (no news pop-up, every cell kept in the DOM);
  2. open each notebook in headless Chromium (playwright) and click Run > Run All Cells;
  3. while the cells run, read the page's DOM every `--poll-s` seconds; once the training panel
     is a third of the way through `fit`, take a screenshot;
  4. when every cell has its execution number, save the notebook (File > Save), take screenshots
     of the widget outputs, and check (the script exits 1 naming what failed):
     - every code cell ran ([n], none left at [*] or [ ]), and no output shows a traceback,
       "Error displaying widget" or a widget's text repr (what the page shows without widget JS);
     - 00_cluster: one progress bar per rank, each at "step 10/10";
     - widgets_demo (no engines): the config form's fields are text/dropdown/checkbox widget views
       with the red ConfigError for tensor_model_parallel_size=0 under them; the simulated panel drew;
     - 02_sft: each TrainingPanel (DDP, Megatron-FSDP) is an ipywidget view with one row per rank;
       its loss curve (an SVG polyline) changed between two reads while its cell was still
       running [*], i.e. the kernel updated it live from the engines; at the end every rank is at
       step total/total and the curve is painted (blue pixels in the element's screenshot);
     - the saved notebook (read back through the server's REST API) holds no error output;
     - the visible output is clean: no empty `[output:N]` block (an engine's head with nothing under
       it), no text progress bar left at 0 % (tqdm's or rich's, e.g. a third-party loader's) and no
       UserWarning, FutureWarning or DeprecationWarning (`mfsdp_kit.compat.patches.quiet` filters the benign ones).
`report.json` in `--out` has every check's numbers. Needs chromium (apt-get install chromium) and the
kit's `ui` extra (pip install -e '.[lab,ui]': jupyterlab, playwright; no `playwright install`).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mfsdp_kit.notebook import lab

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""--no-sandbox: root in a container; the background-networking flags keep Chromium from calling out
(on a closed network those calls stall it)."""
VIEWPORT = {"width": 1280, "height": 900}
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},   # every cell in the DOM
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
DOCS_IMAGES = {("02_sft", "live"): "widgets.png", ("00_cluster", "done"): "cluster_progress.png",
               ("widgets_demo", "done_0"): "config_form.png"}
"""Which screenshot becomes which docs/img file with --docs."""

# One read of the notebook's DOM: per code cell its prompt, widget views, panels, bars and problems.
READ_CELLS = r"""() => {
  const problems = ["Error displaying widget", "Traceback (most recent call last)", "Failed to load model class",
                    "Could not find model"];
  const widgetRepr = /^(HTML|VBox|HBox|IntProgress|Label)\(/;
  return [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')].map((cell, i) => {
    const outputs = cell.querySelector('.jp-Cell-outputArea');
    const text = outputs ? outputs.innerText : '';
    const plain = [...cell.querySelectorAll('.jp-OutputArea-output[data-mime-type="text/plain"]')]
      .map(o => o.innerText.trim()).filter(t => widgetRepr.test(t));
    const panels = [...cell.querySelectorAll('.jupyter-widgets.widget-html .widget-html-content')]
      .filter(h => h.textContent.includes('loss per step'))
      .map(h => ({title: h.querySelector('b') ? h.querySelector('b').textContent : '',
                  points: (h.querySelector('svg polyline') || {getAttribute: () => ''}).getAttribute('points') || '',
                  rows: [...h.querySelectorAll('table tr')].slice(1).map(tr => [...tr.children].map(td => td.textContent))}));
    const bars = [...cell.querySelectorAll('.jupyter-widgets.widget-hprogress')].map(b => ({
      label: (b.querySelector('label') || {textContent: ''}).textContent,
      width: (b.querySelector('.progress-bar') || {style: {}}).style.width || '',
      text: b.nextElementSibling ? b.nextElementSibling.textContent : ''}));
    const count = cls => cell.querySelectorAll('.jupyter-widgets.' + cls).length;
    const controls = {text: count('widget-text'), dropdown: count('widget-dropdown'), checkbox: count('widget-checkbox')};
    // ipyparallel heads each engine's output "[output:N]": a head with nothing under it is an empty block
    const texts = [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText.trim());
    const head = /^\[output:\d+\]$/;
    const emptyBlocks = texts.filter((t, k) => head.test(t) && (k + 1 >= texts.length || !texts[k + 1] || head.test(texts[k + 1])))
      .map(t => 'empty block ' + t);
    // a text progress bar (tqdm's "0%|", rich's "0% ... (0/17)") still at zero after its cell finished
    const zeroBars = text.split('\n').filter(l => /(^|\s)0%/.test(l) && /\b0\/\d+/.test(l))
      .map(l => 'progress bar at 0 %: ' + l.trim().slice(0, 100));
    // a Python warning that reached the reader (mfsdp_kit.compat.patches.quiet.known_warnings(): the benign ones, filtered)
    const warned = text.split('\n').filter(l => /\b(UserWarning|FutureWarning|DeprecationWarning)\b/.test(l))
      .map(l => 'warning shown: ' + l.trim().slice(0, 160));
    const configErrors = [...cell.querySelectorAll('.jupyter-widgets.widget-html .widget-html-content span')]
      .filter(e => e.textContent.startsWith('ConfigError'))
      .map(e => ({text: e.textContent, color: getComputedStyle(e).color}));
    return {index: i, prompt: (cell.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent.trim(),
            widget_views: cell.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length,
            panels, bars, controls, config_errors: configErrors, problems: [...problems.filter(p => text.includes(p)), ...plain.map(t => 'widget repr: ' + t.slice(0, 60))],
            unclean: [...emptyBlocks, ...zeroBars, ...warned]};
  });
}"""


def chromium_path() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def write_lab_settings(folder: Path) -> None:
    """User settings JupyterLab reads from JUPYTERLAB_SETTINGS_DIR (the user's own stay untouched)."""
    for plugin, values in LAB_SETTINGS.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def panel_steps(panel: dict) -> list[int]:
    """Each rank row's step (the "12/150" cell); -1 before the rank reported."""
    return [int(row[1].split("/")[0]) if row[1].split("/")[0].isdigit() else -1 for row in panel["rows"]]


def panel_total(panel: dict) -> int:
    """The steps `fit` will run (the "/150" of rank 0's row); 0 before it reported."""
    total = panel["rows"][0][1].split("/")[-1] if panel["rows"] else ""
    return int(total) if total.isdigit() else 0


def click_menu(page, menu: str, command: str) -> None:
    """Open a menu of the menu bar and click the item bound to `command`, as a user would."""
    page.click(f".lm-MenuBar-item:has-text('{menu}')")
    page.click(f".lm-Menu-item[data-command='{command}']")


def blue_pixels(png: bytes) -> int:
    """Pixels of the panel's curve colour (#1f77b4) in a screenshot."""
    import numpy as np
    from PIL import Image
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return int((np.abs(px - np.array([31, 119, 180])).sum(-1) < 60).sum())


STARTED = ("() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
           ".some(p => p.textContent.trim() !== '[ ]:')")
"""True once any code cell is queued ([*]) or has run: Run All queues every cell at once."""


def start_all(page, name: str, out: Path, *, tries: int = 3, wait_s: float = 30) -> int:
    """Run > Run All Cells, again if no cell was queued within `wait_s`: on a loaded machine (make test runs two
    workers) the first click, right after the kernel first reports idle, was seen to queue nothing. A repeat is
    safe: while no cell is queued, nothing has run. Returns the clicks it took."""
    for attempt in range(tries):
        if attempt:
            page.keyboard.press("Escape")   # a menu left open would swallow the next click on the menu bar
        click_menu(page, "Run", "runmenu:run-all")
        try:
            page.wait_for_function(STARTED, timeout=wait_s * 1000)
            return attempt + 1
        except Exception:
            if attempt == tries - 1:
                shot(page, out / f"{name}_not_started.png")
                raise
            print(f"{name}: Run All queued no cell in {wait_s:g} s; clicking it again", flush=True)


def run_notebook(page, server: lab.LabServer, name: str, out: Path, *, timeout_s: float, poll_s: float) -> dict:
    """Open `name`.ipynb, Run All Cells from the menu, watch it, screenshot it; returns its report."""
    page.goto(f"http://{lab.HOST}:{server.port}/lab/tree/{name}.ipynb?token={server.token}&reset",
              timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=300_000)
    current_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if current_tab.count():
        current_tab.first.click()   # fold the file browser away: the notebook gets the width
    page.locator(".jp-NotebookPanel .jp-Cell").first.click()   # the notebook is the current widget again
    page.wait_for_timeout(1000)
    clicks = start_all(page, name, out)
    report = {"notebook": name, "screenshots": {}, "live_updates": {}, "polls": 0, "run_all_clicks": clicks}
    seen: dict[str, list[tuple[str, list[int]]]] = {}   # panel title -> (points, steps) read while running
    start = time.monotonic()
    cells: list[dict] = []
    while time.monotonic() - start < timeout_s:
        cells = page.evaluate(READ_CELLS)
        report["polls"] += 1
        for cell in cells:
            for panel in cell["panels"]:
                if cell["prompt"] != "[*]:" or not panel["points"]:
                    continue
                history = seen.setdefault(panel["title"], [])
                steps = panel_steps(panel)
                if not history or history[-1][0] != panel["points"]:
                    history.append((panel["points"], steps))
                total = panel_total(panel)
                if "live" not in report["screenshots"] and total and min(steps) >= total // 3:
                    center(page.locator(".jp-CodeCell").nth(cell["index"]))
                    report["screenshots"]["live"] = shot(page, out / f"{name}_live.png")
        finished = cells and all(c["prompt"] not in ("[*]:", "[ ]:", "") for c in cells)
        if finished or any(c["problems"] for c in cells):   # Run All stops at an error anyway
            break
        page.wait_for_timeout(poll_s * 1000)
    report["seconds"] = round(time.monotonic() - start, 1)
    report["live_updates"] = {title: len(h) for title, h in seen.items()}
    report["live_steps"] = {title: [s for _, s in h] for title, h in seen.items()}
    report["prompts"] = [c["prompt"] for c in cells]
    report["problems"] = [f"cell {c['index']}: {p}" for c in cells for p in c["problems"]]
    report["unclean"] = [f"cell {c['index']}: {u}" for c in cells for u in c["unclean"]]   # read once all ran
    report["bars"] = [b for c in cells for b in c["bars"]]
    report["controls"] = {k: sum(c["controls"][k] for c in cells) for k in ("text", "dropdown", "checkbox")}
    report["config_errors"] = [e for c in cells for e in c["config_errors"]]
    report["panels"] = [{"title": p["title"], "rows": p["rows"], "points": len(p["points"].split())}
                        for c in cells for p in c["panels"]]
    # Screenshots of the finished widgets: each widget cell in view, then the painted curves.
    widget_cells = [c["index"] for c in cells if c["widget_views"]]
    for i, index in enumerate(widget_cells):
        center(page.locator(".jp-CodeCell").nth(index))
        report["screenshots"]["done" if i == len(widget_cells) - 1 else f"done_{i}"] = shot(page, out / f"{name}_done_{i}.png")
    report["curve_pixels"] = []
    for svg in page.locator(".jupyter-widgets.widget-html .widget-html-content svg").all():
        svg.scroll_into_view_if_needed()
        report["curve_pixels"].append(blue_pixels(svg.screenshot()))
    dirty = ".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty"   # the notebook's tab, while unsaved changes exist
    report["dirty_before_save"] = page.locator(dirty).count()
    click_menu(page, "File", "docmanager:save")
    # saved: the tab loses its dirty mark once the server has written the file
    page.wait_for_function(f"() => !document.querySelector('{dirty}')", timeout=60_000)
    report["saved_errors"] = saved_errors(server, name)
    return report


def center(locator) -> None:
    """Scroll the notebook so this cell sits in the middle of the window."""
    locator.evaluate("e => e.scrollIntoView({block: 'center'})")


def shot(page, path: Path) -> str:
    page.wait_for_timeout(500)   # let the scroll and the last widget update paint
    page.screenshot(path=str(path))
    return str(path)


def saved_errors(server: lab.LabServer, name: str) -> list[str]:
    """Error outputs in the notebook as the server saved it (`ename: evalue` each)."""
    request = urllib.request.Request(f"http://{lab.HOST}:{server.port}/api/contents/{name}.ipynb",
                                     headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        nb = json.load(response)["content"]
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb["cells"] if c["cell_type"] == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def check(report: dict) -> list[str]:
    """What a report shows to be wrong (empty: the notebook ran and its widgets were live)."""
    name, failed = report["notebook"], []
    if not report["prompts"] or any(not (p.startswith("[") and p[1:-2].isdigit()) for p in report["prompts"]):
        failed.append(f"{name}: not every code cell ran: {report['prompts']}")
    failed += [f"{name}: {p}" for p in report["problems"]]
    failed += [f"{name}: {u}" for u in report["unclean"]]
    failed += [f"{name}: saved error output {e}" for e in report["saved_errors"]]
    if name == "00_cluster":
        bars = [b for b in report["bars"] if b["label"].startswith("rank ")]   # not ipyparallel's own tqdm bars
        if len(bars) < 2 or any(b["text"].split()[:2] != ["step", "10/10"] or b["width"] != "100%" for b in bars):
            failed.append(f"{name}: expected a full progress bar per rank at step 10/10, got {bars}")
    if name == "widgets_demo":
        n = report["controls"]
        if n["text"] < 7 or n["dropdown"] < 3 or n["checkbox"] < 2:
            failed.append(f"{name}: the config form's fields are not ipywidgets views: {n}")
        if not any("tensor_model_parallel_size=0" in e["text"] and e["color"] == "rgb(198, 40, 40)"   # #c62828
                   for e in report["config_errors"]):
            failed.append(f"{name}: no red ConfigError under the form: {report['config_errors']}")
        if [(p["title"], [r[1] for r in p["rows"]]) for p in report["panels"]] != [("SFT (simulated)", ["120/150"] * 2)]:
            failed.append(f"{name}: expected the simulated panel at step 120/150 per rank, got {report['panels']}")
    if name == "02_sft":
        panels = report["panels"]
        if len(panels) != 2:
            failed.append(f"{name}: expected 2 training panels (DDP, Megatron-FSDP), found {len(panels)}")
        for panel in panels:
            title, rows = panel["title"], panel["rows"]
            if len(rows) < 2 or [r[0] for r in rows] != [str(i) for i in range(len(rows))]:
                failed.append(f"{name}: {title}: expected one row per rank 0..n-1, got {rows}")
            if any(r[1].split("/")[0] != r[1].split("/")[1] for r in rows):
                failed.append(f"{name}: {title}: a rank did not reach its last step: {rows}")
            if report["live_updates"].get(title, 0) < 2:
                failed.append(f"{name}: {title}: the loss curve never changed while fit ran "
                              f"({report['live_updates'].get(title, 0)} distinct reads)")
        if not report["curve_pixels"] or min(report["curve_pixels"]) < 100:
            failed.append(f"{name}: a loss curve is not painted: {report['curve_pixels']} blue pixels")
        if "live" not in report["screenshots"]:
            failed.append(f"{name}: no screenshot while fit ran")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notebooks", nargs="+", default=["00_cluster", "02_sft", "widgets_demo"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/ui_check", help="screenshots and report.json")
    parser.add_argument("--docs", action="store_true", help="copy the screenshots README shows into docs/img/")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per notebook")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between two reads of the DOM")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright
    chromium = chromium_path()
    if chromium is None:
        sys.exit("no chromium: apt-get install -y chromium (or set CHROMIUM=/path/to/chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mfsdp_ui_"))
    (work / "notebooks").mkdir()
    for name in args.notebooks:
        shutil.copy(NOTEBOOKS / f"{name}.ipynb", work / "notebooks")
    write_lab_settings(work / "settings")
    server = lab.start(root=work / "notebooks", timeout_s=300,
                       env={"JUPYTERLAB_SETTINGS_DIR": str(work / "settings"),
                            "JUPYTERLAB_WORKSPACES_DIR": str(work / "workspaces")})
    print(f"JupyterLab on {server.url.split('?')[0]} serving a copy of {args.notebooks}", flush=True)
    reports, failed = [], []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(120_000)
            for name in args.notebooks:
                report = run_notebook(page, server, name, args.out, timeout_s=args.timeout_s, poll_s=args.poll_s)
                reports.append(report)
                report["failed"] = check(report)
                failed += report["failed"]
                print(f"{name}: {report['seconds']} s, prompts {report['prompts']}, live updates "
                      f"{report['live_updates']}, problems {report['problems'] or 'none'}", flush=True)
            browser.close()
    finally:
        server.stop()   # the server, then every kernel it started (they run in sessions of their own)
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "report.json").write_text(json.dumps({"reports": reports, "failed": failed}, indent=1))
    if args.docs:   # only what a notebook that passed showed
        for report in reports:
            for (name, moment), target in DOCS_IMAGES.items():
                if report["notebook"] == name and not report["failed"] and moment in report["screenshots"]:
                    shutil.copy(report["screenshots"][moment], ROOT / "docs/img" / target)
                    print("wrote", f"docs/img/{target}")
    print("FAILED:\n  " + "\n  ".join(failed) if failed else f"ui check passed; screenshots in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
