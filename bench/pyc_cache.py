"""Is bytecode cached where the image keeps its packages (an import that finds no .pyc and cannot write one
compiles every module, every time), and what CUDA costs an engine before its first kernel: gpu_check's pyc_cache
section (SECTIONS=imports)."""
import importlib.util, os, subprocess, sys, time
for name in ("sympy", "torch", "megatron.core", "ipyparallel"):
    spec = importlib.util.find_spec(name)
    d = os.path.dirname(spec.origin)
    cached = importlib.util.cache_from_source(spec.origin)
    print(f"{name:14} {d}  writable={os.access(d, os.W_OK)}  pyc={os.path.exists(cached)}")
def t(env=None):
    t0 = time.perf_counter(); subprocess.run([sys.executable, "-c", "import sympy"], env={**os.environ, **(env or {})}); return time.perf_counter() - t0
print("import sympy, s:", [round(t(), 2) for _ in range(2)],
      "with PYTHONPYCACHEPREFIX:", [round(t({"PYTHONPYCACHEPREFIX": "/tmp/pyc"}), 2) for _ in range(3)])
# what CUDA costs an engine before its first kernel: driver init, the device's context, cuBLAS
import torch
t0 = time.perf_counter(); torch.cuda.init(); t1 = time.perf_counter()
torch.cuda.set_device(0); t2 = time.perf_counter()
x = torch.ones(64, 64, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
(x @ x).sum().item(); t4 = time.perf_counter()
print(f"cuda init {t1 - t0:.3f} s, set_device {t2 - t1:.3f} s, first tensor {t3 - t2:.3f} s, first matmul {t4 - t3:.3f} s")
