"""nbval on the notebooks: a cell whose visible output holds a Python warning fails.

The kit filters the third-party warnings it knows are benign (`mfsdp_kit.compat.patches.quiet.known_warnings()`); any other
UserWarning, FutureWarning or DeprecationWarning that reaches a reader (a cell's stream, or an engine's
`[stderr:N]` lines, which ipyparallel shows as display data) is either the kit's own problem or one to add there
with its reason. nbval checks no outputs under --nbval-lax, so this hook reads what the cell printed.
"""
import re

import pytest

WARNING = re.compile(r"\b(UserWarning|FutureWarning|DeprecationWarning)\b")


def visible_text(outputs) -> str:
    """The text a reader sees in a cell's outputs: streams, plain-text display data and results."""
    parts = []
    for out in outputs or []:
        parts.append(out.get("text") or "")
        data = out.get("data") or {}
        text = data.get("text/plain") or ""
        parts.append(text if isinstance(text, str) else "".join(text))
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    text = visible_text(getattr(item, "test_outputs", None))   # nbval keeps the cell's outputs there
    lines = [line for line in text.splitlines() if WARNING.search(line)]
    if lines:
        pytest.fail("the cell's output shows warnings (filter a benign one in mfsdp_kit/compat/patches/quiet.py, with its "
                    "reason; fix any other):\n" + "\n".join(lines[:10]), pytrace=False)
    return result
