"""Where a benchmark's numbers go: one JSON file per run (docs/results/ keeps the ones the docs cite)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_json(path: str | Path, obj: Any, *, default: Callable[[Any], Any] | None = None, indent: int = 1) -> Path:
    """Write `obj` as JSON to `path`, creating its folder; `default` serialises what json cannot (as json.dump's).
    A dict gets a "provenance" entry (`provenance`: commit, date, device) unless it has one: every result says
    which code and machine made it. Prints where it wrote, as every bench script's last line."""
    if isinstance(obj, dict) and "provenance" not in obj:
        obj = {**obj, "provenance": provenance()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=default))
    print("wrote", path)
    return path


def provenance() -> dict:
    """Which code and machine made a result: the git commit (with "+dirty" for uncommitted changes; $MFSDP_COMMIT
    where the tree travelled without its .git, as to a GPU node), the UTC date and the device (GPU name or "cpu")."""
    import os
    import datetime
    import subprocess

    import torch
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = os.environ.get("MFSDP_COMMIT") or git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = "MFSDP_COMMIT" not in os.environ and bool(git("status", "--porcelain", "--untracked-files=no"))
    return dict(commit=commit + ("+dirty" if dirty else ""),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def cell(result: dict, fmt: Callable[[dict], str]) -> str:
    """`fmt(result)`, or "-" for a run that failed or has no value for this row (not profiled, no baseline)."""
    if "error" in result:
        return "-"
    try:
        return fmt(result)
    except (KeyError, TypeError, ZeroDivisionError):
        return "-"


def table_row(name: str, results: dict[str, dict], fmt: Callable[[dict], str], *, name_width: int = 30,
              width: int = 16) -> str:
    """One line of a bench table: the row's name, then `cell` of every run (one column per run)."""
    return f"{name:<{name_width}}" + "".join(f"{cell(r, fmt):>{width}}" for r in results.values())


def units(num_params: int) -> tuple[int, str, float, str]:
    """(bytes per memory unit, its name, params per count unit, its name): GiB and B(illion) params above 1e8
    params, else MiB and M."""
    return (2**30, "GiB", 1e9, "B") if num_params > 1e8 else (2**20, "MiB", 1e6, "M")
