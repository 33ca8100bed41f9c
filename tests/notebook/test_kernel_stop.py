"""Stop and a stuck collective as a notebook user meets them: a real Jupyter kernel driven through jupyter_client the
way JupyterLab's buttons drive it (execute a cell, `interrupt_kernel()` for Stop), running 02_sft's own cells on two
CPU engines.

- Stop during a long `%%px` fit: the cell ends "ok" with one line naming the step every rank stopped at; the History
  is kept on every rank; the next cell continues training from there; Stop during the notebook's own
  `run_with_panel` cell does the same.
- `if rank == 0: dist.barrier()`: the cell names rank 0's collective and stack after stall_s, Stop once waits, Stop
  twice aborts the world, `handle.reinit()` makes it usable.
"""
import json
import queue
import time
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 5
BOUND_S = 240   # a hang guard for one cell; the times measured are printed (-s)


class Kernel:
    """One kernel, its cells run one at a time; each cell's stdout, stderr, errors and reply status collected."""

    def __init__(self, cwd: Path):
        self.km, self.kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", cwd=str(cwd))

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, *, until: str | None = None, timeout_s: float = BOUND_S) -> dict:
        """The cell's output until it is idle (or, with `until`, until that text shows in its stdout/stderr)."""
        out = dict(stdout="", stderr="", errors=[], idle=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["errors"].append(f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                out["idle"] = True
                reply = self.kc.get_shell_msg(timeout=10)
                out["status"] = reply["content"]["status"]
                return out
            if until is not None and until in out["stdout"] + out["stderr"]:
                return out
        raise AssertionError(f"no end of the cell within {timeout_s} s: {out}")

    def run(self, code: str) -> dict:
        out = self.collect(self.submit(code))
        assert out["status"] == "ok", out
        return out

    def stop(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def cells_of(notebook: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / notebook).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.stop()


def test_stop_during_fit_pauses_every_rank_and_the_next_cell_continues(kernel):
    setup, recipe, _, prepare_ddp, panel_ddp = cells_of("02_sft.ipynb")[:5]
    for cell in (setup, recipe, "%%px\nseed = 0\nmodel, opt, sched, batches = prepare(fsdp=True, seed=seed)"):
        kernel.run(cell)
    msg = kernel.submit("%%px\nhistory = fit(model.chunks, opt, batches, steps=5000, micro_batch_size=micro_batch_size, "
                        "scheduler=sched, progress=False)")
    time.sleep(8)
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()   # the Stop button
    out = kernel.collect(msg)
    print(f"the fit cell returned {time.monotonic() - t0:.2f} s after Stop: {out['stdout'].strip()}")
    assert out["status"] == "ok" and not out["errors"], out
    line = [x for x in out["stdout"].splitlines() if "stopped at step" in x]
    assert len(line) == 1 and "of 5000 on every rank (History kept" in line[0], out
    n = int(line[0].split("stopped at step ")[1].split()[0])
    kernel.run(f"%%px\nassert history.stopped_at == len(history.loss) == {n}")
    kernel.run(f"%%px\nrest = fit(model.chunks, opt, batches, start_step={n}, steps=3, "
               "micro_batch_size=micro_batch_size, scheduler=sched, progress=False)\nassert len(rest.loss) == 3")
    # the notebook's own training cell (run_with_panel: handle.wait), stopped the same way
    msg = kernel.submit(panel_ddp.replace("steps=steps", "steps=5000"))
    time.sleep(5)
    kernel.km.interrupt_kernel()
    out = kernel.collect(msg)
    assert out["status"] == "ok" and "stopped at step" in out["stdout"] and not out["errors"], out
    kernel.run("%%px\nassert history.stopped_at == len(history.loss) > 0")
    kernel.run("handle.stop()")


def test_a_stuck_collective_is_named_then_stop_twice_aborts_and_reinit_works(kernel):
    kernel.run(f"from mfsdp_kit import cluster\nhandle = cluster.start(2, stall_s={STALL_S})")
    t0 = time.monotonic()
    msg = kernel.submit("%%px\nimport torch.distributed as dist\nif rank == 0:\n    dist.barrier()")
    out = kernel.collect(msg, until="Nothing is aborted", timeout_s=STALL_S + 30)
    print(f"the stuck barrier was named {time.monotonic() - t0:.1f} s after the cell started")
    assert "rank 0: stuck in torch.distributed.barrier" in out["stderr"] and "rank 1: done" in out["stderr"], out
    assert "dist.barrier()" in out["stderr"]   # rank 0's stack holds the cell's line
    kernel.km.interrupt_kernel()   # Stop: rank 0 cannot leave its barrier ...
    time.sleep(3)
    kernel.km.interrupt_kernel()   # ... Stop again: abort the world
    rest = kernel.collect(msg)
    assert "Stop pressed twice" in rest["stderr"], rest
    kernel.run("handle.reinit()")
    kernel.run("%%px\ndist.barrier()")
    kernel.run("handle.stop()")
