"""A kit checkpoint read by stock torch alone: a fresh `python -I` that never imports mfsdp_kit runs torch's
`dcp_to_torch_save` and `dcp.load` through `FileSystemReader` on a step folder, as a user without the kit (or
verl's and torchtitan's converters, which call the same functions) would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = r"""
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

src, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(src, f"{out}/converted.pt")
md = FileSystemReader(src).read_metadata()
state = {k: torch.full(v.size, 7, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
         if isinstance(v, TensorStorageMetadata)}
dcp.load(state, storage_reader=FileSystemReader(src), no_dist=True)
torch.save(state, f"{out}/loaded.pt")
kit = sorted(m for m in sys.modules if m.split(".")[0] == "mfsdp_kit")
assert not kit, f"the stock reader imported the kit: {kit}"
"""


def read(step_dir, out_dir) -> tuple[dict, dict]:
    """(dcp_to_torch_save's nested state dict, {flat key: tensor} read by FileSystemReader) of `step_dir`,
    both from a python that never imports the kit (-I: no PYTHONPATH, no current directory on sys.path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-I", "-c", SCRIPT, str(step_dir), str(out_dir)], capture_output=True,
                         text=True)
    assert run.returncode == 0, f"stock torch could not read {step_dir}:\n{run.stderr[-3000:]}"
    return (torch.load(out_dir / "converted.pt", weights_only=False),
            torch.load(out_dir / "loaded.pt", weights_only=True))
