"""Fixtures shared by test modules."""
import pytest


@pytest.fixture(scope="module")
def handle():
    """Two CPU engines (ipyparallel, gloo) for one test module: started once, stopped after it."""
    from mfsdp_kit import cluster
    h = cluster.start(2)
    yield h
    h.stop()
