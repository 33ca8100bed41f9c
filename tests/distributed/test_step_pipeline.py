"""The optimizer step's stages compose in step_pipeline.ORDER whatever order they are added in."""
import itertools

import pytest

from mfsdp_kit.distributed import step_pipeline
from mfsdp_kit.config import ConfigError


class TorchOpt:
    def __init__(self, log):
        self.log = log

    def step(self):
        self.log.append("adam")


class MegatronOpt:
    """megatron's optimizer: its step calls the inner torch optimizer's step in the middle."""
    def __init__(self, log):
        self.log, self.optimizer = log, TorchOpt(log)

    def step(self):
        self.log.append("megatron:norm+clip")
        self.optimizer.step()
        self.log.append("megatron:copy-main")
        return "stepped"


def marking(name):
    def wrap(step, owner):
        def marked(*a, **kw):
            owner_log = owner.log
            owner_log.append(f"{name}:before")
            out = step(*a, **kw)
            owner_log.append(f"{name}:after")
            return out
        return marked
    return wrap


EXPECTED = ["phase_timing:before", "offload:before", "megatron:norm+clip", "grad_upcast:before", "adam",
            "grad_upcast:after", "megatron:copy-main", "offload:after", "phase_timing:after"]


@pytest.mark.parametrize("order", list(itertools.permutations(step_pipeline.OUTER + step_pipeline.INNER)))
def test_any_add_order_gives_the_stated_order(order):
    log = []
    opt = MegatronOpt(log)
    for name in order:
        step_pipeline.add(opt, stage=name, wrap=marking(name))
    assert opt.step() == "stepped"
    assert log == EXPECTED
    assert step_pipeline.stages(opt) == [s for s in step_pipeline.ORDER if s in order]


def test_adding_a_stage_again_replaces_it():
    log = []
    opt = MegatronOpt(log)
    step_pipeline.add(opt, stage="offload", wrap=marking("first"))
    step_pipeline.add(opt, stage="offload", wrap=marking("offload"))
    opt.step()
    assert log == ["offload:before", "megatron:norm+clip", "adam", "megatron:copy-main", "offload:after"]


def test_an_unknown_stage_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="phase_timing \\| offload \\| grad_upcast"):
        step_pipeline.add(MegatronOpt([]), stage="clip", wrap=marking("clip"))


def test_the_order_is_the_documented_one():
    assert step_pipeline.ORDER == ("phase_timing", "offload", "megatron", "grad_upcast", "adam")
    assert all(f"    {name}" in step_pipeline.__doc__ for name in step_pipeline.ORDER)
