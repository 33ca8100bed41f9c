"""scripts/hooks/commit-msg refuses a subject over 72 characters (or a subject run on into a second line) and
passes a short subject with its detail in the body; `make hooks` (part of `make install`) sets it up in a git
clone's top folder, and leaves a folder without .git, a folder inside another repository and a clone with its
own core.hooksPath alone. A real `git commit` in a scratch repository goes through the hook."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "scripts" / "hooks" / "commit-msg"
BODY = "\n\nThe reason, the numbers and the tests: as long as they need to be, on as many lines as it takes."
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def hook(tmp_path, message: str) -> subprocess.CompletedProcess:
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text(message)
    return subprocess.run([sys.executable, str(HOOK), str(msg)], capture_output=True, text=True)


@pytest.mark.parametrize("message", [
    "checkpoint: default items are torch.save archives" + BODY,
    "x" * 72,
    "# Please enter the commit message\n\nfix the reader's fallback\n# a comment\n",
    "short subject\n\nbody\n# ------------------------ >8 ------------------------\n" + "y" * 200,
    "Merge branch 'bounds' of /work/main into a branch whose name is long enough to pass 72 characters",
    "",
])
def test_good_messages_pass(tmp_path, message):
    r = hook(tmp_path, message)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("message, says", [
    ("x" * 73, "the subject has 73 characters; at most 72"),
    ("Checkpoints: the default format is now one that stock torch reads, written around the memory" + BODY,
     "the subject has 92 characters"),
    ("a subject\nthat goes on here" + BODY, "the second line is not blank"),
])
def test_bad_messages_fail_and_say_why(tmp_path, message, says):
    r = hook(tmp_path, message)
    assert r.returncode == 1 and says in r.stderr, r.stderr


def make_hooks(folder: Path) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "Makefile", folder / "Makefile")
    return subprocess.run(["make", "-s", "hooks"], cwd=folder, env=GIT_ENV, capture_output=True, text=True)


def git(folder: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=folder, env=GIT_ENV, capture_output=True, text=True)


def test_make_hooks_in_a_clone_and_a_real_commit(tmp_path):
    git(tmp_path, "init", "-q")
    shutil.copytree(HOOK.parent, tmp_path / "scripts" / "hooks")
    assert make_hooks(tmp_path).returncode == 0
    assert git(tmp_path, "config", "core.hooksPath").stdout.strip() == "scripts/hooks"
    git(tmp_path, "add", "-A")
    refused = git(tmp_path, "commit", "-q", "-m", "z" * 80)
    assert refused.returncode != 0 and "the subject has 80 characters" in refused.stderr
    assert git(tmp_path, "commit", "-q", "-m", "add the Makefile" + BODY).returncode == 0
    assert git(tmp_path, "log", "--format=%s").stdout.strip() == "add the Makefile"


def test_make_hooks_leaves_other_folders_alone(tmp_path):
    plain = tmp_path / "no_git"
    plain.mkdir()
    assert make_hooks(plain).returncode == 0 and not (plain / ".git").exists()
    outer = tmp_path / "outer"
    (outer / "kit").mkdir(parents=True)
    git(outer, "init", "-q")
    assert make_hooks(outer / "kit").returncode == 0
    assert git(outer, "config", "core.hooksPath").stdout.strip() == ""   # another repository: not ours to set
    own = tmp_path / "own"
    own.mkdir()
    git(own, "init", "-q")
    git(own, "config", "core.hooksPath", "my/hooks")
    assert make_hooks(own).returncode == 0
    assert git(own, "config", "core.hooksPath").stdout.strip() == "my/hooks"
