"""perf.options: bench options made from the config dataclasses (flag, type, choices, help, default), and back."""
import argparse
import re

import pytest

from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.fieldtypes import field_docs
from mfsdp_kit.perf import options
from mfsdp_kit.rl import core, dapo, grpo
from mfsdp_kit.train import StepOptions


def parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    options.add_options(p, grpo.GRPOConfig, prefix="grpo", names=dict(prompts_per_iteration="prompts"),
                        skip=("max_new_tokens",), **kw)
    return p


def test_parsed_options_build_the_config_the_dataclass_would():
    args = parser(defaults=dict(num_minibatches=2)).parse_args(
        ["--grpo-prompts", "16", "--grpo-loss-level", "sequence", "--no-grpo-score-at-temperature",
         "--grpo-min-advantage", "0.0"])
    cfg = options.build(grpo.GRPOConfig, args, prefix="grpo", max_new_tokens=9)
    assert cfg == grpo.GRPOConfig(prompts_per_iteration=16, loss_level="sequence", score_at_temperature=False,
                                  min_advantage=0.0, num_minibatches=2, max_new_tokens=9)


def test_help_comes_from_the_field_docstrings_and_choices_from_the_annotation():
    text = parser().format_help()
    assert "Ratio clip: the loss stops pushing" in text and "GRPOConfig.clip_eps" in text
    with pytest.raises(SystemExit):
        parser().parse_args(["--grpo-loss-level", "batch"])


def test_field_docs_cover_the_bases():
    docs = field_docs(grpo.GRPOConfig)
    assert docs["clip_eps"].startswith("Ratio clip") and docs["samples_per_prompt"].startswith("Completions")


MEASURED = re.compile(r"[+-]?\d+(\.\d+)?\s?(ms|GB/s|GiB|MiB|tokens/s|x faster)\b|[+-]\d+(\.\d+)?\s?(%|points)")
"""What a measured number looks like in prose: a time, a bandwidth, a memory delta, a speed-up."""


@pytest.mark.parametrize("cls", [EngineConfig, OptimConfig, core.RolloutConfig, grpo.GRPOConfig, dapo.DAPOConfig,
                                 StepOptions])
def test_config_docstrings_say_what_an_option_does_not_what_it_measured(cls):
    """Numbers go stale in docstrings: they live in docs/benchmarks.md, which the docstring links."""
    found = {name: m.group(0) for name, doc in field_docs(cls).items() if (m := MEASURED.search(doc))}
    assert not found, f"{cls.__name__}: measured numbers in field docstrings (move them to docs/benchmarks.md): {found}"


def test_an_optional_bool_field_takes_true_false_none():
    parser = argparse.ArgumentParser()
    options.add_options(parser, core.RolloutConfig, prefix="")
    assert options.build(core.RolloutConfig, parser.parse_args(["--packed", "false"]), prefix="").packed is False
    assert options.build(core.RolloutConfig, parser.parse_args([]), prefix="").packed is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--packed", "maybe"])


def test_step_options_take_a_required_field_with_a_default_and_skip_what_no_command_line_spells():
    p = argparse.ArgumentParser()
    options.add_options(p, StepOptions, prefix="", defaults=dict(micro_batch_size=4))
    flags = set(vars(p.parse_args([])))
    assert {"micro_batch_size", "max_tokens_per_micro_batch", "packed"} <= flags
    assert not {"loss_fn", "scheduler"} & flags   # a function and a scheduler: the script passes them to build
    sched = type("Sched", (), {"step": lambda self, increment: None})()
    built = options.build(StepOptions, p.parse_args(["--packed", "false"]), prefix="", scheduler=sched)
    assert built == StepOptions(micro_batch_size=4, packed=False, scheduler=sched)
    bare = argparse.ArgumentParser()
    options.add_options(bare, StepOptions, prefix="")   # no default for a required field: no option
    assert "micro_batch_size" not in vars(bare.parse_args([]))
