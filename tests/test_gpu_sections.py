"""scripts/gpu_sections.py, gpu_check's sections as rows of one table, run as gpu_check.sh runs it (a process, no
import): every row's script and test files exist, a section's rows write distinct logs and JSON files, the default
SECTIONS are rows; and gpu_check.sh's own loop, with `section` stubbed to print, turns SECTIONS="a,b" (or "a b")
into the commands the hand-written script ran (checkpoint_shm's default-format run and its raw A/B; rollout), an
empty argument kept."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "scripts" / "gpu_sections.py"


def table(*args) -> str:
    return subprocess.run([sys.executable, str(TABLE), *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def rows():
    return json.loads(table("--json", "--ngpu", "2", "--results", "runs/gpu"))


def test_every_row_runs_something_that_exists(rows):
    assert len(rows) > 40
    for row in rows:
        words = row["words"]
        if words[0] == "-m":
            assert words[1] == "pytest" or importlib.util.find_spec(words[1]) is not None, row
            if words[1] == "pytest":
                tests = [w for w in words if w.startswith("tests/")]
                assert tests and all((ROOT / t).is_file() for t in tests), row
        elif row["launch"] != "bash":
            assert (ROOT / words[0]).is_file(), row


def test_a_section_writes_each_file_once_and_outputs_under_results(rows):
    for section in {r["section"] for r in rows}:
        mine = [r for r in rows if r["section"] == section]
        assert len({r["name"] for r in mine}) == len(mine), section
        written = [r["writes"] for r in mine if r["writes"]]
        assert len(set(written)) == len(written), section
    for row in rows:
        if row["writes"]:
            assert row["words"][row["words"].index("--out") + 1] == f"runs/gpu/{row['writes']}", row


def test_default_sections_are_rows(rows):
    assert set(table("--default").split()) <= {r["section"] for r in rows}


def gpu_check_loop(sections: str) -> list[str]:
    """gpu_check.sh's loop over SECTIONS, from the script itself, with `section` printing its command."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    loop = re.search(r"^for s in .*?^done$", script, re.S | re.M).group(0)
    stub = ('NGPU=2; RESULTS=runs/gpu; status=0; IMAGE_ENV=""\nsection() { echo "section $*"; }\n'
            'rm() { echo "rm $*"; }\n')
    run = subprocess.run(["bash", "-c", stub + loop + "\necho status=$status"], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "SECTIONS": sections})
    return run.stdout.splitlines()


CK = "--fsdp --layers 16 --hidden 1024 --heads 16 --vocab 32768 --seq 1024 --dtype bf16 --repeats 5 --root /dev/shm/mfsdp_ckpt"


@pytest.mark.parametrize("sections", ["checkpoint_shm,rollout", "checkpoint_shm rollout"])
def test_gpu_check_runs_the_rows_by_name(sections):
    lines = gpu_check_loop(sections)
    assert lines[:4] == [
        f"section checkpoint_fsdp_shm trun bench/checkpoint.py {CK} --probe-mb 1024 --out runs/gpu/checkpoint_fsdp_shm.json",
        "rm -rf /dev/shm/mfsdp_ckpt",
        f"section checkpoint_fsdp_shm_raw trun bench/checkpoint.py {CK} --tensor-format raw --probe-mb 0 "
        "--out runs/gpu/checkpoint_fsdp_shm_raw.json",
        "rm -rf /dev/shm/mfsdp_ckpt"]
    assert len(lines) == 12 and lines[-1] == "status=0"
    assert lines[-2] == ("section rollout python3 bench/rollout.py --shape qwen2-1.8b --batches 1,64,256,512 "
                         "--variants compiled,eager --out runs/gpu/rollout.json")


def test_an_empty_argument_reaches_the_script():
    """rollout_prefill's `--batches ''` (no decode rows) stays one empty word through the table and the shell's eval."""
    (line, status) = gpu_check_loop("rollout_prefill")
    assert status == "status=0" and "bench/rollout.py --shape qwen2-1.8b --batches  --prompt-tokens 1024" in line


def test_unknown_section_fails_the_run_and_the_rest_still_run():
    lines = gpu_check_loop("nope,parity")
    assert lines == ["section parity trun bench/parity.py --dtype bf16 --out runs/gpu/parity.json", "status=1"]


def test_rows_runs_only_the_rows_named():
    """ROWS=a,b: the rest of a release run cut short by its time limit, without its finished rows."""
    import os
    out = subprocess.run([sys.executable, str(TABLE), "release"], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "ROWS": "lora,rollout"}).stdout.splitlines()
    assert [line.split()[1] for line in out] == ["rollout", "lora"]
    everything = table("release").splitlines()
    assert [line.split()[1] for line in everything] == ["notebook_model", "notebooks", "rollout", "grpo_iteration",
                                                         "throughput1", "packing_rl", "lora"]
