"""Stop, a stuck collective, a frozen rank and a long cell, on two real CPU engines (ipyparallel, gloo), the notebook
being this process: SIGINT to it is what Jupyter's Stop button sends a kernel.

- Stop during `train.fit`: every rank leaves at one step, one line says where, the History is kept, and the next
  cell's `fit(start_step=...)` gives the uninterrupted run's losses bit for bit;
- Stop in code that is not the kit's: KeyboardInterrupt on every rank, and the world still works;
- a second Stop while a rank waits in a collective aborts the world; `reinit` works;
- `if rank == 0: dist.barrier()`: named after stall_s with rank 0's stack, a new cell refused at once, `abort()`;
- a rank stopped by SIGSTOP is called frozen, with its stack;
- `handle.status()` and the per-rank log files.
The hang guards (BOUND_S) are far above the times printed (-s)."""
import os
import signal
import threading
import time

import pytest

from mfsdp_kit.notebook import cluster
from mfsdp_kit.notebook.cluster import ClusterError

STALL_S = 3.0
BOUND_S = 60
BUILD = '''
import torch.distributed as dist
from transformers import AutoTokenizer
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import data, fit

def build(workdir):
    """Megatron-FSDP on the tiny xs model, its optimizer, scheduler and batches: the same from the same seed."""
    cfg = EngineConfig(use_megatron_fsdp=True, seed=0)
    runtime.init(cfg)
    if rank == 0:
        tiny(f"{workdir}/xs", size="xs", seed=0)
    dist.barrier()
    tok = AutoTokenizer.from_pretrained(f"{workdir}/xs")
    model = load(f"{workdir}/xs", cfg)
    ocfg = OptimConfig(lr=3e-3, warmup_steps=10)
    opt = engine.build_optimizer(model.chunks, ocfg, cfg)
    sched = engine.build_scheduler(opt, ocfg, total_steps=100_000)
    pairs = data.ArithmeticTask(digits=1).train_pairs(90)
    return model, opt, sched, data.batches(pairs, tok, seq_len_tokens=16, global_batch=16, seed=1)
'''
FIT = "fit(model.chunks, opt, batches, micro_batch_size=8, scheduler=sched, progress=False, "


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    handle = cluster.start(2, stall_s=STALL_S, log_dir=str(tmp_path_factory.mktemp("logs")))
    handle.run(BUILD)
    yield handle
    handle.stop()


def stop_in(seconds: float) -> threading.Timer:
    """Press Stop (SIGINT to this process, the notebook) in `seconds`."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_stop_pauses_fit_at_one_step_and_the_next_cell_continues_bitwise(h, tmp_path, capsys):
    h.run(f"model, opt, sched, batches = build({str(tmp_path)!r})")
    stop_in(4.0)
    t0 = time.monotonic()
    h.run(f"history = {FIT}steps=100_000)", timeout_s=BOUND_S)   # returns: Stop is no error
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    at = h.view["history.stopped_at"]
    print(f"stopped at step {at} {took - 4.0:.2f} s after Stop")
    assert at[0] == at[1] and at[0] > 0, at
    assert f"train.fit: stopped at step {at[0]} of 100000 on every rank (History kept" in out, out
    assert h.view["len(history.loss)"] == at   # the steps done are kept
    n = at[0]
    h.run(f"rest = {FIT}start_step={n}, steps=5)")
    resumed = h.view["history.loss + rest.loss"]
    h.run(f"model, opt, sched, batches = build({str(tmp_path)!r})")
    h.run(f"straight = {FIT}steps={n + 5})")
    assert resumed[0] == h.view["straight.loss"][0] and resumed[0] == resumed[1]   # bitwise, as if never stopped


def test_stop_ends_an_rl_loop_between_two_iterations(h, capsys):
    stop_in(2.0)
    h.run("""
import time, torch
from mfsdp_kit.rl.grpo import GRPOHistory
from mfsdp_kit.rl.loop import run_iterations

def iteration(it):   # a collective in every iteration, as an RL update has
    x = torch.ones(1)
    dist.all_reduce(x)
    time.sleep(0.05)
    return {key: float(it) for key in vars(GRPOHistory())}

rl_history = run_iterations(iteration=iteration, iterations=100_000, history=GRPOHistory(), desc="grpo",
                            progress=False)
""", timeout_s=BOUND_S)
    n = h.view["len(rl_history.reward)"]
    assert n[0] == n[1] > 0 and f"grpo: stopped at step {n[0]} of 100000 on every rank" in capsys.readouterr().out


def test_stop_during_a_checkpoint_save_commits_the_step_first(h, tmp_path):
    h.run(f"""
import os, signal, torch
from mfsdp_kit.checkpoint import CheckpointManager

class PressesStop:   # the user's own state: Stop comes while the save collects it (an engine gets SIGINT)
    saving = True
    def state_dict(self):
        if self.saving:
            os.kill(os.getpid(), signal.SIGINT)
        return {{"x": torch.arange(4.0) + rank * 0}}
    def load_state_dict(self, sd):
        self.loaded = sd["x"].tolist()

