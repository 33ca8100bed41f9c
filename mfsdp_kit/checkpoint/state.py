"""What goes into DCP, as torch.distributed.checkpoint `Stateful` objects: model, optimizer, RNG.

A checkpoint is a dict of name -> Stateful (`components`, as torchtitan's CheckpointManager takes
it): `{"model": ModelState(chunks), "optimizer": OptimizerState(chunks, opt), "rng": RNGState(),
"scheduler": scheduler}`. Each `state_dict()` is used in both directions: a save hands DCP the live
tensors to write, a load hands it the same dict (built from a fresh model) to write into in place,
then calls `load_state_dict`. Keys, in DCP's flattened form: `model.<chunk>.<name>`,
`optimizer.state.<param>.<name>` (Megatron-FSDP) or `optimizer.rank<r>.<i>.<g>.<j>.<name>` (DDP),
`rng.pp<p>_tp<t>[_ep<e>].<name>`. At expert-parallel size > 1 an expert is named by its global
number (`local_experts.<global>`, `checkpoint_name`): each EP rank's `local_experts.0` is another
expert, and DCP would keep only one of the same-named tensors.

What the naive `Stateful` (a module's `state_dict()`, an optimizer's `state_dict()`) gets wrong here:
- Megatron-FSDP: `chunk.state_dict_for_save_checkpoint()` (DTensor shards) and the optimizer's
  `sharded_state_dict(..., distrib_optim_sharding_type="fsdp_dtensor")`. The naive DCP save of
  those deadlocks or loads wrong values: shards are uneven, and ranks hold optimizer state for
  different parameters. So every rank pads the optimizer keys it lacks with empty-local DTensors
  and sorts them (same keys, same order on every rank), and `mark_uneven_shards` records each
  shard's true offset. A load asks the optimizer for its state with `is_loading=True` (which
  creates Adam state by taking a zero-gradient step: `state_dict_for_load`, never used by a save);
  after the read the padded entries go, `optimizer.load_state_dict` runs, and
  `install_optimized_model_weights()` copies the loaded main weights into the compute weights
  (without it the next forward uses the old weights: Megatron-Bridge #3397). Model tensors are
  reshardable (other DP sizes, 1 rank, into plain tensors for `to_hf`), and so is the optimizer's
  `fsdp_dtensor` state (another DP size, same TP/PP/EP: `OptimizerState.accepts` says so before anything is read).
- DDP: not megatron's `dist_checkpointing` but plain torch DCP. Model tensors are replicated,
  keyed by their unwrapped names (DCP writes each once), so they reshard to any DP size and
  load into FSDP chunks. Optimizer state is per rank (`optimizer.rank<r>.*`: each inner torch
  optimizer's params and Adam state): exact, but only for the same world size and layout.
- RNG (torch CPU, CUDA when present, megatron's RNG tracker) keyed by (pp_rank, tp_rank, ep_rank);
  data-parallel ranks of one model-parallel rank share it (the kit seeds them alike). A
  checkpoint from another TP/PP layout skips the RNG restore and says so (`RNGState.accepts`).

Optional methods the manager uses when a component has them (a plain `Stateful` needs none):
`state_dict_for_load()` (the dict to read into, when it differs from what a save writes),
`accepts(meta, path) -> bool` (raise when the checkpoint cannot load into it, False to skip it),
`strict_prefix()` (checkpoint keys under `<name>.<prefix>` must all be asked for: the naive load
drops the ones the model lacks), and the attribute `checkpoint_format` ("dcp" or "json").
"""
from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from ..distributed import introspect
from .. import lora
from ..compat.access import fsdp as megatron_fsdp
from . import collective
from .errors import CheckpointError

log = logging.getLogger(__name__)


def layout() -> dict:
    """This job's world size and model-parallel layout (tp = pp = 1 before megatron's parallel_state is up)."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return dict(world_size=collective.world(), tp=1, pp=1, ep=1, tp_rank=0, pp_rank=0, ep_rank=0)
    return dict(world_size=collective.world(), tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                ep_rank=ps.get_expert_model_parallel_rank())


def canonical(name: str) -> str:
    """Parameter name without wrapper prefixes: 'module.module.decoder.x' -> 'decoder.x'."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def checkpoint_name(name: str, chunk) -> str:
    """`name` with its expert numbered globally (`local_experts.<i>` of this EP rank); others unchanged."""
    from ..compat.patches.experts import global_expert_name
    return global_expert_name(name, getattr(getattr(chunk, "config", None), "num_moe_experts", None))


