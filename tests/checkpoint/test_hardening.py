"""Checkpoint hardening, one test per case, mirroring mfsdp_kit/checkpoint/:

trust      a `.metadata` pickle never runs (even trusted); another user's checkpoint is refused
save       never writes through a planted symlink, nor into a root others could have written; never backwards
integrity  flipped bytes / truncated shards name the file; fallback to the newest intact one;
           a model that does not fit fails before any tensor is read; an HF folder that lacks a tensor
collective every rank raises the same error at once; a failed save leaves nothing behind

The collective cases run in one 2-rank launch (`faults`); the rest run in this process on copies
of its checkpoints (the checks that refuse them need no model).
"""
import json
import os
import pickle
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint.restore import checked
from tests.dist import launch
from tests.small_state import Small as SmallState

NOBODY = 65534


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    """A 16 MiB tmpfs to fill up (root only); None elsewhere."""
    where = tmp_path_factory.mktemp("tmpfs")
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)]).returncode:
        yield None
        return
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="module")
def faults(tmp_path_factory, tmpfs):
    root = tmp_path_factory.mktemp("faults") / "ckpt"
    result = launch.run("scenarios_ckpt_hardening:faults", nproc=2, root=str(root), tmpfs=tmpfs and str(tmpfs))
    return dict(result, root=root)


@pytest.fixture
def step1(faults, tmp_path):
    """A private copy of the intact step 1 (root 0700, as pytest makes it), latest -> it."""
    root = tmp_path / "ckpt"
    root.mkdir()
    shutil.copytree(faults["root"] / "step_000001", root / "step_000001")
    (root / "latest").write_text("step_000001\n")
    return root


def _payload_pickle(flag: Path) -> bytes:
    """A pickle that, when loaded with pickle.load, creates `flag`."""
    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(flag)!r}, 'w').close()",)
    return pickle.dumps(Payload())


def _rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a file and record its new checksum in meta.json, as an attacker who knows the format would."""
    (step_dir / name).chmod(0o644)
    (step_dir / name).write_bytes(data)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["checksums"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    meta[ckpt.integrity.DIGEST] = ckpt.integrity.seal(meta)   # the attacker knows that format too
    (step_dir / "meta.json").chmod(0o644)
    (step_dir / "meta.json").write_text(json.dumps(meta))


# ---- trust ------------------------------------------------------------------------------------
def test_metadata_payload_never_runs_even_when_trusted(step1, tmp_path):
    flag = tmp_path / "PWNED"
    _rewrite(step1 / "step_000001", ".metadata", _payload_pickle(flag))
    for trust in (False, True):
        with pytest.raises(ckpt.CheckpointError, match=r"\.metadata was refused: global builtins\.exec is not allowed"):
            ckpt.CheckpointManager(step1).load([], trust_checkpoint=trust)
    assert not flag.exists()


def test_another_users_checkpoint_is_refused(faults):
    """Issue 18 case 1: root world-writable; uid 65534 adds step_000099 (0755, theirs) with a pickled
    payload in .metadata and points `latest` at it. Every load is refused and the payload never runs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user (setpriv)")
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        base.chmod(0o755)
        root, flag = base / "ckpt", base / "PWNED"
        shutil.copytree(faults["root"] / "step_000001", root / "step_000001")
        (root / "latest").write_text("step_000001\n")
        root.chmod(0o777)
        _attack_as_nobody(root, flag)
        assert (root / "step_000099").stat().st_uid == NOBODY and (root / "latest").stat().st_uid == NOBODY
        mgr = ckpt.CheckpointManager(root)
        with pytest.raises(ckpt.CheckpointError, match=rf"{root} is writable by group or others \(mode drwxrwxrwx\)"):
            mgr.load([])
        root.chmod(0o755)  # the owner closes the root; what the attacker left stays theirs
        with pytest.raises(ckpt.CheckpointError, match=rf"{root / 'latest'} is owned by uid 65534 \(nobody\), not by you"):
            mgr.load([])
        with pytest.raises(ckpt.CheckpointError, match=rf"{root / 'step_000099'} is owned by uid 65534"):
            mgr.load([], step=99)
        with pytest.raises(ckpt.CheckpointError, match=r"\.metadata was refused: global builtins\.exec"):
            mgr.load([], trust_checkpoint=True)
        assert not flag.exists()
    finally:
        shutil.rmtree(base)


