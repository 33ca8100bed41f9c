"""The notebooks seen live in a real browser: headless Chromium runs them through JupyterLab's UI.

    python scripts/ui_check.py                    # 00_cluster, 02_sft, widgets_demo, Stop; screenshots + report in runs/ui_check/
    python scripts/ui_check.py --docs             # also refresh the README's docs/img/ screenshots (DOCS_IMAGES)
    python scripts/ui_check.py --notebooks 00_cluster --out /tmp/ui
    python scripts/ui_check.py --notebooks 02_sft_stop   # only the Stop scenario (a notebook built from 02_sft's cells)

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
  5. the Stop button (issue 69), `02_sft_stop`: a notebook written into the temporary folder from 02_sft's setup and
     recipe cells, FSDP's prepare, a 5000-step `%%px` fit, then the cells a user runs after Stop. The cells above
     the fit run with Run > Run All Above Selected Cell, the fit with the toolbar's Run button; after STOP_AFTER_S
     at [*] the toolbar's Stop ("Interrupt the kernel") is clicked, and the check is that the cell ends (its
     number; the seconds from the click are in the report) showing one "stopped at step N of 5000 on every rank
     (History kept ..." line and no error, then that each next cell, run with the Run button, finishes without
     one: `history.stopped_at` on every engine, 3 more steps from there, `handle.stop()`. The checks of 4 that
     hold for any notebook (every cell numbered, no traceback, none in the saved notebook, clean output) too.
`report.json` in `--out` has every check's numbers. Needs chromium (apt-get install chromium) and the
kit's `ui` extra (pip install -e '.[lab,ui]': jupyterlab, playwright; no `playwright install`).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
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
STOP_NOTEBOOK = "02_sft_stop"
"""The Stop scenario's notebook: not in notebooks/, written into the temporary folder at run time (`stop_notebook`)."""
STOP_PREPARE = "%%px\nseed = 0\nmodel, opt, sched, batches = prepare(fsdp=True, seed=seed)"
STOP_FIT = ("%%px\nhistory = fit(model.chunks, opt, batches, steps=5000, micro_batch_size=micro_batch_size, "
            "scheduler=sched, progress=False)")
"""The long cell: 5000 steps are minutes on 2 CPU cores, so Stop lands mid-run."""
AFTER_STOP = ["%%px\nassert history.stopped_at == len(history.loss) > 0",
              "%%px\nrest = fit(model.chunks, opt, batches, start_step=history.stopped_at, steps=3, "
              "micro_batch_size=micro_batch_size, scheduler=sched, progress=False)\nassert len(rest.loss) == 3",
              "handle.stop()"]
"""What a user runs after Stop: the History every engine kept, more training from where it stopped, the end."""
STOP_AFTER_S = 10
"""How long the fit cell runs ([*]) before Stop is clicked: past its first steps even on a loaded machine (the
kernel test saw step 160 after 8 s), so `stopped_at > 0`."""
STOP_LINE = "on every rank (History kept"
ERROR_SHOWN = r"\b\w*(Error|Exception)\b|KeyboardInterrupt|Traceback|\[\d+:execute\]"
"""An error's marks in a cell's visible output: JupyterLab renders an error output as plain stderr text (no class of
its own), and ipyparallel heads a remote one "[0:execute]: AssertionError ..."."""

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


def start_all(page, name: str, out: Path, *, tries: int = 3, wait_s: float = 30,
              command: str = "runmenu:run-all") -> int:
    """Run > Run All Cells (or another Run menu `command`), again if no cell was queued within `wait_s`: on a loaded
    machine (make test runs two workers) the first click, right after the kernel first reports idle, was seen to
    queue nothing. A repeat is safe: while no cell is queued, nothing has run. Returns the clicks it took."""
    for attempt in range(tries):
        if attempt:
            page.keyboard.press("Escape")   # a menu left open would swallow the next click on the menu bar
        click_menu(page, "Run", command)
        try:
            page.wait_for_function(STARTED, timeout=wait_s * 1000)
            return attempt + 1
        except Exception:
            if attempt == tries - 1:
                shot(page, out / f"{name}_not_started.png")
                raise
            print(f"{name}: Run All queued no cell in {wait_s:g} s; clicking it again", flush=True)


