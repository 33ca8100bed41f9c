"""cache: where the kit keeps what it makes once (tiny models: tests/models/test_tiny.py), and engines' bytecode
kept where Python would otherwise recompile every module at every start."""
import os
import subprocess
import sys

from mfsdp_kit import cache


def test_root_follows_the_environment(tmp_path):
    assert cache.root({cache.CACHE_ENV: str(tmp_path)}) == tmp_path
    assert cache.root({}).parts[-2:] == (".cache", "mfsdp_kit")


def _package(root, name: str, *, compiled: bool):
    """A module `name` under root/src, with its bytecode beside it or not; root/src goes on sys.path."""
    src = root / "src"
    src.mkdir(exist_ok=True)
    (src / f"{name}.py").write_text("X = 1\n")
    if compiled:
        import py_compile
        py_compile.compile(str(src / f"{name}.py"), cfile=str(src / "__pycache__" / f"{name}.{sys.implementation.cache_tag}.pyc"))
    return src


def test_bytecode_env_steps_in_only_where_python_would_not_keep_bytecode(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_package(tmp_path, "kit_plain_mod", compiled=False)))
    _package(tmp_path, "kit_built_mod", compiled=True)
    off = {"PYTHONDONTWRITEBYTECODE": "1", cache.CACHE_ENV: str(tmp_path)}
    assert not cache.bytecode_is_kept(off, probe="kit_plain_mod") and cache.bytecode_is_kept({}, probe="kit_plain_mod")
    assert cache.bytecode_is_kept(off, probe="kit_built_mod")              # compiled at build time: read, not written
    assert cache.bytecode_env(off, probe="kit_built_mod") == {}
    assert cache.bytecode_env(off, probe="kit_plain_mod") == {"PYTHONDONTWRITEBYTECODE": "",
                                                              "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    off = {**off, "PYTHONPYCACHEPREFIX": ""}                                 # empty = unset
    assert cache.bytecode_env(off, probe="kit_plain_mod")["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    mine = {**off, "PYTHONPYCACHEPREFIX": "/my/prefix"}                    # the user's prefix is kept
    assert cache.bytecode_env(mine)["PYTHONPYCACHEPREFIX"] == "/my/prefix"
    assert cache.bytecode_env({**off, cache.BYTECODE_ENV: "0"}, probe="kit_plain_mod") == {}   # the opt-out
    assert cache.bytecode_env({"PYTHONPYCACHEPREFIX": "/my/prefix"}) == {}  # writing on, somewhere: fine as it is
    assert cache.bytecode_env(off, probe="no_such_module_xyz") == {}       # nothing to compile


def _python(env: dict, code: str, cwd) -> None:
    subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True)


def test_a_child_started_with_it_keeps_bytecode_that_it_otherwise_recompiles(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_package(tmp_path, "kit_probe_mod", compiled=False)))
    base = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "PYTHONDONTWRITEBYTECODE": "1",
            cache.CACHE_ENV: str(tmp_path / "cache")}
    base.pop("PYTHONPYCACHEPREFIX", None)
    _python(base, "import kit_probe_mod", tmp_path)
    assert list(tmp_path.rglob("*.pyc")) == []                              # compiled, then thrown away
    env = {**base, **cache.bytecode_env(base, probe="kit_probe_mod")}
    _python(env, "import kit_probe_mod", tmp_path)
    kept = list((tmp_path / "cache" / "pycache").rglob("kit_probe_mod*.pyc"))
    assert len(kept) == 1 and not (tmp_path / "src" / "__pycache__").exists()   # site-packages untouched
    code = "import kit_probe_mod, sys; print(sys.pycache_prefix)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "cache" / "pycache")
