"""perf.release: the release set's figures come from its JSON files and nowhere else. README.md and the top of
docs/benchmarks.md hold exactly what `make docs` makes of the committed docs/results/h200x1/ files; the readers
cover the release set's files (scripts/gpu_sections.py); docs/results/h200x1/ keeps one current file per section,
each saying which commit, date and device made it; the readers' arithmetic, by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mfsdp_kit.perf import release

ROOT = Path(__file__).resolve().parents[2]


def test_the_documents_show_what_the_committed_release_json_gives():
    for path, text in release.documents(ROOT).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} differs from the release JSON: run `make docs`"


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_readers_are_the_release_sets_files():
    rows = json.loads(subprocess.run([sys.executable, "scripts/gpu_sections.py", "--json"], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout)
    assert {r["writes"] for r in rows if r["section"] == "release" and r["writes"]} == set(release.READERS)


def test_the_results_folder_keeps_one_current_file_per_section_with_its_provenance():
    folder = ROOT / release.FOLDER
    current = {p.name for p in folder.iterdir() if p.is_file()}
    assert current <= set(release.READERS), current - set(release.READERS)
    for name in current:
        p = release.provenance(json.loads((folder / name).read_text()))
        assert "unknown" not in p.values() and "+dirty" not in p["commit"], (name, p)


def test_a_grpo_run_gives_the_first_iteration_and_the_median_of_the_later_ones():
    def row(total, rollout):
        return dict(total_s=total, seconds=dict(rollout_s=rollout, update_s=1.0),
                    floors=dict(rollout_s=0.5, update_s=0.25), mfu=dict(update_s=0.4))
    d = dict(args=dict(backends="continuous", size="l", prompts_per_iteration=64, samples_per_prompt=8,
                       max_new_tokens=512),
             histories=dict(continuous=dict(table=[row(20.0, 19.0), row(4.0, 3.0), row(5.0, 4.0), row(9.0, 8.0)])))
    first, later, rollout, update = release.grpo_iteration(d)[:4]
    assert (first.value, first.bound) == ("20.00 s", "0.75 s")
    assert later.value == "5.00 s" and "median of 3" in later.what
    assert (rollout.value, rollout.bound) == ("4.00 s", "0.50 s")
    assert update.value == "1.00 s (40 % MFU)"


def test_packing_reads_real_tokens_against_padded_and_names_a_failure():
    d = dict(spec="1.7b", results=dict(rl=dict(padding_fraction=0.45, ways={
        "padded": dict(real_tokens_per_s=30_000.0), "packed-sdpa": dict(real_tokens_per_s=45_000.0),
        "packed-x": dict(error="NonFiniteLossError: step 0: loss=nan; training stopped")})))
    padded, packed, failed = release.packing(d)
    assert packed.value == "45.0k tok/s real (1.50x padded)" and packed.headline and not padded.headline
    assert failed.value == "failed: NonFiniteLossError: step 0: loss=nan"
    assert "45 % padding" in padded.what and padded.bound.endswith("(6N at 989 TFLOP/s)")


def test_splice_replaces_only_the_block_and_names_a_file_without_markers():
    text = "a\n<!-- release:begin -->\nold\n<!-- release:end -->\nb\n"
    assert release.splice(text, "new", where="X") == "a\n<!-- release:begin -->\nnew\n<!-- release:end -->\nb\n"
    with pytest.raises(ValueError, match="X: needs exactly one"):
        release.splice("a\n", "new", where="X")


def test_a_missing_section_is_said_not_hidden():
    out = release.table({}, folder="f")
    assert "Not in this release run: " + ", ".join(release.READERS) in out