def open_notebook(page, server: lab.LabServer, name: str, *, timeout_s: float) -> None:
    """Open `name`.ipynb alone (`reset`: no tab of an earlier notebook), wait for its kernel, give it the width."""
    page.goto(f"http://{lab.HOST}:{server.port}/lab/tree/{name}.ipynb?token={server.token}&reset",
              timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=300_000)
    current_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if current_tab.count():
        current_tab.first.click()   # fold the file browser away: the notebook gets the width
    page.locator(".jp-NotebookPanel .jp-Cell").first.click()   # the notebook is the current widget again
    page.wait_for_timeout(1000)


def run_notebook(page, server: lab.LabServer, name: str, out: Path, *, timeout_s: float, poll_s: float) -> dict:
    """Open `name`.ipynb, Run All Cells from the menu, watch it, screenshot it; returns its report."""
    open_notebook(page, server, name, timeout_s=timeout_s)
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


def stop_notebook():
    """02_sft's own setup and recipe cells, FSDP's prepare, the long fit, then AFTER_STOP: the cells of
    tests/notebook/test_kernel_stop.py, which drives a kernel directly; here a browser presses the buttons."""
    import nbformat
    sft = nbformat.read(NOTEBOOKS / "02_sft.ipynb", as_version=4)
    setup, recipe = [c.source for c in sft.cells if c.cell_type == "code"][:2]
    nb = nbformat.v4.new_notebook(metadata=sft.metadata)
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (setup, recipe, STOP_PREPARE, STOP_FIT, *AFTER_STOP)]
    return nb


CODE_CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell"
PROMPT_IS = r"""([cells, i, want]) => {
  const p = document.querySelectorAll(cells)[i].querySelector('.jp-InputPrompt').textContent.trim();
  return want === 'running' ? p === '[*]:' : /^\[\d+\]:$/.test(p);
}"""
"""True once code cell i shows [*] (want 'running') or its execution number (want 'done')."""


def code_cell(page, index: int):
    """The index-th code cell of the open notebook (markdown cells do not count, as in READ_CELLS)."""
    return page.locator(CODE_CELLS).nth(index)


def output_text(page, index: int) -> str:
    """What a reader sees under the cell: every output (stdout, stderr, errors, widgets' text) as rendered."""
    return code_cell(page, index).locator(".jp-Cell-outputArea").inner_text()


def toolbar_button(page, item: str):
    """A button of the notebook's toolbar by its item name (panel.json's "run", "interrupt", ...)."""
    return page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) .jp-NotebookPanel-toolbar [data-jp-item-name='{item}']")


def select_cell(page, index: int) -> None:
    """Select a cell as a user does, by clicking its prompt: command mode, no editor opened in it."""
    code_cell(page, index).locator(".jp-InputPrompt").click()


def wait_prompt(page, index: int, want: str, *, timeout_s: float) -> float | None:
    """Seconds until code cell `index` is [*] (want 'running') or numbered ('done'); None if not within timeout_s,
    so the report says which step never came instead of the script dying on playwright's timeout."""
    start = time.monotonic()
    try:
        page.wait_for_function(PROMPT_IS, arg=[CODE_CELLS, index, want], timeout=timeout_s * 1000, polling=100)
    except Exception:
        return None
    return round(time.monotonic() - start, 2)


def errors_shown(text: str) -> list[str]:
    """The lines of a cell's visible output that show an error (ERROR_SHOWN)."""
    return [line.strip()[:200] for line in text.splitlines() if re.search(ERROR_SHOWN, line)]


