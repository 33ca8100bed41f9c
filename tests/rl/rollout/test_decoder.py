"""rl.rollout.decoder: the fused projections change nothing an HF user sees, and what it cannot run is refused by
name before anything is allocated."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from mfsdp_kit.config import ConfigError
from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout.decoder import check_model, fuse_projections


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "OlmoeForCausalLM"])
def test_fused_projections_keep_the_model_and_its_names(arch, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(write_tiny(arch, tmp_path / arch), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    before, names = model(ids).logits, list(model.state_dict())
    fuse_projections(model)
    fuse_projections(model)   # idempotent
    assert list(model.state_dict()) == names
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():   # what sync.load_into does: a copy into the HF parameter by name
        attn.k_proj.weight.copy_(torch.full_like(attn.k_proj.weight, 0.5))
    rows = attn.q_proj.weight.shape[0]
    assert (attn.kit_qkv_weight[rows:rows + attn.k_proj.weight.shape[0]] == 0.5).all()


def test_refuses_what_it_cannot_run_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="does not run GPT2LMHeadModel; allowed: LlamaForCausalLM"):
        check_model(gpt2)

