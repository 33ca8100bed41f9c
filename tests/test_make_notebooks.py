"""The committed notebooks are what notebooks/make_notebooks.py writes: an edit made to one side only (a notebook
changed in JupyterLab, or the generator changed without re-running it) fails here, naming the notebook."""
import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(_generator().NOTEBOOKS))
def test_committed_notebook_is_the_generators(name):
    committed = (NOTEBOOKS / f"{name}.ipynb").read_text()
    assert nbformat.writes(_generator().build(name)) + "\n" == committed, (
        f"notebooks/{name}.ipynb differs from notebooks/make_notebooks.py's: edit the generator, then run "
        f"`python notebooks/make_notebooks.py {name}` and commit both")
