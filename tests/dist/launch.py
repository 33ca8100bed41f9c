"""Run a scenario on N gloo ranks and return rank 0's result dict.

Scenarios are functions in tests/dist/scenarios*.py taking keyword arguments and returning a
JSON-able dict (rank 0's is kept). Each call is a fresh set of processes, as a user's job is:
forked from one warm server per pytest run (pool.py, which has the imports done), or, with
`torchrun=True`, started by torchrun (for what tests torchrun itself: its agent store, its sockets).
A rank that fails fails the call with every failed rank's output, its traceback included.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PORT_TAKEN = ("EADDRINUSE", "Address already in use")
"""What a launch's output says when the free port was taken between `free_port` and the bind."""
VOLATILE = ("PYTEST_CURRENT_TEST",)
"""Environment that changes per test but is read by nobody at import: it does not need a new server."""


def free_port() -> int:
    """A port free on 127.0.0.1 now, from this pytest-xdist worker's own slice of the ports below the kernel's
    ephemeral range. A port the kernel hands out for a bind to port 0 (the naive way) can be handed out again to
    anything else binding to 0 before our subprocess binds it: another worker's store, a gloo pair. A test failed so
    (EADDRINUSE, 2026-12-05). Below the ephemeral range nothing draws by chance, and the workers' slices are
    disjoint."""
    from mfsdp_kit.distributed import ports
    for port in _ports:
        if ports.is_free("127.0.0.1", port):   # else held by someone: the next one
            return port
    raise RuntimeError("no free port in this worker's slice")


def _worker_ports():
    """This worker's slice of the ports below the ephemeral range (`ports.unclaimed`'s range), walked in a cycle
    from a random place."""
    import itertools
    import random
    from mfsdp_kit.distributed import ports
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (ports.ephemeral_start() - ports.LOWEST) // workers
    mine = list(range(ports.LOWEST + worker * size, ports.LOWEST + (worker + 1) * size))
    start = random.randrange(len(mine))
    return itertools.islice(itertools.cycle(mine[start:] + mine[:start]), 2 * len(mine))


_ports = _worker_ports()


def run(scenario: str, *, nproc: int = 2, timeout_s: float = 600, torchrun: bool = False, **kwargs) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = dict(scenario=scenario, kwargs=kwargs, out=str(out))
        ok, log = _launch(_torchrun if torchrun else _forked, job, nproc=nproc, timeout_s=timeout_s, env=env,
                          tmp=Path(tmp))
        if not ok or not out.exists():
            raise AssertionError(f"{scenario} failed {log}")
        return json.loads(out.read_text())


def run_script(script: Path, *argv: str, nproc: int, timeout_s: float, env: dict, cwd: Path) -> tuple[bool, str]:
    """`torchrun --nproc_per_node NPROC SCRIPT ARGV...` from `cwd`, its ranks forked from the warm server:
    (every rank exited 0, the failed ranks' output)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(script=str(script), argv=list(argv), cwd=str(cwd))
        return _launch(_forked, job, nproc=nproc, timeout_s=timeout_s, env=env, tmp=Path(tmp))


def _launch(launcher, job: dict, **kwargs) -> tuple[bool, str]:
    ok, log = launcher(job, **kwargs)
    if not ok and any(s in log for s in PORT_TAKEN):   # the free port was taken meanwhile: once more
        ok, log = launcher(job, **kwargs)
    return ok, log


def _torchrun(job: dict, *, nproc, timeout_s, env, tmp) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "--master_addr=127.0.0.1",
           str(HERE / "worker.py"), job["scenario"], json.dumps(job["kwargs"]), job["out"]]
    code, out, err = run_group(cmd, timeout_s=timeout_s, env=env)
    why = f"timed out after {timeout_s:g} s, " if code is None else ""
    return code == 0, f"({why}rc={code}):\n{out[-4000:]}\n{err[-8000:]}"


def run_group(cmd: list[str], *, timeout_s: float, env: dict) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of `cmd`, run in a session of its own with its output in files (a process it
    leaves behind cannot hold a pipe open). Past `timeout_s` it, every process under it and every process left in
    its session (torchrun's ranks, a cluster's controller and engines) are SIGKILLed, and the code is None, with
    what it printed until then (a hung run shows how far it got)."""
    import psutil
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill([proc, *psutil.Process(proc.pid).children(recursive=True)])
            proc.wait()
        _kill([p for p in psutil.process_iter() if _session(p.pid) == proc.pid])   # left the tree, not the session
        out.seek(0), err.seek(0)
        return code, out.read(), err.read()


def _kill(procs: list) -> None:
    """SIGKILL each of `procs` (psutil or Popen processes) still there."""
    import psutil
    for p in procs:
        try:
            p.kill()
        except (psutil.Error, OSError):
            pass


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:   # gone meanwhile
        return None


def _forked(job: dict, *, nproc, timeout_s, env, tmp) -> tuple[bool, str]:
    r = _server(env).submit(dict(job, nproc=nproc, timeout_s=timeout_s, logdir=str(tmp), port=free_port(),
                                 env=env, cwd=job.get("cwd", os.getcwd())), timeout_s=timeout_s + 60)
    logs = [_read(tmp / f"rank{rank}.log") for rank in range(nproc)]
    failed = [rank for rank, code in enumerate(r["codes"]) if code != 0]
    shown = failed or list(range(nproc))   # the failed ranks' tracebacks; all ranks' output if none failed
    why = f"timed out after {timeout_s:g} s, " if r["timed_out"] else ""
    text = "".join(f"\n--- rank {rank} (exit {r['codes'][rank]}) ---\n{logs[rank][-6000:]}" for rank in shown)
    return not failed and not r["timed_out"], f"({why}rc={r['codes']}):{text}"


def _read(log: Path) -> str:
    """A rank's output; empty when it was stopped before it opened its log."""
    return log.read_text(errors="replace") if log.exists() else ""


class _Server:
    """pool.py as a child of this process, for one environment (imports read it, so a change needs a new one)."""

    def __init__(self, key: frozenset, env: dict):
        self.key = key
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "pool.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True)
        self.read(timeout_s=600)   # {"ready": pid}: the imports are done

    def submit(self, job: dict, *, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s=timeout_s)

    def read(self, *, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            self.stderr.seek(0)
            raise AssertionError(f"tests/dist/pool.py stopped answering:\n{self.stderr.read()[-6000:].decode()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()   # its loop ends at EOF
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_current: _Server | None = None


def _server(env: dict) -> _Server:
    global _current
    key = frozenset((k, v) for k, v in env.items() if k not in VOLATILE)
    if _current is not None and (_current.key != key or _current.proc.poll() is not None):
        _current.close()
        _current = None
    if _current is None:
        _current = _Server(key, env)
    return _current


atexit.register(lambda: _current and _current.close())
