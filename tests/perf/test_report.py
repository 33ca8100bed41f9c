"""perf.report: a bench run's JSON lands where --out says, folders and all."""
import json

from mfsdp_kit.perf.report import write_json


class _Report:
    def as_dict(self):
        return {"ok": True}


def test_write_json_creates_the_folder_and_says_where(tmp_path, capsys):
    out = write_json(tmp_path / "a" / "b" / "run.json", {"x": [1, 2.5], "r": _Report()}, default=lambda r: r.as_dict())
    assert json.loads(out.read_text()) == {"x": [1, 2.5], "r": {"ok": True}}
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    write_json(str(out), [3], indent=2)   # a str path, rewritten in place
    assert out.read_text() == "[\n  3\n]"
