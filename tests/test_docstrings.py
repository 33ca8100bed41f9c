"""Docstrings state contracts, not measurements: no device name, no milliseconds or microseconds, no bandwidth or
FLOP rate in any docstring of the package outside perf/ (which measures, and says on what). Such figures go stale
where a reader takes them for the contract; they live in docs/benchmarks.md with their device and date, and a
docstring may point at the section by name. Comments may keep figures. Config fields meet a stricter rule
(tests/perf/test_options.py). Checked from source with `ast`: every string-expression statement (module, class,
function and attribute docstrings)."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mfsdp_kit"
MEASURES = ("perf",)
"""Subpackages whose docstrings may carry figures: they are the benchmarks' own code."""

FIGURE = re.compile(
    r"\b(?:[ABHL]\d{2,3}[A-Z]?|GB\d00|GH200|MI\d{3}X?|RTX ?\d{4}|V100|T4)\b"  # a device: H100, H200s, A100, L40S, ...
    r"|\d ?(?:ms|µs|us|ns|(?:milli|micro|nano)seconds?)\b"                  # a time below a second
    r"|\b[KMGTP]i?B/s\b|\b[GTP]FLOP/?s\b",                                   # a bandwidth or a FLOP rate
    re.IGNORECASE)
"""What a measured figure looks like in a docstring."""

def figures(source: str, name: str) -> list[str]:
    """'name:line: text' for every docstring line of `source` that carries a figure, in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += [(node.lineno + i, line.strip()) for i, line in enumerate(node.value.value.splitlines())
                      if FIGURE.search(line)]
    return [f"{name}:{line}: {text}" for line, text in sorted(found)]


def modules() -> dict[str, Path]:
    """The package's modules to check, by path relative to the package."""
    top = ROOT / PACKAGE
    return {p.relative_to(top).as_posix(): p for p in sorted(top.rglob("*.py"))
            if p.relative_to(top).parts[0] not in MEASURES}


def test_the_pattern_catches_a_planted_figure():
    planted = ('"""Fast.\n\nMeasured on 2 H200s: 1.88 ms a step, 5.27 GB/s, ~80 TFLOP/s; on an A100, 40 us."""\n'
               'def f():\n    """Took 3.5ms on 1 L40S."""\n'
               'LIMIT = 1\n"""A field: 2 GiB/s at most (1 H100)."""\n'
               '"""Contract only: returns bytes, seconds and gb_per_s; a few times faster; 1.37 B params, 16 B/param;\n'
               'H2D copies, an L2 hit, sm90, 2 GiB, 3.4 s, tokens/s."""\n')
    assert figures(planted, "x.py") == [
        "x.py:3: Measured on 2 H200s: 1.88 ms a step, 5.27 GB/s, ~80 TFLOP/s; on an A100, 40 us.",
        "x.py:5: Took 3.5ms on 1 L40S.", "x.py:7: A field: 2 GiB/s at most (1 H100)."]


def test_no_measured_figure_in_a_docstring():
    checked = modules()
    assert len(checked) > 100 and "__init__.py" in checked  # the scan sees the package
    found = [f for name, path in checked.items() for f in figures(path.read_text(), name)]
    assert not found, ("measured figures in docstrings (state the contract; put the figure, with its device, in "
                       "docs/benchmarks.md and point at its section):\n" + "\n".join(found))
