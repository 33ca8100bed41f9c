"""quiet: each benign third-party warning the kit knows is emitted by its upstream as shipped (a canary: when
upstream drops it, the row goes), and none of them is after `compat.apply("quiet")`, while other warnings still are; under nbval,
notebooks/conftest.py fails a cell whose output shows a warning."""
import re
import subprocess
import sys
from pathlib import Path

from mfsdp_kit.compat.patches import quiet

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, warnings
warnings.simplefilter("default", DeprecationWarning)     # as an engine or a kernel may show them; quiet's go in front
if sys.argv[1] == "installed":
    from mfsdp_kit import compat
    compat.apply("startup")                                   # what runtime.init and an engine's boot call first
import megatron.core.models.gpt.gpt_layer_specs         # Apex, legacy GroupedMLP (import time)
import megatron.core.extensions.transformer_engine_spec_provider
import megatron.core.optimizer.clip_grads, megatron.core.optimizer
from megatron.core.transformer.transformer_config import TransformerConfig
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)   # the default cuda_graph_scope
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.mlp import MLP, MLPSubmodules
try:                                                    # a dense MLP as megatron's layer specs build it
    build_module(ModuleSpec(module=MLP, submodules=MLPSubmodules()),
                 config=TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=16))
except (AttributeError, TypeError):                     # no linear layers given: the warning came first
    pass
import transformers
transformers.PretrainedConfig().torch_dtype             # what megatron-bridge reads
from mfsdp_kit import compat
compat.apply("bridge")                                  # megatron-bridge as the kit imports it (no TE)
from megatron.bridge.utils.fusions import can_enable_gradient_accumulation_fusion
can_enable_gradient_accumulation_fusion()               # no Apex
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))   # the names Megatron-FSDP calls
try:
    dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(1))
except RuntimeError:   # gloo may not implement it; the deprecation warning came first
    pass
from megatron.core.optimizer import optimizer
optimizer._zero_grad_group_helper([torch.ones(2, requires_grad=True) * 2], set_to_none=True)   # a shard view
warnings.warn("Apex is not installed. Falling back to Torch Norm")       # the same text from elsewhere: kept
warnings.warn_explicit("a megatron warning the kit does not know", UserWarning, "x.py", 1,
                       module="megatron.core.x")        # kept
"""
OTHERS = ["a megatron warning the kit does not know", "__main__", "<string>:"]


def stderrs_of(*modes: str) -> list[str]:
    """The script's stderr in each mode, the processes run side by side (each imports megatron: ~10 s)."""
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, m], stderr=subprocess.PIPE, text=True) for m in modes]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for e in errs]
    return errs


def test_known_warnings_show_as_shipped_and_not_once_installed():
    shipped, installed = stderrs_of("shipped", "installed")
    patterns = [re.compile(row.message) for row in quiet.known_warnings()]
    for p in patterns:
        assert p.search(shipped), f"upstream no longer emits {p.pattern!r}: delete its row\n{shipped[-3000:]}"
    leaked = [line for line in installed.splitlines() if any(p.search(line) for p in patterns)]
    assert len(leaked) == 1 and leaked[0].startswith("<string>:") and "UserWarning: Apex" in leaked[0], installed
    assert "UserWarning: a megatron warning the kit does not know" in installed, installed


def test_every_row_says_where_and_why():
    rows = quiet.known_warnings()
    assert len(rows) == len({r.message for r in rows}) >= 5
    for row in rows:
        assert row.via in ("warnings", "logging") and row.module and len(row.why) > 20, row
        assert row.module in str(row) and row.why in str(row)


def test_nbval_fails_a_cell_that_shows_a_warning(tmp_path):
    """notebooks/conftest.py under nbval: a cell printing a UserWarning fails with the warning's line, quiet cells
    and a cell whose filtered warning never shows pass."""
    import shutil

    import nbformat
    shutil.copy(ROOT / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "print('quiet')",
        "import warnings\nwarnings.warn('planted', UserWarning)",
        "from mfsdp_kit import compat\ncompat.apply(\"quiet\")\n"
        "warnings.warn('Apex is not installed. Falling back to Torch Norm')   # from __main__: not the row's module\n"
        "print(len(quiet.known_warnings()))",
        "warnings.warn_explicit('full scope is deprecated.', UserWarning, 'x.py', 1,\n"
        "                       module='megatron.core.transformer.transformer_config')   # a known row: hidden")]
    nb.metadata["kernelspec"] = dict(name="python3", display_name="Python 3", language="python")
    nbformat.write(nb, tmp_path / "planted.ipynb")
    nbval = [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider", "planted.ipynb"]
    out = subprocess.run(nbval, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    log = out.stdout + out.stderr
    assert "FAILED planted.ipynb::Cell 1" in log and "FAILED planted.ipynb::Cell 2" in log, log[-3000:]
    assert "2 failed, 2 passed" in log and "UserWarning: planted" in log, log[-3000:]
