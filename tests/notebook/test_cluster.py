"""cluster.start on 2 CPU engines: one world, stable ranks, a named dead rank, nothing left running."""
import json
import os
import signal
import stat
import time

import psutil
import pytest

from mfsdp_kit.notebook import cluster
from mfsdp_kit.notebook.cluster import ClusterError
from mfsdp_kit.config import ConfigError, EngineConfig


def _engine_processes():
    """ipyparallel engines and controllers that are children of this test process."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "ipyparallel" in cmd or "ipengine" in cmd or "ipcontroller" in cmd:
            procs.append(p)
    return procs


def test_all_reduce_of_rank_plus_one(handle):
    handle.run("import torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
    assert [float(x) for x in handle.view["x"]] == [3.0, 3.0]
    assert handle.view["rank"] == [0, 1] and handle.view["world_size"] == [2, 2]
    assert "ranks=[0, 1]" in repr(handle) and "backend='gloo'" in repr(handle)
    # local engines run the kit's engine, spawned before the controller (launch.start_processes)
    assert list(handle.startup_s)[1:3] == ["engines_spawn", "controller"], handle.startup_s


def test_engines_split_the_cores_between_them(handle):
    """Each engine's torch runs this machine's cores / engines intra-op threads (launch.engine_threads_env), not
    every core each: 2 CPU engines on 2 cores ran 4 spinning threads, 5x slower."""
    threads = handle.apply(lambda: __import__("torch").get_num_threads())
    want = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert threads == [int(want)] * 2


def test_engine_threads_leave_a_users_setting_alone(monkeypatch):
    from mfsdp_kit.notebook import launch
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.engine_threads_env(2, 2) == {"OMP_NUM_THREADS": "1"}
    assert launch.engine_threads_env(4, 2) == {"OMP_NUM_THREADS": "1"}
    assert launch.engine_threads_env(2, 16) == {"OMP_NUM_THREADS": "8"}
    mine = {"config": {"LocalEngineSetLauncher": {"environment": {"OMP_NUM_THREADS": "3"}}}}
    c = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, launcher=mine)
    assert c.config.LocalEngineSetLauncher.environment["OMP_NUM_THREADS"] == "3"   # the caller's config wins
    monkeypatch.setenv("OMP_NUM_THREADS", "5")   # the engines inherit the kernel's own
    assert launch.engine_threads_env(2, 2) == {}


def test_default_bind_address_and_connection_file_permissions(handle):
    files = handle.connection_files
    assert any(f.endswith("-client.json") for f in files) and any(f.endswith("-engine.json") for f in files)
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        if "ipcontroller" in path:
            with open(path) as f:
                info = json.load(f)
            assert info["interface"] == "tcp://127.0.0.1" and info["key"], path
    assert handle.init_kwargs["master_addr"] == "127.0.0.1"


def test_progress_report_reaches_the_client(handle):
    def steps(n):
        from mfsdp_kit.notebook.cluster import report
        for i in range(n):
            report(step=i + 1, total=n, loss=1.0 / (i + 1))
        return n
    results, panel = cluster.run_with_progress(handle, steps, 3)
    assert results == [3, 3]
    assert panel.last[1]["step"] == 3 and "loss=0.3333" in panel.text(1)
    cluster.report(step=1, total=1)   # off an engine: a no-op


def test_dead_engine_names_its_rank_and_restart_keeps_ranks(handle):
    ranks_before = handle.ranks
    pid_of_rank1 = handle.apply(os.getpid)[1]
    pending = handle.view.execute("import time; time.sleep(30)", block=False)
    os.kill(pid_of_rank1, signal.SIGKILL)
    with pytest.raises(ClusterError, match=r"rank 1 .*died.*restart\(\)"):
        handle.wait(pending, timeout_s=20)
    old_engines = set(handle.rank_of)
    handle.restart()
    assert handle.ranks == ranks_before and not old_engines & set(handle.rank_of)
    handle.run("import torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
    assert [float(x) for x in handle.view["x"]] == [3.0, 3.0]
    assert handle.view["rank"] == ranks_before


def test_more_engines_than_gpus_raises_before_starting_anything():
    before = {p.pid for p in _engine_processes()}
    with pytest.raises(ClusterError, match="n=3 engines.*2 GPUs"):
        cluster.start(3, device_count=2)
    with pytest.raises(ClusterError, match="backend='mpi' is not allowed"):
        cluster.start(2, backend="mpi")
    assert {p.pid for p in _engine_processes()} == before


def test_start_checks_gpu_only_options_against_the_devices_its_engines_get():
    gpu_only = EngineConfig(override_ddp_config={"num_distributed_optimizer_instances": 2})   # DDP's: a CUDA stream
    before = {p.pid for p in _engine_processes()}
    with pytest.raises(ConfigError, match="DDP without a GPU"):
        cluster.start(2, cfg=gpu_only, device="cpu")
    with pytest.raises(ClusterError, match="n=4 engines.*1 GPUs"):   # past the cfg check: these engines get GPUs
        cluster.start(4, cfg=gpu_only, device_count=1)
    assert {p.pid for p in _engine_processes()} == before


def test_cpu_engines_see_no_gpu_on_any_machine_and_keep_it_across_restart():
    """device="cpu": more engines than GPUs is allowed (a 2-rank world on a node with one GPU), each engine's CUDA
    driver sees no device, so torch trains on the CPU over gloo; restart() spawns the same kind of engine."""
    before = {p.pid for p in _engine_processes()}
    h = cluster.start(2, device="cpu", device_count=1)
    try:
        check = "import os, torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\n" \
                "seen = (os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.is_available())"
        for restarted in (False, True):
            if restarted:
                h.restart()
            h.run(check)
            assert [float(x) for x in h.view["x"]] == [3.0, 3.0]
            assert h.view["seen"] == [("", False)] * 2 and h.devices == ["cpu", "cpu"] and h.backend == "gloo"
    finally:
        h.stop()
    psutil.wait_procs([p for p in _engine_processes() if p.pid not in before], timeout=10)
    assert {p.pid for p in _engine_processes() if p.is_running()} <= before


KERNEL = """
import json, os, sys, time
from mfsdp_kit import cluster
h = cluster.start(2, device="cpu")   # any node: the subject is the processes, not the device
print(json.dumps(h.apply(os.getpid)), flush=True)
h.view.execute("import torch.distributed as dist\\nif rank == 0: dist.barrier()", block=False)   # rank 0 waits
time.sleep(600)
"""


def test_engines_and_controller_exit_when_the_kernel_that_started_them_is_killed():
    """A kernel killed mid-cell (no stop(), no atexit): its engines must not outlive it, not even rank 0, stuck in a
    collective whose peer will never come (ipyparallel's heartbeat check cannot run under it), and neither may its
    controller with the hub's schedulers (ipcontroller.py)."""
    import subprocess
    import sys
    import time
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(kernel.stdout.readline())
        engines = [psutil.Process(pid) for pid in pids]
        assert all(e.ppid() == kernel.pid for e in engines)   # spawned by the kernel itself
        time.sleep(1.0)                                      # rank 0 is inside the barrier by now
    finally:
        spawned = psutil.Process(kernel.pid).children(recursive=True)   # engines, the controller and its children
        commands = {p.pid: " ".join(p.cmdline()[1:3]) for p in spawned}
        kernel.kill()
        kernel.wait()
    assert "-m mfsdp_kit.notebook.ipcontroller" in commands.values(), commands
    alive = psutil.wait_procs(spawned, timeout=15)[1]
    for p in alive:   # nothing may be left running after this test, whatever it asserts
        p.kill()
    assert not alive, f"{[commands[p.pid] for p in alive]} outlived their kernel"


def test_the_parent_watch_notices_a_launcher_that_died_before_it_started(monkeypatch):
    """The launcher's pid comes from $MFSDP_KIT_PARENT_PID: a process whose launcher is already gone (here: a pid
    that is not its parent) is orphaned from the start, and the watch must say so at once, not wait forever."""
    import threading

    from mfsdp_kit.notebook import ipengine
    orphaned = threading.Event()
    monkeypatch.setenv(ipengine.PARENT_ENV, str(os.getppid() + 1_000_000))   # no process has this pid
    ipengine.watch_parent(poll_s=0.01, on_orphan=orphaned.set)
    assert orphaned.wait(5)
    monkeypatch.setenv(ipengine.PARENT_ENV, str(os.getppid()))                # the real launcher: no call
    quiet = threading.Event()
    ipengine.watch_parent(poll_s=0.05, on_orphan=quiet.set)   # lives on, a daemon thread polling getppid()
    assert not quiet.wait(0.3)


def test_the_kits_controller_is_the_default_only_for_a_local_controller_whose_command_the_caller_left_alone():
    from traitlets.config import Config

    from mfsdp_kit.notebook import launch
    from mfsdp_kit.notebook.ipcontroller import CONTROLLER_CMD
    default = {}
    launch.set_default_controller_cmd(default)
    assert default["config"].LocalControllerLauncher.controller_cmd == CONTROLLER_CMD
    assert default["config"].LocalControllerLauncher.environment == {"MFSDP_KIT_PARENT_PID": str(os.getpid())}
    own = {"config": Config({"LocalControllerLauncher": {"controller_cmd": ["my-ipcontroller"]}})}
    launch.set_default_controller_cmd(own)
    assert own["config"].LocalControllerLauncher.controller_cmd == ["my-ipcontroller"]
    elsewhere = {"controller": "slurm"}
    launch.set_default_controller_cmd(elsewhere)
    assert elsewhere == {"controller": "slurm"}


def test_hiding_gpus_adds_to_the_callers_engine_environment_without_changing_it():
    from traitlets.config import Config

    from mfsdp_kit.notebook import launch
    mine = Config()
    mine.LocalEngineSetLauncher.environment = {"MY_VAR": "1"}
    c = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, launcher=dict(config=mine), see_gpus=False)
    env = c.config.LocalEngineSetLauncher.environment
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["MY_VAR"] == "1"
    assert mine.LocalEngineSetLauncher.environment == {"MY_VAR": "1"}
    shown = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, launcher={})
    assert "CUDA_VISIBLE_DEVICES" not in shown.config.LocalEngineSetLauncher.get("environment", {})