def is_fsdp(chunks) -> bool:
    """Does any chunk use Megatron-FSDP (then the whole checkpoint is in its layout)?"""
    return any(introspect.is_fsdp(c) for c in chunks)


def model_state(chunks, *, mp_prefix: str = "") -> dict:
    """{chunk index: {canonical name: tensor}}: FSDP DTensor shards or DDP's full tensors.

    The values are the live parameter tensors (or DTensor views of them), so a DCP load
    writes into the model in place. A LoRA model's state is its adapters only: the frozen base is the HF
    folder it was loaded from (`ModelState.lora_base`), never written again.
    """
    out, adapters_only = {}, lora.has_adapters(chunks)
    for i, chunk in enumerate(chunks):
        sd = chunk.state_dict_for_save_checkpoint() if hasattr(chunk, "state_dict_for_save_checkpoint") \
            else chunk.state_dict(keep_vars=True)
        out[f"{mp_prefix}{i}"] = {checkpoint_name(canonical(k), chunk): v for k, v in sorted(sd.items())
                                  if torch.is_tensor(v) and not k.endswith("_extra_state")
                                  and (lora.is_adapter(k) or not adapters_only)}
    return out


def fsdp_optimizer_state(chunks, optimizer, *, is_loading: bool) -> tuple[dict, list]:
    """The fsdp_dtensor optimizer state, padded so every rank has the same keys; (state, padded keys).
    (megatron names its experts globally already: distrib_optimizer.py:1168 handle_experts_in_state_dict)"""
    from torch.distributed.tensor import DTensor
    msd = {}
    for chunk in chunks:
        msd.update(chunk.state_dict_for_save_checkpoint())
    # is_loading makes megatron create the Adam state by a zero-gradient step over every parameter
    # (distrib_optimizer.py:1137, _init_optimizer_states_with_dummy_values), on every call: 2 s of a
    # 2 s CPU load here. The state it creates is only needed when there is none yet.
    osd = optimizer.sharded_state_dict(msd, is_loading=is_loading and not has_adam_state(optimizer),
                                       metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    state = osd["state"]
    mine = {k: sorted(kk for kk, vv in v.items() if isinstance(vv, DTensor)) for k, v in state.items()}
    everyone = collective.all_gather(mine)
    wanted: dict[str, set] = {}
    for per_rank in everyone:
        for k, names in per_rank.items():
            wanted.setdefault(k, set()).update(names)
    by_canonical = {k: v for part in model_state(chunks, mp_prefix="").values() for k, v in part.items()}
    padded = []
    for key, names in wanted.items():
        if key in state:
            continue
        ref = by_canonical.get(canonical(key))
        if ref is None and layout()["ep"] > 1 and ".mlp.experts." in key:
            continue   # another expert-parallel rank's expert: its mesh does not include this rank
        if ref is None:
            raise CheckpointError(f"optimizer key {key!r} has no model parameter {canonical(key)!r}")
        state[key] = {n: DTensor.from_local(torch.empty(0, dtype=torch.float32, device=ref.to_local().device),
                                            device_mesh=ref.device_mesh, placements=ref.placements,
                                            shape=ref.shape, stride=ref.stride()) for n in names}
        padded.append(key)
    osd["state"] = {k: dict(sorted(state[k].items())) for k in sorted(state)}
    return osd, padded


def has_adam_state(optimizer) -> bool:
    """Every parameter with local elements has its optimizer state (a step was taken or loaded)."""
    params = [p for g in optimizer.optimizer.param_groups for p in g["params"]
              if getattr(p, "_local_tensor", p).numel() > 0]
    return bool(params) and all(optimizer.optimizer.state.get(p) for p in params)


def ddp_optimizer_state(optimizer) -> dict:
    """This rank's optimizer tensors: each inner torch optimizer's params and Adam state.

    Adam state is created first when absent (zeros and step 0 are what Adam would start from),
    so a fresh optimizer offers the same keys to load into.
    """
    out = {}
    for i, opt in enumerate(introspect.inner_optimizers(optimizer)):
        torch_opt = opt.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            for j, p in enumerate(group["params"]):
                st = torch_opt.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p.data), torch.zeros_like(p.data)
                if "step" not in st:   # where torch's Adam keeps it: on the param's device when fused/capturable
                    on_device = group.get("fused") or group.get("capturable")
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                key = f"{i}.{g}.{j}"
                out[f"{key}.param"] = p.data
                out.update({f"{key}.{n}": v for n, v in st.items() if torch.is_tensor(v)})
    return out


