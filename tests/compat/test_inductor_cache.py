"""compat.patches.inductor_cache: a graph compiled at the native CPU capability is not reused under
ATEN_CPU_CAPABILITY=default (torch's cache key misses it; the reuse failed to compile in `make test`)."""
import os
import subprocess
import sys

from mfsdp_kit import compat
from mfsdp_kit.compat.patches import inductor_cache

ROW_MAX = """
import os, sys, torch
from mfsdp_kit import compat; compat.apply("startup")  # what runtime.init does first
f = torch.compile(lambda x: x.amax(-1))
x = torch.arange(256 * 512, dtype=torch.float32).reshape(256, 512)
assert torch.equal(f(x), x[:, -1]), "wrong row max"
print(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
"""


def test_native_and_default_capability_share_no_compiled_graph(tmp_path):
    """The same graph compiled at both capabilities in one fresh TMPDIR: the default run's cache is its own
    folder. The two runs go side by side (each a cold compile, ~20 s; together they use both cores of a
    2-core CI box); the folder's name is what decides, so the order adds nothing a broken patch would pass."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)   # inductor's default cache folder lives under it: a fresh one
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"   # compile in the process: no worker pool to start for one kernel
    procs = [subprocess.Popen([sys.executable, "-c", ROW_MAX], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for e in (env, {**env, "ATEN_CPU_CAPABILITY": "default"})]
    (native_out, native_err), (default_out, default_err) = [p.communicate(timeout=600) for p in procs]
    assert procs[0].returncode == 0, native_err[-3000:]
    assert procs[1].returncode == 0, default_err[-3000:]
    native = tmp_path / os.path.basename(inductor_cache.cache_dir("x"))[:-2]   # inductor's own folder, no capability
    assert native_out.split()[-1] == str(native)
    assert default_out.split()[-1] == f"{native}_default"


def test_install_keeps_a_cache_dir_the_user_chose(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")
    assert compat.apply("inductor_cache") is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compat.apply("inductor_cache").endswith("_avx2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compat.apply("inductor_cache") is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_still_needed():
    assert inductor_cache.still_needed(), "torch's inductor cache mentions ATEN_CPU_CAPABILITY now: check " \
        "whether it keys on it, and delete compat/patches/inductor_cache.py if so"