def parse_stop_line(line: str) -> tuple[int | None, float | None]:
    """The step and the kit's own seconds of "train.fit: stopped at step 160 of 5000 ... (0.1 s after Stop)"."""
    step = re.search(r"stopped at step (\d+) of", line)
    seconds = re.search(r"\(([\d.]+) s after Stop\)", line)
    return (int(step.group(1)) if step else None), (float(seconds.group(1)) if seconds else None)


def run_stop(page, server: lab.LabServer, name: str, out: Path, *, timeout_s: float, poll_s: float) -> dict:
    """Stop as a user presses it (issue 69): run the cells above the long fit (Run > Run All Above Selected Cell),
    start the fit with the toolbar's Run button, click the toolbar's Stop ("Interrupt the kernel") once it ran
    STOP_AFTER_S, read what the cell shows, then run each next cell with the Run button. Not Run All: its queued
    cells would run by themselves after Stop; here the user runs the next cell. Returns its report."""
    open_notebook(page, server, name, timeout_s=timeout_s)
    fit = 3   # the long cell's index among the code cells
    report = {"notebook": name, "screenshots": {}, "stop": {"button": "toolbar interrupt"}, "after_stop": []}
    stop = report["stop"]
    start = time.monotonic()
    select_cell(page, fit)
    report["run_above_clicks"] = start_all(page, name, out, command="notebook:run-all-above")
    stop["setup_s"] = [wait_prompt(page, i, "done", timeout_s=timeout_s) for i in range(fit)]
    if None not in stop["setup_s"]:
        select_cell(page, fit)
        toolbar_button(page, "run").click()
        stop["fit_started_s"] = wait_prompt(page, fit, "running", timeout_s=120)
        page.wait_for_timeout(STOP_AFTER_S * 1000)
        center(code_cell(page, fit))
        report["screenshots"]["running"] = shot(page, out / f"{name}_running.png")
        stop["running_at_click"] = code_cell(page, fit).locator(".jp-InputPrompt").inner_text().strip() == "[*]:"
        clicked = time.monotonic()
        toolbar_button(page, "interrupt").click()
        if wait_prompt(page, fit, "done", timeout_s=300) is not None:   # from before the click: it is in the measure
            stop["click_to_prompt_s"] = round(time.monotonic() - clicked, 2)
        text = output_text(page, fit)
        stop["output"] = text
        stop["lines"] = [line.strip() for line in text.splitlines() if "stopped at step" in line]
        stop["step"], stop["kit_s"] = parse_stop_line(stop["lines"][0]) if stop["lines"] else (None, None)
        stop["errors_shown"] = errors_shown(text)
        # ipyparallel's own "%px:" progress bar (a widget) as Stop left it: recorded, not judged (it is not the kit's)
        stop["bars"] = page.evaluate(READ_CELLS)[fit]["bars"]
        center(code_cell(page, fit))
        report["screenshots"]["stopped"] = shot(page, out / f"{name}_stopped.png")
    if stop.get("click_to_prompt_s") is not None:
        for index in range(fit + 1, fit + 1 + len(AFTER_STOP)):
            select_cell(page, index)
            clicked = time.monotonic()
            toolbar_button(page, "run").click()
            done = wait_prompt(page, index, "done", timeout_s=timeout_s)
            seconds = None if done is None else round(time.monotonic() - clicked, 2)
            text = output_text(page, index)
            report["after_stop"].append({"cell": index, "seconds": seconds, "errors_shown": errors_shown(text),
                                         "output": text[-2000:]})
            if seconds is None or errors_shown(text):
                break
    report["seconds"] = round(time.monotonic() - start, 1)
    # the notebook's own cells: Run on the last cell adds an empty one below it, as it does for a user
    cells = page.evaluate(READ_CELLS)[:fit + 1 + len(AFTER_STOP)]
    report["prompts"] = [c["prompt"] for c in cells]
    report["problems"] = [f"cell {c['index']}: {p}" for c in cells for p in c["problems"]]
    report["unclean"] = [f"cell {c['index']}: {u}" for c in cells for u in c["unclean"]]
    report["screenshots"]["done"] = shot(page, out / f"{name}_done.png")
    click_menu(page, "File", "docmanager:save")
    dirty = ".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty"
    page.wait_for_function(f"() => !document.querySelector('{dirty}')", timeout=60_000)
    report["saved_errors"] = saved_errors(server, name)
    return report


