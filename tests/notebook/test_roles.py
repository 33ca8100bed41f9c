"""roles.py on real CPU engines (ipyparallel, gloo): `cluster.start(3, rollout_engines=1)` gives a trainer world of
two and one rollout engine outside it, linked to trainer rank 0; `rl.decoupled` runs across them from the notebook
(one-step off-policy: versions, updates, the rollout's record, its row in `handle.status()`); Stop (SIGINT to this process, the notebook) while
the trainers wait for samples stops both sides within seconds, the trainers at one iteration with one line, the
rollout engine's `serve` with the trainer's reason; `relink()` then runs them again. Bad `rollout_engines` values
are refused by name before anything starts; `reinit()` and `restart()` keep the roles."""
import os
import signal
import threading
import time

import pytest

from mfsdp_kit.notebook import cluster, roles
from mfsdp_kit.notebook.cluster import ClusterConfigError

BOUND_S = 120
SETUP = '''
import time
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from mfsdp_kit.rl import decoupled
pool = [(f"{a}+{b}=", str(a + b)) for a in range(5) for b in range(5)]
'''
TRAINER = '''
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.models.hf import load
from mfsdp_kit.rl import loop
from mfsdp_kit.rl.algorithms.grpo import GRPOConfig
cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp32", seed=3)
runtime.init(cfg)

def fit(iterations, max_staleness):
    model = load(src, cfg)
    models = loop.Models(chunks=model.chunks, bridge=model.bridge, rollout=None,
                         optimizer=engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg))
    return decoupled.fit(models=models, cfg=GRPOConfig(prompts_per_iteration=2, samples_per_prompt=2,
                                                       max_new_tokens=4, micro_batch_size=2, seed=1),
                         link=link, tokenizer=AutoTokenizer.from_pretrained(src), prompt_pool=pool,
                         iterations=iterations, max_staleness=max_staleness, progress=False)
'''
ROLLOUT = '''
from mfsdp_kit.rl.rollout import HFRollout
backend = HFRollout(AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src))

def serve(slow_s=0.0):
    def reward(prompt, completion):
        time.sleep(slow_s)   # a slow verifier: the trainers wait for the samples
        return float(len(completion) % 2)
    return decoupled.serve(link=link, backend=backend, prompt_pool=pool, reward_fn=reward)
'''


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    from mfsdp_kit.models import archs
    src = str(archs.write_tiny("Qwen2ForCausalLM", tmp_path_factory.mktemp("roles") / "tiny", vocab_size=256))
    handle = cluster.start(3, device="cpu", rollout_engines=1, stall_s=30.0)
    handle.view.push(dict(src=src), block=True)
    handle.rollout_view.push(dict(src=src), block=True)
    handle.run(SETUP + TRAINER)
    handle.rollout_view.execute(SETUP + ROLLOUT, block=True)
    yield handle
    handle.stop()


def test_rollout_engines_stay_out_of_the_world_with_a_link_to_rank_0(h):
    assert h.ranks == [0, 1] and len(h.rollout_ids) == 1 and h.rollout_devices == ["cpu"]
    assert "rollout_engines=['cpu']" in repr(h)
    h.run("world, has_link = dist.get_world_size(), link is not None")
    assert h.view["world"] == [2, 2] and h.view["has_link"] == [True, False] and h.view["role"] == ["trainer"] * 2
    h.rollout_view.execute("in_world, link_at = dist.is_initialized(), (link.rank, link.size)", block=True)
    assert h.rollout_view["in_world"] == [False] and h.rollout_view["link_at"] == [(1, 2)]
    assert h.rollout_view["role"] == ["rollout"] and h.rollout_view["link_rank"] == [1]


def test_decoupled_runs_across_the_roles_one_step_off_policy(h):
    served = h.rollout_view.execute("served = serve()", block=False)
    h.run("history = fit(3, 1)", timeout_s=BOUND_S)
    served.get(timeout=BOUND_S)
    assert h.rollout_view["served"] == [dict(versions=[0, 0, 1], stopped=None)]
    assert h.view["history.policy_version"] == [[0, 1, 2]] * 2 and h.view["history.staleness_max"] == [[0, 1, 1]] * 2
    assert h.view["history.groups_stale"] == [[0, 0, 0]] * 2
    deadline = time.monotonic() + 10   # the rollout engine's row in handle.status(): its last report, its log
    while (h.status().ranks[2].get("progress") or {}).get("step") != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    row = h.status().ranks[2]
    assert row["state"] == "rollout" and row["progress"]["step"] == 3 and row["progress"]["version"] == 1, row
    assert sorted(h.status().ranks) == [0, 1, 2] and os.path.isfile(h.logs[2])


def test_stop_while_the_trainers_wait_stops_the_rollout_engine_too_and_relink_runs_again(h, capsys):
    served = h.rollout_view.execute("served = serve(slow_s=2.0)", block=False)   # 4 rewards: 8 s an iteration
    threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT)).start()   # Stop, while rank 0 waits for samples
    t0 = time.monotonic()
    h.run("history = fit(20, 1)", timeout_s=BOUND_S)   # returns: Stop is no error
    trainer_s = time.monotonic() - t0
    served.get(timeout=BOUND_S)
    rollout_s = time.monotonic() - t0
    out = capsys.readouterr().out
    print(f"trainers back {trainer_s - 4:.1f} s after Stop, the rollout engine {rollout_s - 4:.1f} s", out)
    assert "grpo (decoupled): stopped at step 0 of 20 on every rank" in out, out
    assert h.view["len(history.policy_version)"] == [0, 0]
    stopped = h.rollout_view["served"][0]["stopped"]
    assert stopped in ("the trainer stopped after 0 of 20 iterations", "rollout process 1 stopped before iteration 1")
    assert trainer_s < 4 + 10 and rollout_s < 4 + 15   # one reward call and a poll, not the link's 600 s timeout
    h.relink()
    served = h.rollout_view.execute("served = serve()", block=False)
    h.run("history = fit(2, 0)", timeout_s=BOUND_S)
    served.get(timeout=BOUND_S)
    assert h.rollout_view["served"] == [dict(versions=[0, 1], stopped=None)]
    assert h.view["history.policy_version"] == [[0, 1]] * 2


@pytest.mark.parametrize("how", ["reinit", "restart"])
def test_a_new_world_keeps_the_roles_and_links_again(h, how):
    getattr(h, how)()
    assert h.ranks == [0, 1] and len(h.rollout_ids) == 1 and h.view["role"] == ["trainer"] * 2
    h.run("import torch.distributed as dist\nworld, has_link = dist.get_world_size(), link is not None")
    assert h.view["world"] == [2, 2] and h.view["has_link"] == [True, False]
    h.rollout_view.execute("import torch.distributed as dist\nin_world, link_at = dist.is_initialized(), "
                           "(link.rank, link.size)", block=True)
    assert h.rollout_view["in_world"] == [False] and h.rollout_view["link_at"] == [(1, 2)]
    assert h.rollout_view["role"] == ["rollout"]


@pytest.mark.parametrize("value", [3, -1, True, 1.0])
def test_bad_rollout_engines_are_refused_by_name(value):
    with pytest.raises(ClusterConfigError, match=f"rollout_engines={value!r} is not allowed; allowed: an integer"):
        roles.check(n=3, rollout_engines=value)
    with pytest.raises(ClusterConfigError, match="rollout_engines=2 is not allowed"):
        cluster.start(2, device="cpu", rollout_engines=2)
