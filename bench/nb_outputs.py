"""A pytest plugin `notebook_suite.py` loads: the text each nbval cell printed (streams, and the text of displays:
`%%px` output comes as "[stdout:0] ..."), appended as JSON lines to the file $MFSDP_NB_OUTPUTS names, so the suite's
JSON keeps what a notebook showed (09_tools' call rate and accuracy) beside how long it took. Nothing without it."""
from __future__ import annotations

import json
import os

import pytest

KEEP_CHARS = 2000
"""A cell's text is cut to its last this many characters (a progress bar's repaints would otherwise fill the file)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield   # a failing cell has raised by now; what it printed before is kept all the same
    path, outs = os.environ.get("MFSDP_NB_OUTPUTS"), getattr(item, "test_outputs", None)
    if not path or outs is None:
        return
    text = "".join(o.get("text", "") if "text" in o else o.get("data", {}).get("text/plain", "") + "\n" for o in outs)
    if text.strip():
        with open(path, "a") as f:
            f.write(json.dumps(dict(notebook=os.path.basename(str(item.fspath)), cell=item.name,
                                    text=text[-KEEP_CHARS:])) + "\n")
