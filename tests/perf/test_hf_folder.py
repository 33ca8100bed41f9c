"""perf.hf_folder on the CPU smoke shape: the index names exactly the model's tensors, the weights
load into transformers with the shapes the config implies, and weights=False writes names only; the benchmarks'
write_for_world / remove_for_world (one process, no process group here)."""
import json

import torch

from mfsdp_kit.perf.hf_folder import remove_for_world, tensor_shapes, write_folder, write_for_world


def test_folder_with_and_without_weights(tmp_path):
    from transformers import AutoModelForCausalLM
    shapes = tensor_shapes("small")
    full = write_folder(tmp_path / "full", "small", shard_gb=0.0002)
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes) and full["shards"] >= 2
    assert full["bytes"] == index["metadata"]["total_size"] == 2 * sum(s.numel() for s in shapes.values())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.bfloat16)
    weights = dict(model.named_parameters())
    assert all(torch.equal(weights[n], torch.ones_like(weights[n])) for n in weights if n.endswith("norm.weight"))
    assert weights["model.embed_tokens.weight"].std().item() > 0.01   # the random pool, not zeros

    names = write_folder(tmp_path / "names", "small", shard_gb=0.0002, weights=False)
    index = json.loads((tmp_path / "names" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes) and names["shards"] == 0
    assert not list((tmp_path / "names").glob("*.safetensors"))


def test_write_for_world_replaces_then_removes(tmp_path):
    stale = tmp_path / "mfsdp_x_small"
    stale.mkdir()
    (stale / "left_over").write_text("an earlier run's")
    path, write = write_for_world("mfsdp_x_small", "small", root=str(tmp_path), shard_gb=0.0002)
    assert path == stale and not (path / "left_over").exists() and (path / "config.json").is_file()
    assert write["shards"] >= 2 and write["bytes"] == 2 * sum(s.numel() for s in tensor_shapes("small").values())
    remove_for_world(path, keep=True)
    assert path.is_dir()
    remove_for_world(path, keep=False)
    assert not path.exists()
