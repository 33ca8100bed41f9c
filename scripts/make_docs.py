"""`make docs`: the release set's figures (docs/results/h200x1/, written by `SECTIONS=release bash
scripts/gpu_check.sh`) into README.md and the top of docs/benchmarks.md (`mfsdp_kit.perf.release`), and the GRPO
iteration split with its floors into docs/img/grpo_iteration.png. `--check` changes nothing and exits 1 when a
document differs from what the JSON gives (tests/perf/test_release.py runs the same comparison).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfsdp_kit.perf import release  # noqa: E402


def draw_grpo(folder: Path, out: Path) -> None:
    """The split of every iteration of the release run beside its floors (`plots.iteration_time`)."""
    from mfsdp_kit.notebook import plots
    from mfsdp_kit.rl.loop import History
    d = json.loads((folder / "grpo_iteration.json").read_text())
    h = release.grpo_history(d)
    history = History(**{f.name: h[f.name] for f in fields(History) if f.name in h})
    plots.iteration_time(history, out, floors=[row["floors"] for row in h["table"]],
                         title=f"GRPO iteration, tiny {d['args']['size']}, 1 H200 ({release.provenance(d)['commit']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a document is not what the JSON gives")
    args = ap.parse_args()
    stale = []
    for path, text in release.documents(ROOT).items():
        if path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check:
        print("stale: " + ", ".join(map(str, stale)) if stale else "docs match the release JSON")
        return 1 if stale else 0
    if (ROOT / release.FOLDER / "grpo_iteration.json").is_file():
        draw_grpo(ROOT / release.FOLDER, ROOT / "docs/img/grpo_iteration.png")
    print("updated: " + (", ".join(map(str, stale)) or "nothing (already current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