SITE_PROFILE = """
c = get_config()
c.Cluster.engine_launcher_class = "ipyparallel.cluster.launcher.MPIEngineSetLauncher"
c.Cluster.controller_args = ["--site-arg"]
c.Cluster.delay = 2.5
c.LocalControllerLauncher.controller_cmd = ["site-ipcontroller"]
c.MPIEngineSetLauncher.engine_cmd = ["site-ipengine"]
"""


def _profile(tmp_path, text: str) -> str:
    (tmp_path / "ipcluster_config.py").write_text(text)
    return str(tmp_path)


def test_a_profiles_ipcluster_config_is_kept_where_the_caller_sets_nothing(tmp_path):
    """A site's profile (ipcluster_config.py) wins over the kit's defaults; the caller's arguments and config win
    over the profile (ipyparallel's order); load_profile=False leaves the profile out."""
    from traitlets.config import Config

    from mfsdp_kit.notebook import launch
    where = _profile(tmp_path, SITE_PROFILE)
    launcher = launch.with_profile({"profile_dir": where})
    assert launch.kind(launcher) == "mpi"   # from the profile: the device="cpu" check and MPI's env follow it
    c = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, launcher=launcher)
    assert c.config.MPIEngineSetLauncher.engine_cmd == ["site-ipengine"] and c.delay == 2.5
    assert c.config.LocalControllerLauncher.controller_cmd == ["site-ipcontroller"]
    assert c.controller_args == [*launch.CONTROLLER_ARGS, "--site-arg"]
    assert c.config.MPIEngineSetLauncher.environment == launch.openmpi_env()
    mine = Config({"LocalControllerLauncher": {"controller_cmd": ["my-ipcontroller"]}})
    c = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, launcher=launch.with_profile(
        {"profile_dir": where, "engines": "local", "config": mine, "controller_args": ["--mine"]}))
    assert c.config.LocalControllerLauncher.controller_cmd == ["my-ipcontroller"]
    assert c.config.LocalEngineSetLauncher.engine_cmd == launch.ENGINE_CMD
    assert c.controller_args == [*launch.CONTROLLER_ARGS, "--mine"]
    assert launch.kind(launch.with_profile({"profile_dir": where, "load_profile": False})) == "local"
    with pytest.raises(ConfigError, match="^device="):
        cluster.start(2, device="cpu", profile_dir=_profile(tmp_path, 'c = get_config()\n'
                                                            'c.Cluster.engine_launcher_class = "slurm"'))