def check_stop(report: dict) -> list[str]:
    """What the Stop scenario's report shows to be wrong (empty: Stop paused the fit and the next cells worked)."""
    name, stop, failed = report["notebook"], report["stop"], []
    if None in stop["setup_s"]:
        return [f"{name}: the cells above the fit did not all finish: {stop['setup_s']}"]
    if not stop.get("running_at_click"):
        failed.append(f"{name}: the fit cell was not running ([*]) when Stop was clicked")
    if stop.get("click_to_prompt_s") is None:
        return failed + [f"{name}: the fit cell did not end within 300 s of Stop; it shows: {stop.get('output')!r}"]
    if len(stop["lines"]) != 1 or STOP_LINE not in stop["lines"][0]:
        failed.append(f"{name}: expected one 'stopped at step N of 5000 {STOP_LINE} ...' line, "
                      f"the cell shows: {stop['output']!r}")
    if not stop["step"]:
        failed.append(f"{name}: no step done before Stop ({stop['step']}), after {STOP_AFTER_S} s of fit")
    failed += [f"{name}: the stopped cell shows an error: {e}" for e in stop["errors_shown"]]
    if any(b["width"] != "100%" for b in stop["bars"]):   # ipyparallel's %px bar, left where Stop found it
        failed.append(f"{name}: the stopped cell shows an unfinished progress bar: {stop['bars']}")
    after = report["after_stop"]
    if len(after) != len(AFTER_STOP) or any(a["seconds"] is None for a in after):
        failed.append(f"{name}: the cells after Stop did not all finish: seconds {[a['seconds'] for a in after]} "
                      f"of {len(AFTER_STOP)} cells")
    failed += [f"{name}: cell {a['cell']} after Stop shows an error: {a['errors_shown'][:4]}" for a in after
               if a["errors_shown"]]
    return failed


def check(report: dict) -> list[str]:
    """What a report shows to be wrong (empty: the notebook ran and its widgets were live)."""
    name, failed = report["notebook"], []
    if not report["prompts"] or any(not (p.startswith("[") and p[1:-2].isdigit()) for p in report["prompts"]):
        failed.append(f"{name}: not every code cell ran: {report['prompts']}")
    failed += [f"{name}: {p}" for p in report["problems"]]
    failed += [f"{name}: {u}" for u in report["unclean"]]
    failed += [f"{name}: saved error output {e}" for e in report["saved_errors"]]
    if name == STOP_NOTEBOOK:
        failed += check_stop(report)
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
    parser.add_argument("--notebooks", nargs="+", default=["00_cluster", "02_sft", "widgets_demo", STOP_NOTEBOOK],
                        help=f"{STOP_NOTEBOOK}: the Stop scenario, a notebook built from 02_sft's cells")
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
        if name == STOP_NOTEBOOK:
            import nbformat
            nbformat.write(stop_notebook(), work / "notebooks" / f"{name}.ipynb")
        else:
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
                runner = run_stop if name == STOP_NOTEBOOK else run_notebook
                report = runner(page, server, name, args.out, timeout_s=args.timeout_s, poll_s=args.poll_s)
                reports.append(report)
                report["failed"] = check(report)
                failed += report["failed"]
                print(f"{name}: {report['seconds']} s, prompts {report['prompts']}, live updates "
                      f"{report.get('live_updates', {})}, problems {report['problems'] or 'none'}", flush=True)
                if name == STOP_NOTEBOOK:
                    stop = report["stop"]
                    print(f"{name}: Stop clicked after {STOP_AFTER_S} s of fit: prompt numbered "
                          f"{stop.get('click_to_prompt_s')} s later, {stop.get('lines')}; next cells "
                          f"{[a['seconds'] for a in report['after_stop']]} s", flush=True)
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
