"""perf.report: a bench run's JSON lands where --out says, folders and all."""
import json
from pathlib import Path

from mfsdp_kit.perf.report import write_json


class _Report:
    def as_dict(self):
        return {"ok": True}


def test_write_json_creates_the_folder_and_says_where(tmp_path, capsys):
    out = write_json(tmp_path / "a" / "b" / "run.json", {"x": [1, 2.5], "r": _Report()}, default=lambda r: r.as_dict())
    written = json.loads(out.read_text())
    assert written.pop("provenance")["device"] and written == {"x": [1, 2.5], "r": {"ok": True}}
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    write_json(str(out), [3], indent=2)   # a str path, rewritten in place
    assert out.read_text() == "[\n  3\n]"


def test_a_result_says_which_commit_date_and_device_made_it(tmp_path, monkeypatch):
    """The commit is git's HEAD here (a tree that travelled without .git passes $MFSDP_COMMIT), the date UTC."""
    import re
    import subprocess
    monkeypatch.delenv("MFSDP_COMMIT", raising=False)
    try:   # a copy without .git (or without git) says "unknown"
        head = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        head = ""
    got = json.loads(write_json(tmp_path / "r.json", {"x": 1}).read_text())["provenance"]
    assert got["commit"].removesuffix("+dirty") == (head or "unknown") and got["device"] == "cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", got["date"])
    monkeypatch.setenv("MFSDP_COMMIT", "abc123")
    assert json.loads(write_json(tmp_path / "r.json", {"x": 1}).read_text())["provenance"]["commit"] == "abc123"
    kept = {"commit": "given"}
    assert json.loads(write_json(tmp_path / "r.json", {"provenance": kept}).read_text()) == {"provenance": kept}