ATTACK = """
import hashlib, json, os, pickle, shutil, sys, zlib
root, flag = sys.argv[1], sys.argv[2]
step, good = os.path.join(root, "step_000099"), os.path.join(root, "step_000001")
os.mkdir(step, 0o755)
for name in os.listdir(good):
    if name.endswith(".distcp") or name == "scheduler.json":
        shutil.copy(os.path.join(good, name), step)
class Payload:
    def __reduce__(self):
        return exec, ("open(%r, 'w').close()" % flag,)
data = pickle.dumps(Payload())
open(os.path.join(step, ".metadata"), "wb").write(data)
meta = json.load(open(os.path.join(good, "meta.json")))
meta["step"] = 99
meta["checksums"][".metadata"] = {"bytes": len(data), "crc32": "%08x" % zlib.crc32(data)}
del meta["meta_sha256"]
meta["meta_sha256"] = hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
json.dump(meta, open(os.path.join(step, "meta.json"), "w"))
open(os.path.join(root, "latest.new"), "w").write("step_000099\\n")
os.replace(os.path.join(root, "latest.new"), os.path.join(root, "latest"))
"""


def _attack_as_nobody(root: Path, flag: Path) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                    "-c", ATTACK, str(root), str(flag)], check=True, cwd=root.parent, capture_output=True)


def test_group_writable_root_and_latest_refused(step1):
    step1.chmod(0o775)
    with pytest.raises(ckpt.CheckpointError, match=rf"{step1} is writable by group or others"):
        ckpt.CheckpointManager(step1).load([])
    with pytest.raises(ckpt.CheckpointError, match=rf"{step1} is writable by group"):
        checked(step1 / "step_000001", trust_checkpoint=False)  # the root of a step directory is its parent
    step1.chmod(0o755)
    (step1 / "latest").chmod(0o666)
    with pytest.raises(ckpt.CheckpointError, match=rf"{step1 / 'latest'} is writable by group or others"):
        ckpt.CheckpointManager(step1).load([])


# ---- save -------------------------------------------------------------------------------------
def Small(value: float = 1.0):   # noqa: N802 (a state class's name): six elements here
    return SmallState(value, size=6)


@pytest.fixture
def outside(tmp_path):
    """A file and a folder outside the checkpoint root, standing in for files only root may write."""
    out = tmp_path / "outside"
    (out / "dir").mkdir(parents=True)
    (out / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (out / "dir" / "keep").write_text("keep")
    return out


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


# name planted in the root as a symlink -> (what it points to, in `outside`; does the save go through?)
PLANTED = {"latest.tmp": ("passwd", True), ".probe-PID": ("passwd", True), "latest": ("passwd", False),
           ".tmp-step_000002": ("dir", False), "step_000002": ("dir", False)}


@pytest.mark.parametrize("name", PLANTED)
def test_save_never_follows_a_planted_symlink(tmp_path, outside, name):
    """Issue 36 case 1: each name a save writes, planted as a symlink to a file or folder outside the root.
    Either the save goes on under a fresh name (the link is never followed) or it is refused, naming the link;
    nothing outside the root changes, and `latest` is never left a link."""
    root = tmp_path / "ckpt"
    mgr = ckpt.CheckpointManager(root)
    mgr.save(1, {"s": Small(1.0)})
    before = _files(outside)
    link = root / name.replace("PID", str(os.getpid()))
    link.unlink(missing_ok=True)
    link.symlink_to(outside / PLANTED[name][0])
    if PLANTED[name][1]:
        mgr.save(2, {"s": Small(2.0)})
        assert (root / "latest").read_text() == "step_000002\n" and not (root / "latest").is_symlink()
        loaded = Small(0.0)
        mgr.load({"s": loaded})
        assert torch.equal(loaded.w, torch.full((6,), 2.0))
    else:
        with pytest.raises(ckpt.CheckpointError, match=rf"{link} is a symlink to '{outside / PLANTED[name][0]}'"):
            mgr.save(2, {"s": Small(2.0)})
        assert link.is_symlink() and mgr.list() == ([1] if name != "latest" else [1])
    assert _files(outside) == before
    assert not [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".probe-", ".latest-"))
                and not p.is_symlink()]


