"""One forward + backward of a small kit GPT, the same seed and tokens for every config: what a fusion test
compares between its fused and unfused configs."""
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn

SPEC = GPTSpec(hidden_size=64, num_attention_heads=8, num_query_groups=2)


def loss_and_grads(cfg: EngineConfig, check=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses [2, seq], every parameter's grad of their mean, flat) of SPEC built with `cfg` on this
    rank; `check(model)` sees the built model first."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len_tokens + 1), generator=g)
    pos = torch.arange(SPEC.seq_len_tokens).unsqueeze(0).expand(2, -1)
    runtime.set_seed(cfg.seed)
    model = engine.build(cfg, gpt_model_fn(SPEC, cfg), wrap=False)[0]
    if check is not None:
        check(model)
    tokens, pos = (t.to(next(model.parameters()).device) for t in (tokens, pos))   # a GPU run builds it on cuda
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
    loss.mean().backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])