def rng_key(layout: dict) -> str:
    """Ranks with this key hold the same RNG streams; EP ranks differ in megatron's expert-parallel-rng."""
    ep = f"_ep{layout['ep_rank']}" if layout.get("ep", 1) > 1 else ""
    return f"pp{layout['pp_rank']}_tp{layout['tp_rank']}{ep}"


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


def dtensors(state, prefix: str = "") -> list:
    from torch.distributed.tensor import DTensor
    if isinstance(state, dict):
        return [kv for k, v in state.items() for kv in dtensors(v, f"{prefix}{k}.")]
    return [(prefix[:-1], state)] if isinstance(state, DTensor) else []


def mark_uneven_shards(state: dict) -> None:
    """Record each DTensor shard's true offset for DCP (Megatron-FSDP shards are uneven).

    Megatron-FSDP's `preprocess_state_dict_for_uneven_dtensor` does this with one
    all_gather_object per tensor (four per parameter with Adam: ~1 s of a save on GPU). When every
    DTensor is sharded along one dim of the same 1-D mesh (Megatron-FSDP's DP mesh), one
    all_gather_object of all local shapes gives the same offsets; anything else goes to megatron's.
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import Shard
    items = dtensors(state)
    meshes = {id(t.device_mesh) for _, t in items}
    if len(meshes) > 1 or any(t.device_mesh.ndim != 1 or type(t.placements[0]) is not Shard for _, t in items):
        megatron_fsdp.preprocess_uneven_dtensors(state)
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




def mp_prefix(chunks) -> str:
    """`mp_pp<p>_tp<t>.` for DDP with TP/PP > 1 (its shards differ by model-parallel rank), else ''."""
    lay = layout()
    return f"mp_{rng_key(lay)}." if lay["tp"] * lay["pp"] > 1 and not is_fsdp(chunks) else ""


def install_compute_weights(chunks) -> None:
    """Megatron-FSDP: copy the (loaded) main weights into the compute weights, then drop the all-gathers a forward
    before the load left prefetched (the sharded view resets the gather pipeline): else the next forward runs on
    those, the weights from before the load (tests/checkpoint/test_live.py). A no-op for DDP."""
    for chunk in chunks:
        if introspect.is_fsdp(chunk):
            megatron_fsdp.install_optimized_weights(chunk)
            introspect.set_param_view(chunk, "sharded")


def copy_into(live: dict, loaded: dict) -> None:
    """Copy `loaded` into `live` where it holds other tensors (DCP reads in place: then nothing is copied)."""
    for k, v in loaded.items():
        if isinstance(v, dict):
            copy_into(live[k], v)
        elif torch.is_tensor(v) and v is not live[k]:
            with torch.no_grad():
                live[k].copy_(v)


# ---------------------------------------------------------------- the Stateful components
class ModelState:
    """The model chunks' tensors: Megatron-FSDP DTensor shards or DDP's full tensors, `{chunk: {name: t}}`."""
    checkpoint_format = "dcp"

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.handed: dict | None = None  # the last state_dict(): DCP reads into its tensors

    @property
    def fsdp(self) -> bool:
        return is_fsdp(self.chunks)

    def state_dict(self) -> dict:
        """The live parameter tensors (or DTensor views of them): a DCP load writes into them."""
        self.handed = model_state(self.chunks, mp_prefix=mp_prefix(self.chunks))
        return self.handed

    def load_state_dict(self, state_dict: dict) -> None:
        copy_into(self.handed or self.state_dict(), state_dict)
        install_compute_weights(self.chunks)

    def strict_prefix(self) -> str:
        return mp_prefix(self.chunks)

    @property
    def lora_base(self) -> dict | None:
        """A LoRA model's base, {"path", "fingerprint"} (`lora.base_reference`); None without adapters."""
        return (lora.base_of(self.chunks) or dict(path=None, fingerprint=None)) if lora.has_adapters(self.chunks) else None

    def accepts(self, meta: dict, path) -> bool:
        """Adapters load only onto the base they were trained on (and a full model's weights never onto adapters)."""
        saved, mine = meta.get("lora_base"), self.lora_base
        if saved is None and mine is None:
            return True
        if saved is None or mine is None:
            raise CheckpointError(f"{path} holds {'a full model' if saved is None else 'LoRA adapters only'}, this "
                                  f"model {'has LoRA adapters' if saved is None else 'has none'}: load it into a "
                                  f"model built {'without' if saved is None else 'with'} EngineConfig.lora")
        if saved["fingerprint"] != mine["fingerprint"]:
            raise CheckpointError(f"{path} holds LoRA adapters trained on the base {saved['path']} (fingerprint "
                                  f"{str(saved['fingerprint'])[:12]}); this model's base is {mine['path']} (fingerprint "
                                  f"{str(mine['fingerprint'])[:12]}): load the model from the base the adapters "
                                  "were trained on")
        return True


