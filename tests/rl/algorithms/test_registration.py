"""rl.algorithms.registration: every algorithm of the kit registered once with a documented config, a config found
by its class (or its nearest registered base), an unregistered one and a taken name refused, PPO without a critic
named."""
from dataclasses import dataclass, fields

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.fieldtypes import field_docs
from mfsdp_kit.rl import core, loop
from mfsdp_kit.rl.algorithms import (DAPO, GRPO, PPO, REGISTRY, REINFORCE_PP, RLOO, Algorithm, DAPOConfig, GRPOConfig,
                                     PPOConfig, ReinforcePPConfig, RLOOConfig, of, register)
from mfsdp_kit.rl.algorithms.grpo import clipped_loss


def test_each_algorithm_of_the_kit_is_registered_by_its_config():
    pairs = {GRPO: GRPOConfig, DAPO: DAPOConfig, RLOO: RLOOConfig, REINFORCE_PP: ReinforcePPConfig, PPO: PPOConfig}
    assert {a.name for a in pairs} <= REGISTRY.keys()
    for algorithm, config in pairs.items():
        assert algorithm.config is config and of(config()) is algorithm and REGISTRY[algorithm.name] is algorithm


def test_every_registered_config_documents_each_field():
    """A config's fields are the algorithm's bench and CLI options (`perf.options`): each says what it does."""
    undocumented = {a.name: sorted({f.name for f in fields(a.config)} - field_docs(a.config).keys())
                    for a in REGISTRY.values()}
    assert not any(undocumented.values()), undocumented


def test_a_subclass_is_its_nearest_registered_base_and_a_bare_config_is_refused():
    @dataclass(kw_only=True)
    class MyGRPO(GRPOConfig):
        note: str = "mine"
    assert of(MyGRPO()) is GRPO and of(RLOOConfig()) is RLOO   # RLOOConfig subclasses GRPOConfig: its own first
    with pytest.raises(ConfigError, match=r"cfg=RolloutConfig\(\.\.\.\) is not allowed; allowed: the config of a "
                                          r"registered algorithm \(.*GRPOConfig"):
        of(core.RolloutConfig())


def test_a_name_is_one_algorithms():
    @dataclass(kw_only=True)
    class Other(GRPOConfig):
        pass
    with pytest.raises(ValueError, match="algorithm 'grpo' is registered already, for GRPOConfig"):
        register(Algorithm(name="grpo", config=Other, loss=clipped_loss))
    assert REGISTRY["grpo"] is GRPO


def test_ppo_without_a_critic_says_what_it_needs():
    r = torch.tensor([1.0, 0.0])
    batch = core.RolloutBatch(prompts=[("p", "")], prompt_ids=[[0]], completions=[[1], [1]], rewards=r, solved=r >= 1,
                              group_size=2)
    models = loop.Models(chunks=[], optimizer=None, bridge=None, rollout=None)
    with pytest.raises(ValueError, match=r"PPO needs a value model: Models\(critic=critic.Critic"):
        PPO.advantages(batch, PPOConfig(samples_per_prompt=2), models=models, seq_len_tokens=4, pad_id=0)
