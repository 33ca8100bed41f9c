"""rl.rollout.routes: the engine records, per token, the experts each MoE layer of the model chose, equal to what
transformers' own forward over the whole prompt + completion chooses (its router logits' top-k), for every token the
engine fed (all but each completion's last), while rows are refilled from the queue, moved to a smaller batch and
sampled at temperature 1. fp32 on CPU, Qwen3-MoE and OLMoE written by transformers."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig
from mfsdp_kit.rl.rollout.routes import ROUTE_DTYPE, routers

ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 11, 150, 151], [7], [90, 91, 92, 93, 94, 95, 96, 97, 98],
        [12, 13]]
SMALL = DecodeConfig(max_batch_size=4, check_every=3, slot_bucket=8)
"""Four cache rows for six prompts: rows are refilled and compacted."""


def hf_routes(model, ids: list[int], k: int) -> torch.Tensor:
    """[tokens, moe_layers, k] of transformers' own forward over `ids`: the top-k of each layer's router logits."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([torch.topk(logits.float().softmax(-1), k, dim=-1).indices for logits in out.router_logits], 1)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"])
def test_recorded_routes_are_the_models_own(arch, tmp_path):
    folder = write_tiny(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    k = routers(model)[0][1]
    engine = ContinuousRollout(model, tok, config=SMALL)
    tokens, _, _ = engine.generate_turns(ROWS * 2, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=3,
                                         routes=True)
    assert engine.runner.routes is None and all(g._forward_hooks == {} for g, _ in routers(model))   # closed
    compared = 0
    for prompt, completion, routes in zip(ROWS * 2, tokens, engine.routes):
        ids = prompt + completion
        assert routes.dtype == ROUTE_DTYPE and routes.shape == (len(ids), len(routers(model)), k)
        fed = len(ids) - 1   # the last sampled token is never fed
        theirs = hf_routes(model, ids, k)[:fed]
        assert torch.equal(routes[:fed].long().sort(-1).values, theirs.sort(-1).values), arch
        compared += fed
    assert compared > 50
    again, _ = engine.generate(ROWS * 2, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=3)
    assert again == tokens and engine.routes is None      # recording changes no sample


def test_a_dense_model_has_nothing_to_record(tmp_path):
    folder = write_tiny("Qwen2ForCausalLM", tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine = ContinuousRollout(model, AutoTokenizer.from_pretrained(folder), config=SMALL)
    with pytest.raises(ValueError, match="has no MoE layers to record"):
        engine.generate_turns([[1, 2, 3]], max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0, routes=True)
