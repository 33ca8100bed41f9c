"""Where a benchmark's numbers go: one JSON file per run (docs/results/ keeps the ones the docs cite)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_json(path: str | Path, obj: Any, *, default: Callable[[Any], Any] | None = None, indent: int = 1) -> Path:
    """Write `obj` as JSON to `path`, creating its folder; `default` serialises what json cannot (as json.dump's).
    Prints where it wrote, as every bench script's last line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=default))
    print("wrote", path)
    return path
