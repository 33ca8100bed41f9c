"""train.StepOptions: checked when made, passed whole; the old keywords build the same options and train the same."""
import math

import pytest
import torch

from mfsdp_kit import train
from mfsdp_kit.config import ConfigError, EngineConfig, OptimConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import StepOptions
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.train.options import takes_options
from tests.dist import launch


@pytest.mark.parametrize("fields, message", [
    (dict(micro_batch_size=0), r"^micro_batch_size=0 is not allowed; allowed: an integer >= 1$"),
    (dict(micro_batch_size="4"), r"^micro_batch_size='4' is not allowed; allowed: an integer >= 1$"),
    (dict(micro_batch_size=2, max_tokens_per_micro_batch=0),
     r"^max_tokens_per_micro_batch=0 is not allowed; allowed: None or an integer >= 1$"),
    (dict(micro_batch_size=2, packed="yes"), r"^packed='yes' is not allowed; allowed: None \(where the model can\)"),
    (dict(micro_batch_size=2, packed=1), r"^packed=1 is not allowed"),
    (dict(micro_batch_size=2, loss_fn="masked"), r"^loss_fn='masked' is not allowed; allowed: None"),
    (dict(micro_batch_size=2, scheduler=0.5), r"^scheduler=0.5 is not allowed; allowed: None or a scheduler"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_a_wrong_field_is_refused_by_name_when_made(fields, message):
    with pytest.raises(ConfigError, match=message):
        StepOptions(**fields)


@takes_options
def received(*, options: StepOptions, other: int = 0) -> tuple[StepOptions, int]:
    return options, other


def test_keywords_build_the_options_and_both_at_once_are_refused():
    loss = train.masked_token_loss
    assert received(micro_batch_size=2, packed=False, loss_fn=loss, other=3) == (
        StepOptions(micro_batch_size=2, packed=False, loss_fn=loss), 3)
    whole = StepOptions(micro_batch_size=4, max_tokens_per_micro_batch=64)
    assert received(options=whole)[0] is whole
    with pytest.raises(TypeError, match="options= or its fields as keywords, not both.*packed"):
        received(options=whole, packed=True)
    with pytest.raises(ConfigError, match="options=.*allowed: a train.StepOptions"):
        received(options=dict(micro_batch_size=4))
    with pytest.raises(TypeError, match="micro_batch_size"):   # required, as the keyword was
        received()


@pytest.fixture(scope="module")
def world():
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=launch.free_port())
    yield
    runtime.shutdown()


def twice_the_loss(mb, token_losses):
    """A loss_fn that is not the default: 2 x the masked token loss, logged as itself."""
    loss_sum, count, logged = train.masked_token_loss(mb, token_losses)
    return 2 * loss_sum, count, {"lm loss": logged["lm loss"] * torch.tensor([2.0, 1.0])}


def trained(spelling: str, *, steps: int = 3) -> dict:
    """`steps` steps of one tiny DDP model (the same seed each call) through `fit` and then `run_steps`, with a
    warm-up scheduler and a loss_fn of its own, the options spelled as `spelling` says."""
    cfg = EngineConfig()
    runtime.set_seed(7)
    spec = GPTSpec(hidden_size=64, vocab_size=128, seq_len_tokens=16)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    ocfg = OptimConfig(lr=1e-2, warmup_steps=2 * steps)
    opt = engine.build_optimizer(chunks, ocfg, cfg)
    sched = engine.build_scheduler(opt, ocfg, total_steps=2 * steps)
    data = random_token_batches(steps=2 * steps, global_batch=4, seq_len_tokens=16, vocab_size=128, seed=3)
    how = dict(micro_batch_size=2, scheduler=sched, loss_fn=twice_the_loss)
    kw = dict(options=StepOptions(**how)) if spelling == "options" else how
    history = train.fit(chunks, opt, iter(data[:steps]), steps=steps, progress=False, **kw)
    piped = train.run_steps(chunks, opt, data[steps:], start_index=steps, **kw)
    weights = torch.cat([p.detach().reshape(-1) for c in chunks for p in c.parameters()]).clone()
    engine.release(chunks)
    return dict(losses=history.loss + [r.loss for r in piped], lr=history.lr + [r.lr for r in piped], weights=weights)


def test_options_train_exactly_as_the_keywords_did(world):
    """The same steps, bit for bit, however the options are spelled; the scheduler and the loss_fn both act."""
    old, new = trained("keywords"), trained("options")
    assert old["losses"] == new["losses"] and old["lr"] == new["lr"]
    assert torch.equal(old["weights"], new["weights"])
    assert len(set(new["lr"])) == len(new["lr"])   # the warm-up scheduler stepped every step
    assert new["losses"][0] > 1.8 * math.log(128)   # twice_the_loss: 2 x about ln(vocab) at the start
