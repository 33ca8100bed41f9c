"""What goes into DCP: the nested dict of model, optimizer and RNG tensors, per wrapper.

`build_state` is used for both directions: a save hands DCP the live tensors to write, a load
hands it the same dict (built from a fresh model) to write into in place. Keys, in DCP's
flattened form: `model.<chunk>.<name>`, `optimizer.state.<param>.<name>` (Megatron-FSDP) or
`optimizer.rank<r>.<i>.<g>.<j>.<name>` (DDP), `rng.pp<p>_tp<t>.<name>`.

What is saved, per wrapper:
- Megatron-FSDP: `chunk.state_dict_for_save_checkpoint()` (DTensor shards) and the optimizer's
  `sharded_state_dict(..., distrib_optim_sharding_type="fsdp_dtensor")`. The naive DCP save of
  those deadlocks or loads wrong values: shards are uneven, and ranks hold optimizer state for
  different parameters. So every rank pads the optimizer keys it lacks with empty-local DTensors
  and sorts them (same keys, same order on every rank), and Megatron-FSDP's
  `preprocess_state_dict_for_uneven_dtensor` records each shard's true offset. After the load the
  padded entries go, `optimizer.load_state_dict` runs, and `install_optimized_model_weights()`
  copies the loaded main weights into the compute weights (without it the next forward uses the
  old weights: Megatron-Bridge #3397). Model tensors are reshardable (other DP sizes, 1 rank,
  into plain tensors for `to_hf`); optimizer state needs the same layout.
- DDP: not megatron's `dist_checkpointing` but plain torch DCP. Model tensors are replicated,
  keyed by their unwrapped names (DCP writes each once), so they reshard to any DP size and
  load into FSDP chunks. Optimizer state is per rank (`optimizer.rank<r>.*`: each inner torch
  optimizer's params and Adam state): exact, but only for the same world size and layout.
- RNG (torch CPU, CUDA when present, megatron's RNG tracker) keyed by (pp_rank, tp_rank);
  data-parallel ranks of one model-parallel rank share it (the kit seeds them alike). A
  checkpoint from another TP/PP layout skips the RNG restore and says so (a warning).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collective
from .errors import CheckpointError


def layout() -> dict:
    """This job's world size and model-parallel layout (megatron's parallel_state must be up)."""
    from megatron.core import parallel_state as ps
    return dict(world_size=collective.world(), tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                pp_rank=ps.get_pipeline_model_parallel_rank())


def canonical(name: str) -> str:
    """Parameter name without wrapper prefixes: 'module.module.decoder.x' -> 'decoder.x'."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def is_fsdp(chunks) -> bool:
    from ..engine import is_fsdp
    return any(is_fsdp(c) for c in chunks)


def model_state(chunks, *, fsdp: bool, mp_prefix: str) -> dict:
    """{chunk index: {canonical name: tensor}}: FSDP DTensor shards or DDP's full tensors.

    The values are the live parameter tensors (or DTensor views of them), so a DCP load
    writes into the model in place.
    """
    out = {}
    for i, chunk in enumerate(chunks):
        sd = chunk.state_dict_for_save_checkpoint() if hasattr(chunk, "state_dict_for_save_checkpoint") \
            else chunk.state_dict(keep_vars=True)
        out[f"{mp_prefix}{i}"] = {canonical(k): v for k, v in sorted(sd.items())
                                  if torch.is_tensor(v) and not k.endswith("_extra_state")}
    return out