def test_save_refuses_a_root_others_could_write(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o755)
    root.chmod(0o777)
    with pytest.raises(ckpt.CheckpointError, match=rf"{root} is writable by group or others \(mode drwxrwxrwx\): "
                                                   r"whoever can write there can plant symlinks.*chmod go-w it"):
        ckpt.CheckpointManager(root).save(1, {"s": Small()})
    assert list(root.iterdir()) == []
    root.chmod(0o1777)  # sticky, like /tmp: others cannot replace what you own there
    ckpt.CheckpointManager(root).save(1, {"s": Small()})
    root.chmod(0o777)
    ckpt.CheckpointManager(root).save(2, {"s": Small()}, trust_checkpoint=True)  # you trust who can write there
    assert ckpt.CheckpointManager(root).list() == [1, 2]


def test_save_refuses_another_users_root_and_a_linked_root(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(real)
    with pytest.raises(ckpt.CheckpointError, match=rf"{linked} is a symlink to '{real}'.*Pass the real path \({real}\)"):
        ckpt.CheckpointManager(linked).save(1, {"s": Small()})
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the root to another user")
    os.chown(real, NOBODY, NOBODY)
    with pytest.raises(ckpt.CheckpointError, match=rf"{real} is owned by uid 65534 \(nobody\), not by you"):
        ckpt.CheckpointManager(real).save(1, {"s": Small()})
    assert list(real.iterdir()) == []


def test_saving_below_latest_needs_allow_backwards(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt")
    mgr.save(5, {"s": Small(5.0)})
    with pytest.raises(ckpt.CheckpointError, match=r"step 3 is lower than the latest checkpoint's \(5.*allow_backwards=True"):
        mgr.save(3, {"s": Small(3.0)})
    assert mgr.list() == [5] and mgr.latest() == 5
    mgr.save(3, {"s": Small(3.0)}, allow_backwards=True)
    assert mgr.list() == [3, 5] and mgr.latest() == 3


# ---- contained: a load reads only files meta.json lists, each with its checksum ------------------
@pytest.fixture
def small(tmp_path):
    """(step folder of Small(1.0) at step 1, a copy of its shard outside the root holding Small(7.0)'s bytes)."""
    step = ckpt.CheckpointManager(tmp_path / "ckpt").save(1, {"s": Small(1.0)})
    other = ckpt.CheckpointManager(tmp_path / "other").save(1, {"s": Small(7.0)})
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "secret.distcp"
    shutil.copy(other / "__0_0.distcp", secret)
    return step, secret


def _load_small(step: Path, **kw) -> Small:
    loaded = Small(0.0)
    ckpt.CheckpointManager(step.parent).load({"s": loaded}, **kw)
    return loaded


@pytest.mark.parametrize("where", ["dotdot", "absolute", "listed_dotdot"])
def test_metadata_storage_path_outside_the_step_is_refused(small, where):
    """Issue 36 case 2: `.metadata` built from allowed classes only, each item's file set to `../../outside/...` or
    an absolute path (and, for listed_dotdot, that path added to meta.json with its checksum too)."""
    step, secret = small
    rel = "../../outside/secret.distcp" if where != "absolute" else str(secret)
    from mfsdp_kit.checkpoint.trust import load_metadata
    metadata = load_metadata(step / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = rel
    _rewrite(step, ".metadata", pickle.dumps(metadata))
    if where == "listed_dotdot":
        meta = json.loads((step / "meta.json").read_text())
        meta["files"].append(rel)
        meta["checksums"][rel] = ckpt.integrity.file_checksum(secret)
        meta[ckpt.integrity.DIGEST] = ckpt.integrity.seal(meta)
        (step / "meta.json").write_text(json.dumps(meta))
    expected = (rf"lists the file '{rel}', which is not a plain file name" if where == "listed_dotdot"
                else rf"\.metadata stores s\.w in '{rel}', not in a shard file meta\.json lists")
    for trust in (False, True):
        loaded = Small(0.0)
        with pytest.raises(ckpt.CheckpointError, match=expected):
            ckpt.CheckpointManager(step.parent).load({"s": loaded}, trust_checkpoint=trust)
        assert torch.equal(loaded.w, torch.zeros(6))   # nothing read


def test_symlinked_shard_is_refused_trusted_or_not(small):
    step, secret = small
    shard = step / "__0_0.distcp"
    shutil.copy(shard, secret)   # the same bytes: its checksum matches
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(ckpt.CheckpointError, match=rf"{shard} is a symlink to '{secret}' \(resolves to {secret}\): "
                                                   r"the kit never loads through a symlink.*replace the link"):
        _load_small(step)
    with pytest.raises(ckpt.CheckpointError, match=rf"{shard} is a symlink to '{secret}'"):
        _load_small(step, trust_checkpoint=True)


def test_checkpoint_without_checksums_loads_only_when_trusted(small):
    """Issue 36 case 3: deleting meta.json's `checksums` key switched the check off (damaged bytes loaded)."""
    step, secret = small
    shard = step / "__0_0.distcp"
    shard.chmod(0o644)
    shard.write_bytes(secret.read_bytes())   # Small(7.0)'s bytes where Small(1.0)'s were saved
    meta = json.loads((step / "meta.json").read_text())
    del meta["checksums"]
    meta[ckpt.integrity.DIGEST] = ckpt.integrity.seal(meta)
    (step / "meta.json").chmod(0o644)
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"records no checksums \(format 4 always records them: the key "
                                                   r"was removed after the save\).*trust_checkpoint=True"):
        _load_small(step)
    with pytest.warns(UserWarning, match="records no checksums"):
        assert torch.equal(_load_small(step, trust_checkpoint=True).w, torch.full((6,), 7.0))   # you said so


# ---- integrity --------------------------------------------------------------------------------
def test_flipped_bytes_name_the_file(step1):
    shard = step1 / "step_000001" / "__1_0.distcp"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has crc32 \w+, \w+ was saved.*checkpoint {step1 / 'step_000001'} is damaged"):
        ckpt.CheckpointManager(step1).load([])


def test_truncated_shard_names_the_file(step1):
    shard = step1 / "step_000001" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has {size - 1000} bytes, {size} were saved"):
        ckpt.CheckpointManager(step1).load([])


def test_checksums_recorded_and_timed(faults):
    """Every file has its checksum and the hashing its own phase; what it costs is bench/checkpoint.py's
    to measure (a share of wall time asserted here would fail on a loaded machine, not on slow code)."""
    meta = json.loads((faults["root"] / "step_000001" / "meta.json").read_text())
    assert meta["format"] == 4 and set(meta["checksums"]) == set(meta["files"]) >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    phases = faults["save"]["phases_s"]
    print("save", round(faults["save"]["save_s"], 3), "s; phases", {k: round(v, 4) for k, v in phases.items()},
          "; bytes", meta["bytes"])
    assert 0 < phases["checksum"] and 0 < faults["save"]["save_s"]


def test_damaged_newest_falls_back_when_asked(faults):
    d = faults["damaged"]
    assert d["same"] and d["type"] == "CheckpointCorruptError", d
    assert "__1_0.distcp has crc32" in d["message"] and "step_000002 is damaged" in d["message"]
    assert d["message"].startswith("checking checkpoint")   # found by the checks, before DCP read any tensor
    f = faults["fallback"]
    assert f["step"] == 1 and f["loaded_step"] == 1 and [s["step"] for s in f["fallback_from"]] == [2]
    assert f["warnings"] and "loaded checkpoint" in f["warnings"][0] and "step_000002" in f["warnings"][0]
    assert f["resumed"] == f["straight"]  # the fallback checkpoint really loaded


@pytest.mark.parametrize("case", ["one_layer", "narrower_mlp"])
def test_model_that_does_not_fit_fails_before_reading(faults, case):
    r = faults["does_not_fit"][case]
    print(case, r["message"])
    assert r["same"] and r["type"] == "CheckpointError" and r["untouched"], r
    assert "does not fit this model (nothing was read)" in r["message"]
    if case == "one_layer":  # 2-layer checkpoint, 1-layer model: the second layer's tensors are unexpected
        assert "unexpected (in the checkpoint, not in the model): model.0.decoder.layers.1." in r["message"]
    else:
        assert "shapes differ: model.0.decoder.layers.0.mlp.linear_fc1.weight: checkpoint [512, 64] vs model [192, 64]" \
            in r["message"]  # SwiGLU: fc1 holds gate and up, 2 * ffn_hidden_size rows


def test_hf_folder_missing_or_misshaped_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from mfsdp_kit.models import hf as hf_models
    from mfsdp_kit.models.tiny import tiny
    src = tiny(tmp_path / "tiny", size="xs", seed=1)
    hf_models.check_folder(src)
    weights = load_file(src / "model.safetensors")
    up = weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match=rf"missing from {src / 'model.safetensors'}: \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_models.check_folder(src)
    save_file({**weights, "model.layers.1.mlp.up_proj.weight": up.t().contiguous()}, src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match=r"model.layers.1.mlp.up_proj.weight in .*model.safetensors: saved \[64, 128\], the architecture needs \[128, 64\]"):
        hf_models.check_folder(src)


def test_hf_folder_with_an_unexpected_tensor(tmp_path):
    """Issue 36 case 9a: an extra `model.layers.7...` tensor loaded silently; a checkpoint refuses the same."""
    from safetensors.torch import load_file, save_file

    from mfsdp_kit.models import hf as hf_models
    from mfsdp_kit.models.tiny import tiny
    src = tiny(tmp_path / "tiny", size="xs", seed=1)
    weights = load_file(src / "model.safetensors")
    extra = "model.layers.7.mlp.up_proj.weight"
    save_file({**weights, extra: weights["model.layers.1.mlp.up_proj.weight"].clone()}, src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match=rf"1 tensor\(s\) in {src} that the architecture in config.json "
                                                   rf"lacks: \['{extra}'\].*pass strict=False"):
        hf_models.check_folder(src)
    with pytest.warns(UserWarning, match=rf"lacks: \['{extra}'\] are left out \(strict=False\)"):
        hf_models.check_folder(src, strict=False)


# ---- collective -------------------------------------------------------------------------------
def _in_step(r: dict, within_s: float = 10.0) -> None:
    assert r["same"] and r["type"] == "CheckpointError", r
    assert max(p["seconds"] for p in r["per_rank"]) < within_s, r


def test_non_json_extra_on_one_rank_fails_everywhere(faults):
    r = faults["bad_extra"]
    _in_step(r)
    assert "rank 0: extra keys ['data_position'] cannot be saved in meta.json" in r["message"], r["message"]
    assert r["leftovers"] == []


def test_full_disk_fails_everywhere_and_leaves_nothing(faults):
    if "full_disk" not in faults:
        pytest.skip("needs root to mount a tmpfs")
    r = faults["full_disk"]
    for case in ("no_space_at_all", "space_for_a_few_shards"):
        print(case, r[case]["message"][:300])
        _in_step(r[case])
        assert "No space left on device" in r[case]["message"] and r[case]["leftovers"] == []
    assert "cannot write checkpoints under" in r["no_space_at_all"]["message"]
    assert "writing checkpoint" in r["space_for_a_few_shards"]["message"] and ".tmp-step_000001" in r["space_for_a_few_shards"]["message"]
    assert r["after_freeing"] == dict(listed=[1], latest=1, leftovers=[])


def test_untrusted_root_refused_on_every_rank(faults):
    r = faults["untrusted_root"]
    _in_step(r)
    assert "rank 0: " in r["message"] and "is writable by group or others (mode drwxrwxrwx)" in r["message"]
    assert r["left"] == ["latest.tmp"] and r["victim"] == "root only\n"


def test_ranks_asking_for_different_steps_fail_together(faults):
    r = faults["ranks_disagree"]
    _in_step(r)
    assert "ranks asked for different checkpoints" in r["message"]


def test_failed_commit_is_undone_on_every_rank(faults):
    r = faults["commit_fails"]
    _in_step(r)
    assert "committing checkpoint" in r["message"] and "step_000007" in r["message"] and "rank 0:" in r["message"]
    assert r["left"] == [".latest.lock", "latest"]  # no step_000007, no .tmp-step_000007, no latest.tmp
    assert r["after_fixing"] == dict(listed=[7], latest=7)
