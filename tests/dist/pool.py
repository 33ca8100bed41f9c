"""A warm fork server for the multi-rank tests: run by launch.py as `python tests/dist/pool.py`.

The naive launcher, one torchrun per job, starts an agent and N fresh interpreters per job, and each
imports torch, megatron-core, Megatron-Bridge and transformers again: 3-5 s of a 2-core machine per
job, ~35 jobs a run. This process imports all of that (and every `scenarios*` module) once, then
forks each job's ranks from itself. A job is still N new processes with their own rendezvous,
process groups and memory; only the imported modules are shared, as they would be byte for byte.

What torchrun's agent does for a job is done here too: RANK/WORLD_SIZE/MASTER_* per rank, the first
rank to fail stops the others (SIGTERM, then SIGKILL), a timeout kills them all, and each rank's
output is kept in its own log for the failure message.

Protocol: one JSON job per line on stdin, one JSON reply per line on the original stdout
({"codes": [exit code per rank], "timed_out": bool}). Everything else this process prints goes to
stderr, so an import that prints cannot garble a reply.
"""
import atexit
import glob
import importlib
import json
import os
import random
import runpy
import signal
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
GRACE_S = 5.0
"""How long ranks get to exit after SIGTERM before SIGKILL (a rank blocked in a collective never will)."""


def preload() -> None:
    """Import what the ranks will import, so a fork inherits it. Scenarios import the kit lazily in
    places: name the heavy modules too."""
    from mfsdp_kit import compat
    compat.apply("startup")   # what runtime.init installs first, before these imports reach megatron
    for module in ("torch", "torch.distributed.checkpoint", "transformers", "mfsdp_kit", "mfsdp_kit.models.hf",
                   "mfsdp_kit.checkpoint", "mfsdp_kit.weights.sync", "mfsdp_kit.rl.grpo", "worker"):
        importlib.import_module(module)
    for path in sorted(glob.glob(os.path.join(HERE, "scenarios*.py"))):
        importlib.import_module(os.path.basename(path)[:-3])
    # fork() copies only the calling thread: a lock held by another thread would stay held in every rank
    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}"


def rank_main(*, rank: int, job: dict, reply_fd: int) -> None:
    """In the forked rank: become what torchrun would have started, run the scenario, exit. Never returns."""
    code = 1
    try:
        os.close(reply_fd)
        os.setpgid(0, 0)   # its own process group: a kill reaches what the rank started (compile workers, writers)
        die_with_parent()
        log = os.open(os.path.join(job["logdir"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                          WORLD_SIZE=str(job["nproc"]), LOCAL_WORLD_SIZE=str(job["nproc"]),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
        os.chdir(job["cwd"])
        random.seed()   # a fresh interpreter's seed, not the server's copy
        if "script" in job:
            run_script(job["script"], job["argv"])
        else:
            import worker
            worker.main(job["scenario"], job["kwargs"], job["out"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()   # what the interpreter's own exit would have run
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def run_script(script: str, argv: list) -> None:
    """`python SCRIPT ARGV...` as a user runs it: its own folder first on sys.path, not tests/dist, and
    none of the test modules importable by the name the server preloaded them under."""
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + [p for p in sys.path if p != HERE]
    for name in [n for n in sys.modules if n == "worker" or n.startswith("scenarios")]:
        del sys.modules[name]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def die_with_parent() -> None:
    """SIGKILL this rank when the server dies (Linux prctl PR_SET_PDEATHSIG): an interrupted pytest kills the
    server, and ranks in process groups of their own would otherwise outlive it, blocked in a collective."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the server's timeout still ends a hung job
        return
    if os.getppid() == 1:   # the server died before the prctl took effect
        os._exit(1)


def stop(pids, sig: int) -> None:
    """Signal each rank's process group."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait(pids: dict, timeout_s: float) -> dict:
    """Exit codes by rank (-N: killed by signal N), stopping the rest once one fails, as torchrun does."""
    codes, deadline, kill_at, timed_out = {}, time.monotonic() + timeout_s, None, False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        now = time.monotonic()
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and kill_at is None:
                stop([p for p in pids if pids[p] not in codes], signal.SIGTERM)
                kill_at = now + GRACE_S
            continue
        if now > deadline and not timed_out:
            timed_out, kill_at = True, now
        if kill_at is not None and now >= kill_at:
            stop([p for p in pids if pids[p] not in codes], signal.SIGKILL)
        time.sleep(0.02)
    stop(pids, signal.SIGKILL)   # anything a rank left running in its group
    return dict(codes=[codes[r] for r in range(len(pids))], timed_out=timed_out)


def serve() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # from here on, print() goes to stderr
    sys.path.insert(0, HERE)   # as for worker.py run as a script: scenarios import each other by bare name
    preload()
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in iter(sys.stdin.readline, ""):
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = {}
        for rank in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                rank_main(rank=rank, job=job, reply_fd=reply.fileno())
            try:
                os.setpgid(pid, pid)   # also here: a stop may come before the rank's own setpgid ran
            except OSError:   # it already has (or has already exited)
                pass
            pids[pid] = rank
        print(json.dumps(wait(pids, job["timeout_s"])), file=reply, flush=True)


if __name__ == "__main__":
    serve()