ckpt = CheckpointManager({str(tmp_path / "ckpt")!r})
""")
    with pytest.raises(Exception) as err:
        h.run("ckpt.save(1, {'mine': PressesStop()})", timeout_s=BOUND_S)
    assert [e[0] for e in err.value.elist] == ["KeyboardInterrupt"] * 2, err.value
    assert "Stop came during a checkpoint save, which finished first" in str(err.value)
    h.run("mine = PressesStop()\nmine.saving = False\nmeta = ckpt.load({'mine': mine})")
    assert h.view["(ckpt.latest(), meta['step'], mine.loaded)"] == [(1, 1, [0.0, 1.0, 2.0, 3.0])] * 2


def test_stop_in_plain_code_is_keyboard_interrupt_on_every_rank(h, capsys):
    stop_in(1.5)
    with pytest.raises(KeyboardInterrupt):
        h.run("import time\nfor _ in range(600): time.sleep(0.1)", timeout_s=BOUND_S)
    assert "KeyboardInterrupt on every rank" in capsys.readouterr().err
    h.run("import torch\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)", timeout_s=BOUND_S)   # nothing broken
    assert [float(x) for x in h.view["x"]] == [3.0, 3.0]


def test_a_stuck_collective_is_named_with_its_stack_and_blocks_no_cell_silently(h, capsys):
    ar = h.view.execute("if rank == 0:\n    dist.barrier()", block=False)
    t0, err = time.monotonic(), ""
    while "Nothing is aborted" not in err and time.monotonic() - t0 < STALL_S + 2.5:   # the bound
        time.sleep(0.1)
        err += capsys.readouterr().err
    print(f"the stuck barrier was named {time.monotonic() - t0:.1f} s after the cell started (stall_s={STALL_S})")
    assert "rank 0: stuck in torch.distributed.barrier" in err and "rank 1: done" in err, err
    assert "if rank == 0:" not in err or "dist.barrier()" in err   # the cell's own line is in the stack
    assert h.status().ranks[0]["state"] == "stuck" and h.status().ranks[1]["state"] == "done"
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="the world is stuck"):
        h.run("y = 1")
    assert time.monotonic() - t0 < 5   # at once, not behind the stuck cell
    h.abort()
    ar.wait(BOUND_S)
    assert ar.ready()
    h.reinit()
    h.run("dist.barrier()", timeout_s=BOUND_S)


def test_a_second_stop_aborts_the_world_and_reinit_makes_it_usable(h, capsys):
    stop_in(1.0)
    stop_in(2.5)
    t0 = time.monotonic()
    h.run("if rank == 0:\n    dist.barrier()", timeout_s=BOUND_S)
    took = time.monotonic() - t0 - 2.5
    assert "Stop pressed twice" in capsys.readouterr().err
    with capsys.disabled():
        print(f"the cell returned {took:.2f} s after the second Stop")
    assert h.abort_reason == "Stop pressed twice"
    h.reinit()
    h.run("dist.barrier()", timeout_s=BOUND_S)


def test_status_and_logs_show_every_rank(h):
    h.run("from mfsdp_kit.notebook.progress import report\nprint(f'hello from rank {rank}')\n"
          "report(step=3, total=10, tokens_per_s=123.0)")
    time.sleep(1.5)   # a heartbeat
    status = h.status()
    assert [status.ranks[r]["progress"]["step"] for r in (0, 1)] == [3, 3]
    text = str(status)
    assert "3/10" in text and "123" in text and "idle" in text
    for rank in (0, 1):
        assert f"hello from rank {rank}" in open(h.logs[rank]).read()
        assert h.logs[rank] in text


def test_a_frozen_rank_is_called_frozen_with_its_stack(h, capsys):
    pid = h.idents[1]["pid"]
    ar = h.view.execute("import time\nwhile True:\n    dist.barrier()\n    time.sleep(0.01)", block=False)
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0, err = time.monotonic(), ""
        while "frozen" not in err and time.monotonic() - t0 < STALL_S + 3.0:
            time.sleep(0.1)
            err += capsys.readouterr().err
        print(f"the frozen rank was named {time.monotonic() - t0:.1f} s after SIGSTOP (stall_s={STALL_S})")
        assert "rank 1 (pid" in err and "frozen, not dead: its process is stopped (SIGSTOP" in err, err
        assert "rank 0: stuck in torch.distributed.barrier" in err
    finally:
        os.kill(pid, signal.SIGCONT)
    h.abort()
    ar.wait(BOUND_S)
    h.reinit()


def test_an_opt_in_timeout_aborts_the_world_and_reinit_works(h):
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="ran past timeout_s=2"):
        h.run("if rank == 0:\n    dist.barrier()", timeout_s=2)   # handle.run's own timeout
    assert time.monotonic() - t0 < BOUND_S and h.abort_reason.startswith("the cell ran past")
    h.reinit()
    h.cell_timeout_s = 2   # start(cell_timeout_s=2): every cell, %%px included
    try:
        ar = h.view.execute("if rank == 0:\n    dist.barrier()", block=False)
        ar.wait(BOUND_S)
        assert ar.ready() and h.abort_reason == "the cell ran past timeout_s=2 s"
    finally:
        h.cell_timeout_s = None
    h.reinit()
    h.run("dist.barrier()", timeout_s=BOUND_S)
