"""bench/memory_cap.py: the fastest setting whose peak fits, per system (rows as candidates() makes them)."""
from bench.memory_cap import best_under


def row(system, tokens, peak, mb=8, recompute="none"):
    return dict(system=system, tokens_per_s_per_gpu=tokens, peak_gib=peak, micro_batch_size=mb, recompute=recompute)


def test_best_under_a_cap():
    rows = [row("fsdp", 56e3, 72.5, mb=16), row("fsdp", 53e3, 42.0), row("fsdp", 41e3, 16.1, recompute="full"),
            row("fsdp2", 57e3, 69.1, mb=16), row("ddp", 56e3, 43.3)]
    at40, at80 = best_under(rows, 40), best_under(rows, 80)
    assert at40["fsdp"]["recompute"] == "full" and at40["fsdp2"] is None and at40["ddp"] is None
    assert at80["fsdp"]["micro_batch_size"] == 16 and at80["fsdp2"]["tokens_per_s_per_gpu"] == 57e3
    assert best_under(rows, 42.0)["fsdp"]["peak_gib"] == 42.0   # at the cap counts
