"""gpus.visible: the CUDA driver's GPU count without importing torch, torch's where there is no driver."""
import subprocess
import sys
import textwrap

import pytest
import torch

from mfsdp_kit.notebook import gpus

FAKE_DRIVER = """
int cuInit(unsigned int flags) {{ return {init}; }}
int cuDeviceGetCount(int *count) {{ *count = {count}; return 0; }}
"""


def fake_libcuda(tmp_path, *, init: int, count: int) -> str:
    """A shared library with the driver's two entry points, answering `init` and `count`."""
    src, lib = tmp_path / f"fake{init}_{count}.c", tmp_path / f"libcuda_fake{init}_{count}.so"
    src.write_text(FAKE_DRIVER.format(init=init, count=count))
    cc = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    if cc.returncode:
        pytest.skip(f"no C compiler to build a fake libcuda: {cc.stderr[-200:]}")
    return str(lib)


def test_the_drivers_answer_is_the_count(tmp_path):
    assert gpus.driver_count(fake_libcuda(tmp_path, init=0, count=3)) == 3
    assert gpus.driver_count(fake_libcuda(tmp_path, init=gpus.CUDA_ERROR_NO_DEVICE, count=3)) == 0
    assert gpus.driver_count(fake_libcuda(tmp_path, init=999, count=3)) is None     # another error: ask torch
    assert gpus.driver_count(str(tmp_path / "no-such-libcuda.so")) is None


def test_counting_through_the_driver_imports_no_torch(tmp_path):
    lib = fake_libcuda(tmp_path, init=0, count=2)
    code = textwrap.dedent(f"""
        import sys
        from mfsdp_kit import cluster, gpus, notebook_model
        assert gpus.driver_count({lib!r}) == 2
        assert "torch" not in sys.modules, "counting GPUs imported torch"
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_visible_equals_torchs_count():
    """On a GPU machine through the driver, elsewhere through torch: the same number torch gives."""
    assert gpus.visible() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
