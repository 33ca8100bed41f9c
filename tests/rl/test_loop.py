"""rl.loop without a model: an iteration whose filter keeps nothing makes no update, one History for every
algorithm under its old names, and the old config keywords (gcfg=, dcfg=, pcfg=) forwarded to cfg=."""
import math
import warnings
from dataclasses import dataclass

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import core, dapo, grpo, loop, ppo, renamed
from mfsdp_kit.rl.algorithms import REGISTRY, Algorithm, GRPOConfig, Sampled, register
from mfsdp_kit.rl.algorithms.grpo import clipped_loss


@dataclass(kw_only=True)
class KeepsNothing(GRPOConfig):
    """A filter that drops every group (as DAPO's does when every group scored alike)."""


def drop_all(models, cfg, *, draw, reward, index) -> Sampled:
    prompts = draw(cfg.prompts_per_iteration)
    r = torch.tensor([reward(p, "x") for p, _ in prompts for _ in range(cfg.samples_per_prompt)])
    batch = core.RolloutBatch(prompts=prompts, prompt_ids=[[0, 1]] * len(prompts), completions=[[2]] * len(r),
                              rewards=r, solved=reward.solved(r), group_size=cfg.samples_per_prompt)
    return Sampled(everything=batch, kept=batch.select_groups([]), metrics=dict(groups_kept=0))


def test_an_iteration_whose_filter_keeps_nothing_makes_no_update():
    register(Algorithm(name="keeps-nothing", config=KeepsNothing, loss=clipped_loss, sample=drop_all))
    try:
        m = loop.iteration(models=None, cfg=KeepsNothing(prompts_per_iteration=2, samples_per_prompt=2),
                           draw=lambda k: [("1+1=", "2"), ("2+2=", "4")][:k], reward_fn=lambda p, c: 0.5,
                           seq_len_tokens=8)
    finally:
        del REGISTRY["keeps-nothing"]
    assert m["reward"] == 0.5 and m["accuracy"] == 0.0 and m["groups_kept"] == 0
    assert m["logprob_passes"] == 0 and m["train_s"] == 0.0 and math.isnan(m["kl"]) and math.isnan(m["loss"])


def test_one_history_under_the_old_names():
    assert grpo.GRPOHistory is dapo.DAPOHistory is ppo.PPOHistory is loop.History
    fields = vars(loop.History())
    assert {"reward", "kl", "groups_kept", "sampling_rounds", "value_loss", "critic_s"} <= fields.keys()
    with pytest.raises(AttributeError, match="has no attribute 'NoHistory'"):
        grpo.NoHistory


def test_an_old_name_warns_once_naming_the_new_one():
    __getattr__ = renamed.aliases("mfsdp_kit.somewhere", {"Old": (loop.History, "mfsdp_kit.rl.loop.History")})
    says = r"^mfsdp_kit.somewhere.Old is deprecated: use mfsdp_kit.rl.loop.History$"
    with pytest.warns(DeprecationWarning, match=says):
        assert __getattr__("Old") is loop.History
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert __getattr__("Old") is loop.History


@pytest.mark.parametrize("fit, old", [(grpo.fit, "gcfg"), (dapo.fit, "dcfg")])
def test_an_old_config_keyword_reaches_cfg(fit, old):
    """The config arrives as `cfg`: a config no algorithm registers is refused by that name."""
    with pytest.raises(ConfigError, match=r"^cfg=RolloutConfig\(\.\.\.\) is not allowed"):
        fit(chunks=[], optimizer=None, bridge=None, rollout=None, prompt_pool=[], reward_fn=None, iterations=1,
            **{old: core.RolloutConfig()})
    with pytest.raises(TypeError, match=f"got both {old}= and its new name cfg="):
        fit(chunks=[], optimizer=None, bridge=None, rollout=None, prompt_pool=[], reward_fn=None, iterations=1,
            cfg=core.RolloutConfig(), **{old: core.RolloutConfig()})
    with pytest.raises(ConfigError, match=r"^cfg=RolloutConfig"):
        ppo.fit(chunks=[], optimizer=None, critic_chunks=[], critic_optimizer=None, bridge=None, rollout=None,
                prompt_pool=[], reward_fn=None, iterations=1, pcfg=core.RolloutConfig())


def test_a_renamed_keyword_warns_once():
    @renamed.renamed("f", old="new")
    def f(*, new):
        return new
    with pytest.warns(DeprecationWarning, match=r"^f\(old=\.\.\.\) is deprecated: pass new=\.\.\. instead$"):
        assert f(old=1) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(old=2) == 2 and f(new=3) == 3
