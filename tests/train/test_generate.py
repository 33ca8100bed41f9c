"""Greedy decoding stops on the tokenizer's stop ids (eos and the template's end-of-turn)."""
import pytest

from mfsdp_kit.train.generate import cut_at_stop
from tests.dist.launch import run


def test_cut_at_the_first_stop_id():
    assert cut_at_stop([5, 6, 7, 8], [7, 9]) == [5, 6, 7]
    assert cut_at_stop([5, 9, 7, 8], [7, 9]) == [5, 9]   # whichever stop id comes first
    assert cut_at_stop([5, 6, 7, 8], 6) == [5, 6]        # a single id still works
    assert cut_at_stop([5, 6], [7]) == [5, 6] and cut_at_stop([], [7]) == []


@pytest.mark.slow
def test_greedy_stops_like_transformers(tmp_path):
    """2 Megatron-FSDP ranks, prompts of 3 lengths: the same tokens as HF greedy with the same stop
    list, cut after the stop id, and fewer forwards than max_new_tokens per length group once all stop."""
    r = run("scenarios_chat:greedy_stops", workdir=str(tmp_path), max_new_tokens=12)
    assert r["megatron"] == r["hf"], r
    assert all(row[-1] in r["stop_ids"] for row in r["megatron"][:1] + r["megatron"][3:4])
    # one decode loop per prompt length (4, 6, 7); with these weights the rows of lengths 4 and 7
    # stop after 2 tokens, the length-6 group has rows that never stop: 2 + 12 + 2 forwards
    ended = [len(r["megatron"][3]), max(len(r["megatron"][i]) for i in (0, 1, 4)), len(r["megatron"][2])]
    assert r["forwards"] == sum(ended) < 3 * 12
    assert r["forwards_unstopped"] == 3 * 12 and r["unstopped"] == [12] * 4   # rank 0's share: 1 + 2 + 1 rows


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_logits_of_rows_of_different_lengths(backend):
    """`logits(lengths=)`, one rank: packed (SDPA) or padded (local attention), each row's logits are those of
    the row alone up to its length, 0 after it; `last_only` is each row's last real position."""
    import torch
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.train import generate
    from mfsdp_kit.config import EngineConfig
    from mfsdp_kit.models import GPTSpec, gpt_model_fn
    from tests.dist.launch import free_port
    cfg = EngineConfig(attention_backend=backend)
    runtime.init(cfg, rank=0, world_size=1, master_port=free_port())
    try:
        chunks = engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64, vocab_size=128, seq_len_tokens=9), cfg))
        tokens = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(0))
        lengths = [9, 2, 5]
        full = generate.logits(chunks, tokens, lengths=lengths, vocab_size=100)
        last = generate.logits(chunks, tokens, lengths=lengths, last_only=True, vocab_size=100)
        for i, n in enumerate(lengths):
            alone = generate.logits(chunks, tokens[i:i + 1, :n], vocab_size=100)[0]
            assert (full[i, :n] - alone).abs().max().item() < 1e-5 and full[i, n:].abs().sum() == 0
            assert (last[i, 0] - alone[-1]).abs().max().item() < 1e-5
        assert full.shape == (3, 9, 100) and last.shape == (3, 1, 100)
    finally:
        runtime.shutdown()