GENERAL_PROFILE = """
c = get_config()
c.EngineLauncher.engine_cmd = ["site-ipengine"]            # a parent class: every engine launcher
c.ControllerLauncher.controller_cmd = ["site-ipcontroller"]
c.LocalProcessLauncher.environment = {"SITE": "1"}
c.LocalEngineSetLauncher.environment.update({"LAZY": "2"})  # traitlets' lazy values, as profiles often write them
c.Cluster.controller_args.append("--site-arg")
"""


def test_a_profile_that_sets_parent_classes_or_lazy_values_counts_too(tmp_path):
    from ipyparallel.cluster.launcher import LocalControllerLauncher, LocalEngineSetLauncher

    from mfsdp_kit.notebook import launch
    c = launch.make_cluster(n=2, ip="127.0.0.1", timeout_s=5, see_gpus=False,
                            launcher={"profile_dir": _profile(tmp_path, GENERAL_PROFILE)})
    engines, controller = LocalEngineSetLauncher(config=c.config), LocalControllerLauncher(config=c.config)
    assert engines.engine_cmd == ["site-ipengine"] and controller.controller_cmd == ["site-ipcontroller"]
    assert {"SITE": "1", "LAZY": "2", "CUDA_VISIBLE_DEVICES": ""}.items() <= engines.environment.items()
    assert controller.environment == {"SITE": "1"}
    assert c.controller_args == [*launch.CONTROLLER_ARGS, "--site-arg"]