class OptimizerState:
    """Megatron's optimizer: the fsdp_dtensor layout with padded keys, or DDP's per-rank tensors."""
    checkpoint_format = "dcp"

    def __init__(self, chunks, optimizer):
        self.chunks, self.optimizer = list(chunks), optimizer
        self.padded: list = []
        """The keys the last FSDP `state_dict` padded (this rank holds no state for them)."""
        self.handed: dict | None = None

    @property
    def fsdp(self) -> bool:
        return is_fsdp(self.chunks)

    def state_dict(self) -> dict:
        return self._state(is_loading=False)

    def state_dict_for_load(self) -> dict:
        """Like `state_dict`, but a fresh Megatron-FSDP optimizer first creates its Adam state
        (megatron takes a zero-gradient step), so the keys to read into exist."""
        return self._state(is_loading=True)

    def _state(self, *, is_loading: bool) -> dict:
        if self.fsdp:
            self.handed, self.padded = fsdp_optimizer_state(self.chunks, self.optimizer, is_loading=is_loading)
        else:
            self.handed = {f"rank{collective.rank()}": ddp_optimizer_state(self.optimizer)}
        return self.handed

    def load_state_dict(self, state_dict: dict) -> None:
        """FSDP: the padded entries go, then `optimizer.load_state_dict` and the compute weights are
        refreshed from the main weights. DDP: DCP read in place (else copied)."""
        if not self.fsdp:
            copy_into(self.handed or self._state(is_loading=False), state_dict)
            return
        state_dict = dict(state_dict, state={k: v for k, v in state_dict["state"].items() if k not in self.padded})
        self.optimizer.load_state_dict(state_dict)
        install_compute_weights(self.chunks)

    def accepts(self, meta: dict, path) -> bool:
        """Optimizer state loads into the wrapper it was saved with and the same TP/PP/EP layout; Megatron-FSDP's
        `fsdp_dtensor` state also into another data-parallel size (DCP reshards its DTensors), DDP's per-rank
        state (`optimizer.rank<r>`) only into the world size it was saved with."""
        lay, world = layout(), collective.world()
        saved = {k: meta.get(k, 1) for k in ("tp", "pp", "ep")}
        mine = {k: lay[k] for k in saved}
        if meta["fsdp"] == self.fsdp and saved == mine and (self.fsdp or meta["world_size"] == world):
            return True
        why = ("the wrapper differs" if meta["fsdp"] != self.fsdp else
               "the model-parallel layout differs" if saved != mine else
               "DDP optimizer state is per rank, so it loads only at the world size it was saved at (Megatron-FSDP's "
               "reshards to another data-parallel size)")
        raise CheckpointError(
            f"{path}: optimizer state was saved with fsdp={meta['fsdp']}, world_size={meta['world_size']}, "
            f"{', '.join(f'{k}={v}' for k, v in saved.items())}; this job has fsdp={self.fsdp}, world_size={world}, "
            f"{', '.join(f'{k}={v}' for k, v in mine.items())}: {why}. Load the model weights only (optimizer=None)")


class RNGState:
    """torch CPU / CUDA and megatron's RNG tracker states, keyed by this rank's (pp, tp) position."""
    checkpoint_format = "dcp"

    def state_dict(self) -> dict:
        return {rng_key(layout()): rng_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        set_rng_state(state_dict[rng_key(layout())])

    def accepts(self, meta: dict, path) -> bool:
        """False (a warning: fresh RNG streams) for a checkpoint of another TP/PP layout."""
        lay = layout()
        if meta.get("tp") == lay["tp"] and meta.get("pp") == lay["pp"] and meta.get("ep", 1) == lay["ep"]:
            return True
        msg = (f"{path} was saved with tp={meta.get('tp')}, pp={meta.get('pp')}, ep={meta.get('ep', 1)}; this job "
               f"has tp={lay['tp']}, pp={lay['pp']}, ep={lay['ep']}: RNG states are NOT restored (fresh RNG streams)")
        warnings.warn(msg)
        log.warning(msg)
        return False
