"""distributed.cross_entropy (EngineConfig.kernels.fused_cross_entropy) against megatron's vocab-parallel cross-entropy:
same per-token losses and logit gradients (fp32 within rounding; bf16 within one bf16 rounding), on one gloo
rank and vocab-parallel over two; a whole GPT trains to megatron's loss with it."""
import pytest
import torch

from mfsdp_kit.distributed import cross_entropy, runtime
from mfsdp_kit.config import ConfigError, EngineConfig
from tests.dist.launch import run
from tests.models.gpt_grads import SPEC, loss_and_grads

TOL = 1e-5


@pytest.fixture(scope="module")
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    runtime.shutdown()


def _both(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    """(loss, d loss / d logits) of megatron's and of the kit's cross-entropy, a loss that weighs every token."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    out = []
    for fn in (vocab_parallel_cross_entropy, lambda x, t: cross_entropy.cross_entropy(x, t)):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        (loss * weights).sum().backward()
        out.append((loss.detach(), x.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_megatron(world, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 3, 50, generator=g) * 4).to(dtype)
    logits[0, 0, 10] = 60.0   # a dominant logit: the max must be subtracted before exp
    target = torch.randint(0, 50, (7, 3), generator=g)
    weights = torch.rand(7, 3, generator=g)
    (theirs, grad_theirs), (ours, grad_ours) = _both(logits, target, weights)
    assert ours.dtype == torch.float32 and ours.shape == target.shape and grad_ours.dtype == dtype
    assert (ours - theirs).abs().max().item() < TOL
    grad_tol = TOL if dtype == torch.float32 else 2 ** -8 * grad_theirs.abs().max().item()  # one bf16 rounding
    assert (grad_ours.float() - grad_theirs.float()).abs().max().item() <= grad_tol


def test_gpt_loss_and_grads_match_megatron(world):
    """A whole kit GPT, same seed and tokens: the fused loss and every param's grad equal megatron's, and
    the model really computes its loss with it."""
    def installed(model, fused):
        assert ("compute_language_model_loss" in vars(model)) is fused
    runs = {fused: loss_and_grads(EngineConfig(fused_cross_entropy=fused), check=lambda m, f=fused: installed(m, f))
            for fused in (False, True)}
    (loss, grads), (fused_loss, fused_grads) = runs[False], runs[True]
    assert fused_loss.shape == loss.shape == (2, SPEC.seq_len_tokens)
    assert (fused_loss - loss).abs().max().item() < TOL
    assert (fused_grads - grads).abs().max().item() < TOL


def test_vocab_parallel_over_two_ranks():
    """TP = 2: each rank holds half the vocabulary; labels on both halves; equal to megatron's."""
    r = run("cross_entropy_vocab_parallel", nproc=2)
    assert r["loss_max_diff"] < TOL and r["grad_max_diff"] < TOL, r
    assert r["labels_per_rank"][0] > 0 and r["labels_per_rank"][1] > 0, r


def test_refuses_a_model_without_a_language_model_loss():
    with pytest.raises(ConfigError, match="fused_cross_entropy=True needs a megatron LanguageModule.*Linear"):
        cross_entropy.use_in(torch.nn.Linear(2, 2))


def test_the_old_path_serves_the_same_functions():
    """`models.cross_entropy` (where it lived before imports pointed down) serves the same functions."""
    from mfsdp_kit.models import cross_entropy as old
    assert (old.cross_entropy, old.language_model_loss, old.use_in) == \
        (cross_entropy.cross_entropy, cross_entropy.language_model_loss, cross_entropy.use_in)


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="fused_cross_entropy"):
        EngineConfig(fused_cross_entropy="yes")   # refused when made
