"""compat.access.router_replay: megatron still routes through its RouterReplay as the kit relies on (a canary),
and the installed megatron-core is the version the row cites."""
from mfsdp_kit.compat import registry
from mfsdp_kit.compat.access import router_replay


def test_still_routed_through_router_replay_and_written_for_this_version():
    assert router_replay.ROW.still_needed(), "megatron's routing no longer calls RouterReplay.get_replay_topk or " \
                                             "no longer gathers the router's scores: re-check models.router_replay"
    assert registry.written_for_installed("megatron-core"), registry.WRITTEN_FOR


def test_moe_layer_numbers_follow_megatrons_rule():
    from types import SimpleNamespace as C
    assert router_replay.moe_layer_numbers(C(num_moe_experts=4, moe_layer_freq=1, num_layers=3)) == [1, 2, 3]
    assert router_replay.moe_layer_numbers(C(num_moe_experts=4, moe_layer_freq=2, num_layers=4)) == [1, 3]
    assert router_replay.moe_layer_numbers(C(num_moe_experts=4, moe_layer_freq=[0, 1, 1], num_layers=3)) == [2, 3]
    assert router_replay.moe_layer_numbers(C(num_moe_experts=None, moe_layer_freq=1, num_layers=3)) == []
