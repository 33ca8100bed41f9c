"""`make lab`'s server: loopback only, token required, stopped without leftovers."""
import shutil
import sys
from pathlib import Path

import psutil
import pytest

from mfsdp_kit import lab

needs_lab = pytest.mark.skipif(shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None,
                               reason="jupyterlab not installed (make test and make lab install the `lab` extra)")


def test_tunnel_command_names_port_and_host():
    assert lab.tunnel_command(8890, user="ada", host="gpu7") == "ssh -N -L 8890:127.0.0.1:8890 ada@gpu7"


def test_missing_root_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="root="):
        lab.start(root=tmp_path / "nope")


def listening_ips(procs) -> set[str]:
    """Addresses the processes listen on; a child that exited since it was listed (the server runs short-lived
    helpers) listens on nothing."""
    ips = set()
    for p in procs:
        try:
            ips |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return ips


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
        listening = listening_ips([psutil.Process(pid), *psutil.Process(pid).children(recursive=True)])
        print("listening on", listening, "url", server.url.split("?")[0])
        assert listening == {"127.0.0.1"}
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert not [p for p in psutil.process_iter(["pid"]) if p.info["pid"] == pid and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(OSError):
        server.api(token=server.token, timeout_s=2)


def test_the_notebooks_model_is_written_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setenv("MFSDP_KIT_CACHE", str(tmp_path))
    monkeypatch.setenv("MFSDP_MODEL", "xs")
    writer = lab.write_model_in_background()
    assert writer.wait(timeout=300) == 0
    assert [p.name for p in tmp_path.glob("tiny-qwen2-xs-*/model.safetensors")] == ["model.safetensors"]
