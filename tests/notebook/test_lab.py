"""`make lab`'s server: loopback only, token required, stopped without leftovers."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from mfsdp_kit.notebook import lab
from tests import sockets

needs_lab = pytest.mark.skipif(shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None,
                               reason="jupyterlab not installed (make test and make lab install the `lab` extra)")


def test_tunnel_command_names_port_and_host():
    assert lab.tunnel_command(8890, user="ada", host="gpu7") == "ssh -N -L 8890:127.0.0.1:8890 ada@gpu7"


def test_missing_root_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="root="):
        lab.start(root=tmp_path / "nope")


@needs_lab
def test_server_needs_the_token_listens_on_loopback_and_stops_cleanly():
    server = lab.start()
    pid = server.process.pid
    try:
        assert server.api(token=server.token) == 200
        assert server.api() == 403                        # no token: refused
        assert server.api(token="not-the-token") == 403
        assert server.api("/api/contents", token=server.token) == 200  # the notebooks folder
        assert server.process.poll() is None
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        listening = {ip for ip, _ in sockets.listening(procs)}
        print("listening on", listening, "url", server.url.split("?")[0])
        assert listening == {"127.0.0.1"}
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert not [p for p in psutil.process_iter(["pid"]) if p.info["pid"] == pid and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(OSError):
        server.api(token=server.token, timeout_s=2)


@needs_lab
@pytest.mark.parametrize("quiet", [True, False])   # the server's log read, or (not kept) the port found held
def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(monkeypatch, quiet):
    """The race of picking a free port and binding it later: the first pick is held by someone else."""
    held = socket.create_server((lab.HOST, 0))
    taken = held.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(lab, "free_port", lambda host=lab.HOST: next(picks, None) or _bound_and_closed(host))
    try:
        with pytest.raises(RuntimeError, match=lab.PORT_TAKEN):   # a port the user names is not changed
            lab.start(port=taken)
        server = lab.start(quiet=quiet)
        try:
            assert server.port != taken and server.api(token=server.token) == 200
        finally:
            server.stop()
    finally:
        held.close()


def _bound_and_closed(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_the_notebooks_model_is_written_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setenv("MFSDP_KIT_CACHE", str(tmp_path))
    monkeypatch.setenv("MFSDP_MODEL", "xs")
    writer = lab.write_model_in_background()
    assert writer.wait(timeout=300) == 0
    assert [p.name for p in tmp_path.glob("tiny-qwen2-xs-*/model.safetensors")] == ["model.safetensors"]


def _command(p: psutil.Process) -> str:
    """`p`'s command line, or "" once it has exited (a zombie or gone: the server's short-lived helpers do)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _wait_for(what: str, ready, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := ready()):
            return value
        time.sleep(0.25)
    raise TimeoutError(what)


@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_make_lab_stops_its_server_and_kernels_on(sig, tmp_path):
    """Issue 36 case 8: SIGTERM (kill, a scheduler) or SIGHUP (a closed terminal) ended `python -m mfsdp_kit.notebook.lab`
    and left the server running, orphaned, port open and token valid. Here the launcher runs as `make lab` runs
    it, a kernel is started through the REST API, the signal is sent: no process of theirs is left."""
    out = tmp_path / "lab.log"
    env = {**os.environ, "MFSDP_MODEL": str(tmp_path), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    with open(out, "w") as log:   # an existing folder as the model: the background writer has nothing to write
        launcher = subprocess.Popen([sys.executable, "-m", "mfsdp_kit.notebook.lab", "--root", str(tmp_path)], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = _wait_for("the launcher's URL", lambda: re.search(r"http://127\.0\.0\.1:(\d+)/lab\?token=(\w+)",
                                                                   out.read_text()))
        port, token = url.group(1), url.group(2)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=json.dumps({}).encode(),
                                         method="POST", headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201
        tree = _wait_for("a kernel process", lambda: (t := psutil.Process(launcher.pid).children(recursive=True))
                         and any("ipykernel" in _command(p) for p in t) and t)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=60) == 0
        alive = psutil.wait_procs(tree, timeout=30)[1]
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [_command(p) for p in alive]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