def test_engines_and_controller_from_the_profile_form_the_world(tmp_path):
    """A profile that names ipyparallel's own engine and controller: the kit starts those, and they form a world."""
    where = _profile(tmp_path, "import sys\nc = get_config()\n"
                     "c.LocalEngineSetLauncher.engine_cmd = [sys.executable, '-m', 'ipyparallel.engine']\n"
                     "c.LocalControllerLauncher.controller_cmd = [sys.executable, '-m', 'ipyparallel.controller']\n")
    before = {p.pid for p in _engine_processes()}   # the shared cluster's, when it runs
    h = cluster.start(2, device="cpu", profile_dir=where)
    try:
        h.run("import torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
        assert [float(x) for x in h.view["x"]] == [3.0, 3.0]
        commands = [" ".join(p.cmdline()) for p in _engine_processes() if p.pid not in before]
        assert sum("-m ipyparallel.engine" in cmd and "nanny" not in cmd for cmd in commands) == 2, commands
        assert any("-m ipyparallel.controller" in cmd for cmd in commands), commands
        assert not [cmd for cmd in commands if "mfsdp_kit.notebook.ip" in cmd], commands
    finally:
        h.stop()


def test_engines_not_up_in_time_raise_and_leave_nothing():
    before = {p.pid for p in _engine_processes()}
    with pytest.raises(ClusterError, match="timeout_s"):
        cluster.start(2, timeout_s=0.01)
    psutil.wait_procs([p for p in _engine_processes() if p.pid not in before], timeout=10)
    assert {p.pid for p in _engine_processes() if p.is_running()} <= before


STALLS = {   # a step of forming a world, code that makes one engine (by rank) never finish it, where it then is
    "leaving the old world": (1, "import time; time.sleep(600)", "in <module>"),   # an endless cell
    "asking the engines who they are": (1, "import socket, time; socket.gethostname = lambda: time.sleep(600)",
                                        "in identity"),
    "reserving rank 0's rendezvous port": (0, "import socket, time; socket.create_server = lambda *a, **k: "
                                              "time.sleep(600)", "in reserve"),
}


@pytest.mark.parametrize("step", STALLS)
def test_a_world_whose_engine_never_answers_fails_reinit_in_time_and_restart_recovers(step):
    """Every step of forming a world is bounded by the start's timeout_s: an engine that never answers one (busy with
    an endless cell, a hostname lookup that hangs, a bind that hangs) fails reinit naming the step, instead of
    hanging the notebook, and shows where each engine is (stacks.py); restart then rebuilds the world with the same
    ranks."""
    rank, stall, where = STALLS[step]
    h = cluster.start(2, device="cpu", timeout_s=8)
    try:
        h.client[h.engine_of[rank]].execute(stall, block=step != "leaving the old world")
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=f"^{step}: no answer within timeout_s=8") as err:
            h.reinit()
        assert time.monotonic() - t0 < 30   # unbounded, it waited for the stalled engine: 600 s
        stuck = str(err.value).split("where the engines are:\n")[1]
        assert stuck.count("engine pid") == 2 and where in stuck, stuck
        if step == "asking the engines who they are":   # failed midway through: the handle still restarts
            h.restart()
            h.run("import torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
            assert h.ranks == [0, 1] and [float(x) for x in h.view["x"]] == [3.0, 3.0]
    finally:
        h.stop()


def test_runtime_before_start_says_to_start():
    from mfsdp_kit.distributed import runtime
    if not runtime.is_initialized():
        with pytest.raises(RuntimeError, match=r"cluster.start\(\)"):
            runtime.current()


def test_ranks_from_launcher_env_win_over_engine_ids():
    idents = {7: dict(host="a", env_rank=1, env_local_rank=1), 9: dict(host="a", env_rank=0, env_local_rank=0)}
    assert cluster.assign_ranks(idents) == {7: (1, 1), 9: (0, 0)}
    local = {4: dict(host="a", env_rank=None, env_local_rank=None), 2: dict(host="b", env_rank=None, env_local_rank=None),
             3: dict(host="a", env_rank=None, env_local_rank=None)}
    assert cluster.assign_ranks(local) == {2: (0, 0), 3: (1, 0), 4: (2, 1)}


def test_zz_stop_leaves_no_engine_processes(handle):
    """Runs last (file order): stop the shared cluster; no engine or controller may survive it."""
    assert _engine_processes(), "the shared cluster should be running before stop()"
    handle.stop()
    psutil.wait_procs(_engine_processes(), timeout=10)
    assert not [p for p in _engine_processes() if p.is_running()]


def _changed_after_made(**fields) -> EngineConfig:
    """A config made right, then changed (EngineConfig names a bad value when made: issue 51); start re-checks it."""
    cfg = EngineConfig()
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


@pytest.mark.parametrize("kwargs,field", [
    (dict(n=0), "n"), (dict(n=True), "n"), (dict(backend="mpi"), "backend"), (dict(timeout_s=-1), "timeout_s"),
    (dict(device_count=-1), "device_count"), (dict(device="gpu"), "device"),
    (dict(device="cpu", backend="nccl"), "backend"), (dict(device="cpu", engines="slurm"), "device"),
    (dict(n=2, cfg=_changed_after_made(seed="abc")), "seed"),
    (dict(n=3, cfg=EngineConfig(tensor_model_parallel_size=2)), "world_size")])
def test_bad_start_arguments_are_config_errors_before_anything_starts(kwargs, field):
    before = {p.pid for p in _engine_processes()}
    with pytest.raises(ConfigError, match=rf"^{field}=") as e:
        cluster.start(**kwargs)
    assert isinstance(e.value, ValueError) and "allowed" in str(e.value)
    assert {p.pid for p in _engine_processes()} == before


def test_engines_preload_where_there_are_cores_for_it():
    """launch.preload_by_default: 4 cores per engine or more; local engines run the kit's engine either way
    (without the import thread below that), MPI ones only with it; a caller's engine_cmd always wins."""
    from traitlets.config import Config

    from mfsdp_kit.notebook import ipengine, launch
    assert launch.preload_by_default(n_engines=2, cores=32) and launch.preload_by_default(n_engines=8, cores=32)
    assert not launch.preload_by_default(n_engines=2, cores=2) and not launch.preload_by_default(n_engines=9, cores=32)
    launcher = {}
    launch.set_default_engine_cmd(launcher)
    local = launcher["config"].LocalEngineSetLauncher
    assert local.engine_cmd == launch.ENGINE_CMD and local.delay == 0
    assert ipengine.PRELOAD_ENV not in local.environment and local.environment[ipengine.WAIT_ENV] == "120"
    few_cores = {}
    launch.set_default_engine_cmd(few_cores, preload=False, connection_wait_s=30)
    local = few_cores["config"].LocalEngineSetLauncher
    assert local.engine_cmd == launch.ENGINE_CMD and local.environment[ipengine.WAIT_ENV] == "30"
    if ipengine.PRELOAD_ENV not in os.environ:
        assert local.environment[ipengine.PRELOAD_ENV] == "0"
    mine = {"engines": "mpi", "config": Config({"MPIEngineSetLauncher": {"engine_cmd": ["my-engine"]}})}
    launch.set_default_engine_cmd(mine)
    assert mine["config"].MPIEngineSetLauncher.engine_cmd == ["my-engine"]
    for other in ({"engines": "slurm"}, {"engines": "mpi"}):
        launch.set_default_engine_cmd(other, preload=False)
        assert "config" not in other


def test_engines_keep_their_bytecode_where_the_image_switches_it_off(tmp_path, monkeypatch):
    """A container image's PYTHONDONTWRITEBYTECODE=1 made every engine recompile torch and megatron at each start."""
    from mfsdp_kit import cache
    from mfsdp_kit.notebook import launch
    (tmp_path / "kit_engine_probe.py").write_text("X = 1\n")   # stands in for the image's uncompiled torch
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cache, "PROBE_MODULE", "kit_engine_probe")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    launcher = {}
    launch.set_default_engine_cmd(launcher)
    env = launcher["config"].LocalEngineSetLauncher.environment
    assert env["PYTHONDONTWRITEBYTECODE"] == "" and env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")


