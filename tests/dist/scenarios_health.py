"""Training-health scenarios on the embedded tiny model (run by launch.run): a dead model warns, a NaN
loss_mask stops with the step named."""
from __future__ import annotations

import math
import warnings

from mfsdp_kit.train import data
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.train import BadBatchError, DeadModelWarning, fit, vocab_size_of

from scenarios_train import tiny_world


def _model(workdir: str, lr: float):
    cfg, src, tok = tiny_world(fsdp=True, workdir=workdir)
    model = load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=lr), cfg)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16, global_batch=8,
                           seed=1)
    return model, opt, batches


def dead_model(*, workdir: str, lr: float, steps: int = 8) -> dict:
    """fit at `lr`: the DeadModelWarnings it gives, the losses and grad norms, and ln(vocab)."""
    model, opt, batches = _model(workdir, lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(model.chunks, opt, batches, steps=steps, micro_batch_size=4, progress=False)
    dead = [str(w.message) for w in caught if issubclass(w.category, DeadModelWarning)]
    vocab = vocab_size_of(model.chunks)
    runtime.shutdown()
    return dict(warnings=dead, loss=history.loss, grad_norm=history.grad_norm, ln_vocab=math.log(vocab))


def nan_loss_mask(*, workdir: str, bad_step: int = 2) -> dict:
    """A NaN in one batch's loss_mask at `bad_step`: fit must stop there with an error naming it."""
    model, opt, batches = _model(workdir, 1e-3)

    def poisoned():
        for i, b in enumerate(batches):
            if i == bad_step:
                b.loss_mask[1, 3] = float("nan")
            yield b

    result = dict(error=None, error_type=None)
    try:
        fit(model.chunks, opt, poisoned(), steps=4, micro_batch_size=4, progress=False)
    except BadBatchError as e:
        result.update(error=str(e), error_type=[c.__name__ for c in type(e).__mro__])
    runtime.shutdown()
    return result
