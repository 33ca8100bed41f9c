"""Fixtures shared by test modules, and the `slow` mark for every test that starts processes."""
import pytest

STARTS_PROCESSES = ("launch", "cluster", "subprocess")
"""Module globals that mean its tests start processes: tests.dist.launch (gloo ranks), mfsdp_kit.notebook.cluster
(ipyparallel engines), subprocess (a script, a server, a browser)."""


def pytest_configure(config):
    """The process-wide installs `runtime.init` makes (compat.apply("startup")), before any test module imports megatron."""
    from mfsdp_kit import compat
    compat.apply("startup")


FIRST = ("tests/test_ui_live.py",)
"""Files started first: the longest (the browser check, ~60 s) would otherwise come last and leave one of make
test's workers running it alone at the end."""


def pytest_collection_modifyitems(items):
    """`make check` runs `-m "not slow"`: the tests that start no process. A module that starts processes
    (or a test that uses the engines' `handle`) is slow as a whole; pytest.ini's marker says so."""
    for item in items:
        if getattr(item, "module", None) is None:   # a notebook's cell (nbval), when make test collects notebooks/ too
            continue
        names = vars(item.module)
        bench = getattr(names.get("run"), "__module__", "") == "tests.bench.cli"
        if bench or "handle" in item.fixturenames or any(n in names for n in STARTS_PROCESSES):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))   # stable: the rest keep their order


@pytest.fixture(scope="module")
def handle():
    """Two CPU engines (ipyparallel, gloo) for one test module: started once, stopped after it."""
    from mfsdp_kit.notebook import cluster
    h = cluster.start(2)
    yield h
    h.stop()