def test_engine_reads_the_connection_file_only_once_it_is_whole(tmp_path):
    """The controller creates its file, then writes it: an engine spawned before it must not read it half-done."""
    import threading

    from mfsdp_kit.notebook import ipengine
    path = ipengine.connection_file(str(tmp_path), "abc")
    assert path == str(tmp_path / "security" / "ipcontroller-abc-engine.json")
    (tmp_path / "security").mkdir()
    open(path, "w").close()   # created, not yet written

    def write():
        with open(path, "w") as f:
            f.write(json.dumps({"key": "k", "registration": 1234}))
    timer = threading.Timer(0.1, write)
    timer.start()
    assert ipengine.wait_for_connection_info(path, timeout_s=10)["registration"] == 1234
    timer.join()
    with pytest.raises(TimeoutError, match="did not arrive"):
        ipengine.wait_for_connection_info(str(tmp_path / "missing.json"), timeout_s=0.05)


def test_a_kernel_without_torch_starts_engines_then_imports_it_meanwhile(tmp_path):
    """As on a GPU node, where the driver answers the GPU count: the notebook's kernel has not imported torch when
    `start()` spawns the engines, and has it (from the background import) by the time `start()` returns."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sys
        from mfsdp_kit import cluster, gpus
        gpus.driver_count = lambda lib="libcuda.so.1": 0    # a driver that sees no GPU: no torch needed to say so
        assert gpus.visible() == 0 and "torch" not in sys.modules
        handle = cluster.start(2)
        try:
            assert "torch" in sys.modules     # begun during start(), which the kernel did not ask for
            import torch   # waits for the background import if it is still running
            handle.run("import torch, torch.distributed as dist\\nx = torch.tensor([rank + 1.0])\\ndist.all_reduce(x)")
            assert [float(x) for x in handle.view["x"]] == [3.0, 3.0] and handle.backend == "gloo"
        finally:
            handle.stop()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