def _fsdp_optimizer_state(chunks, optimizer, model: dict, *, is_loading: bool) -> tuple[dict, list]:
    """The fsdp_dtensor optimizer state, padded so every rank has the same keys; (state, padded keys)."""
    from torch.distributed.tensor import DTensor
    msd = {}
    for chunk in chunks:
        msd.update(chunk.state_dict_for_save_checkpoint())
    osd = optimizer.sharded_state_dict(msd, is_loading=is_loading,
                                       metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    state = osd["state"]
    mine = {k: sorted(kk for kk, vv in v.items() if isinstance(vv, DTensor)) for k, v in state.items()}
    everyone = collective.all_gather(mine)
    wanted: dict[str, set] = {}
    for per_rank in everyone:
        for k, names in per_rank.items():
            wanted.setdefault(k, set()).update(names)
    by_canonical = {k: v for part in model.values() for k, v in part.items()}
    padded = []
    for key, names in wanted.items():
        if key in state:
            continue
        ref = by_canonical.get(canonical(key))
        if ref is None:
            raise CheckpointError(f"optimizer key {key!r} has no model parameter {canonical(key)!r}")
        state[key] = {n: DTensor.from_local(torch.empty(0, dtype=torch.float32, device=ref.to_local().device),
                                            device_mesh=ref.device_mesh, placements=ref.placements,
                                            shape=ref.shape, stride=ref.stride()) for n in names}
        padded.append(key)
    osd["state"] = {k: dict(sorted(state[k].items())) for k in sorted(state)}
    return osd, padded


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ddp_optimizer_state(optimizer) -> dict:
    """This rank's optimizer tensors: each inner torch optimizer's params and Adam state.

    Adam state is created first when absent (zeros and step 0 are what Adam would start from),
    so a fresh optimizer offers the same keys to load into.
    """
    out = {}
    for i, opt in enumerate(_inner_optimizers(optimizer)):
        torch_opt = opt.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            for j, p in enumerate(group["params"]):
                st = torch_opt.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p.data), torch.zeros_like(p.data)
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                key = f"{i}.{g}.{j}"
                out[f"{key}.param"] = p.data
                out.update({f"{key}.{n}": v for n, v in st.items() if torch.is_tensor(v)})
    return out


def rng_key(layout: dict) -> str:
    return f"pp{layout['pp_rank']}_tp{layout['tp_rank']}"


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    out.update({f"tracker.{k}": v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})
    return out


def set_rng_state(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.set_rng_state(states["torch_cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


def build_state(chunks, optimizer, *, fsdp: bool, layout: dict, is_loading: bool, with_rng: bool = True):
    """The dict handed to DCP, and the padded optimizer keys to drop after a load."""
    mp = layout["tp"] * layout["pp"] > 1 and not fsdp
    mp_prefix = f"mp_{rng_key(layout)}." if mp else ""  # DDP with TP/PP: shards differ by model-parallel rank
    model = model_state(chunks, fsdp=fsdp, mp_prefix=mp_prefix)
    state: dict = {"model": model}
    padded: list = []
    if optimizer is not None:
        if fsdp:
            state["optimizer"], padded = _fsdp_optimizer_state(chunks, optimizer, model, is_loading=is_loading)
        else:
            state["optimizer"] = {f"rank{collective.rank()}": _ddp_optimizer_state(optimizer)}
    if with_rng:
        state["rng"] = {rng_key(layout): rng_state()}
    if fsdp:
        _mark_uneven_shards(state)
    return state, padded


def dtensors(state, prefix: str = "") -> list:
    from torch.distributed.tensor import DTensor
    if isinstance(state, dict):
        return [kv for k, v in state.items() for kv in dtensors(v, f"{prefix}{k}.")]
    return [(prefix[:-1], state)] if isinstance(state, DTensor) else []


def _mark_uneven_shards(state: dict) -> None:
    """Record each DTensor shard's true offset for DCP (Megatron-FSDP shards are uneven).

    Megatron-FSDP's `preprocess_state_dict_for_uneven_dtensor` does this with one
    all_gather_object per tensor (four per parameter with Adam: ~1 s of a save on GPU). When every
    DTensor is sharded along one dim of the same 1-D mesh (Megatron-FSDP's DP mesh), one
    all_gather_object of all local shapes gives the same offsets; anything else goes to megatron's.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import Shard
    items = dtensors(state)
    meshes = {id(t.device_mesh) for _, t in items}
    if len(meshes) > 1 or any(t.device_mesh.ndim != 1 or type(t.placements[0]) is not Shard for _, t in items):
        uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state)
        return
    if not items:
        return
    group = items[0][1].device_mesh.get_group(0)
    shapes = [tuple(t._local_tensor.shape) for _, t in items]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    rank = dist.get_rank(group)
    for i, (_, t) in enumerate(items):
        dim = t.placements[0].dim
        offsets = [0] * len(shapes[i])
        offsets[dim] = sum(r[i][dim] for r in everyone[:rank])
        _attach_chunk(t, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shapes[i])))


def _attach_chunk(t, chunk) -> None:
    """What megatron's update_uneven_dtensor_chunk_metadata attaches, for a known chunk."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def write_items(fqn: str, tensor) -> list:
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        properties = TensorProperties.create_from_tensor(local)
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets),
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=tensor.size()))]
    t._local_tensor.__create_chunk_list__ = lambda: [chunk]
    t._local_tensor.__create_write_items__ = write_items


