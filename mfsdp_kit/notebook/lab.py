"""`make lab`: JupyterLab on the notebooks, reachable only through this machine's loopback.

A shared GPU node is not a laptop: a Jupyter server listening on the node's network address with
no token would hand a shell to anyone on the cluster network. So the server binds 127.0.0.1,
requires a random token (printed once, in the URL), and a user on another machine reaches it
through an SSH tunnel from their laptop, which this prints ready to paste:

    ssh -N -L 8888:127.0.0.1:8888 you@gpu-node      # then open the printed URL locally

`python -m mfsdp_kit.notebook.lab [--port P] [--root DIR]` runs it in the foreground, and writes the notebooks' model
meanwhile (once per machine). The server runs in a session of its own (a Ctrl-C meant for a notebook's kernel
must not reach it), so nothing stops it when the launcher ends: the launcher stops it, and every kernel it
started, on Ctrl-C (SIGINT), `kill` / a scheduler's time limit / systemd (SIGTERM) and a closed terminal or SSH
session (SIGHUP); else the server lives on, orphaned, its port open and its token valid.
`start(...)` / `LabServer.stop()` start and stop the server from Python (the tests use them).
"""
from __future__ import annotations

import argparse
import getpass
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import cache
from . import model as notebook_model
from ..config import bad_value
from ..distributed import ports

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2] / "notebooks"


def free_port(host: str = HOST) -> int:
    """A port for the server: `ports.unclaimed` (below the ephemeral range, so rarely taken before jupyter binds it)."""
    return ports.unclaimed(host)


def tunnel_command(port: int, *, user: str | None = None, host: str | None = None) -> str:
    """The line a user runs on their own machine to reach this server through SSH."""
    return f"ssh -N -L {port}:{HOST}:{port} {user or getpass.getuser()}@{host or socket.gethostname()}"


@dataclass
class LabServer:
    """A running JupyterLab: its process, port and token."""

    process: subprocess.Popen
    port: int
    token: str
    root: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/lab?token={self.token}"

    def api(self, path: str = "/api/status", *, token: str | None = None, timeout_s: float = 5.0) -> int:
        """HTTP status of a GET on the server's REST API (with `token`, or none)."""
        headers = {"Authorization": f"token {token}"} if token else {}
        request = urllib.request.Request(f"http://{HOST}:{self.port}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    def stop(self, *, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group (it shuts its kernels down), then SIGKILL; then every process the
        server had started that still runs: jupyter_client starts each kernel in a session of its own, which the
        group's signal does not reach."""
        import psutil
        if self.process.poll() is not None:
            return
        try:
            started = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for how in ("terminate", "kill"):
            started = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            for p in started:
                try:
                    getattr(p, how)()
                except psutil.NoSuchProcess:
                    pass
            started = psutil.wait_procs(started, timeout=timeout_s / 3)[1]


def command(*, port: int, token: str, root: Path) -> list[str]:
    """The jupyter-lab command line: loopback only, token required, no browser, `root` as the tree."""
    exe = shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) or shutil.which("jupyter-lab")
    if exe is None:
        raise bad_value("jupyterlab", None, "installed: `make lab` installs the kit's `lab` extra "
                        "(pip install -e '.[lab]')")
    # Root in a container (CI, many GPU images) is refused unless allowed; the token still guards it.
    as_root = ["--allow-root"] if os.geteuid() == 0 else []
    return [exe, "--no-browser", f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}", "--ServerApp.allow_remote_access=False", *as_root]


PORT_TAKEN = "is not available"
"""What jupyter-server logs when its port is taken (it is started with port_retries=0; only a quiet server's log is
kept for the error)."""


def start(*, port: int | None = None, root: Path | str = ROOT, timeout_s: float = 60.0, quiet: bool = True,
          env: dict[str, str] | None = None) -> LabServer:
    """Start JupyterLab in its own process group and wait until its API answers; returns the server.
    `port`: None picks a free one, and picks again, twice at most, if it was taken before the server bound it.
    `env`: variables added to this process's environment for the server (e.g. JUPYTERLAB_SETTINGS_DIR)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise bad_value("root", str(root), "an existing directory (the notebooks folder by default)")
    tries = 1 if port else 3
    for attempt in range(1, tries + 1):
        pick = port or free_port()
        try:
            return _start_on(pick, root=root, timeout_s=timeout_s, quiet=quiet, env=env)
        except RuntimeError as err:   # it exited before serving: its log says why, or the port is held now
            taken = PORT_TAKEN in str(err) or not ports.is_free(HOST, pick)
            if attempt == tries or not taken:
                raise


def _start_on(port: int, *, root: Path, timeout_s: float, quiet: bool, env: dict[str, str] | None) -> LabServer:
    token = secrets.token_hex(24)
    log = tempfile.TemporaryFile() if quiet else None  # the server's own log, for the error below
    proc = subprocess.Popen(command(port=port, token=token, root=root), stdout=log, stderr=log,
                            start_new_session=True, cwd=root,
                            env={**os.environ, **cache.bytecode_env(), **(env or {}),   # kernels keep bytecode
                                 **notebook_model.pinned({**os.environ, **(env or {})})})  # and find MFSDP_MODEL
    server = LabServer(process=proc, port=port, token=token, root=root)
    deadline = time.monotonic() + timeout_s
    try:   # whatever ends the wait (a signal too), the server does not outlive it
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = ""
                if log is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"jupyter lab exited with code {proc.returncode} before serving on port {port}:\n{tail}")
            try:
                if server.api(token=token, timeout_s=1.0) == 200:
                    return server
            except OSError:
                pass
            time.sleep(0.25)
    except BaseException:
        server.stop()
        raise
    server.stop()
    raise TimeoutError(f"jupyter lab did not answer on {HOST}:{port} within timeout_s={timeout_s}")


def write_model_in_background() -> subprocess.Popen:
    """The notebooks' model (`notebook_model.main`: the knob's choice, a tiny size written once per machine) in
    its own process while the user opens the URL, so the first notebook's first cell finds it written. Its one
    line of output (folder, or the error) lands in this terminal; the notebook reports the same error if any."""
    return subprocess.Popen([sys.executable, "-m", "mfsdp_kit.notebook.model"], start_new_session=True,
                            env={**os.environ, **cache.bytecode_env()})


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C; kill, a batch scheduler's time limit, systemd; a closed terminal or SSH session."""


class Stopped(SystemExit):
    """Raised in the launcher by a STOP_SIGNALS signal, so its `finally` stops the server."""


def _stop(signum: int, frame) -> None:
    raise Stopped(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--root", default=str(ROOT), help="folder the file browser opens (default: notebooks/)")
    args = parser.parse_args(argv)
    for sig in STOP_SIGNALS:   # SIGTERM and SIGHUP would end the launcher at once, SIGINT may be ignored (`&`)
        signal.signal(sig, _stop)
    server = start(port=args.port, root=args.root, quiet=False)
    write_model_in_background()
    print(f"\nJupyterLab on {server.root}:\n  {server.url}\n"
          f"From another machine, first run there:\n  {tunnel_command(server.port)}\n"
          "then open the URL above. Ctrl-C stops the server.\n", flush=True)
    try:
        server.process.wait()
    except Stopped:
        pass
    finally:
        for sig in STOP_SIGNALS:   # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    main()
