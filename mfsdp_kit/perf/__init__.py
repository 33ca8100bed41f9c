"""Measuring training: what the benchmarks in bench/ compute, as library code they and the tests import.

- `flops`: FLOPs per token (PaLM's accounting) and MFU;
- `timeline`: a torch.profiler trace's GPU kernels as intervals, and how much NCCL time no compute hides;
- `peaks`: peak device memory per training phase, and freeing every model between measurements;
- `variants`: the named engine configurations a benchmark compares (ddp, fsdp, fsdp2, fsdp-*);
- `trainers`: one training step of each variant behind one interface (megatron's, torch FSDP2's);
- `capacity`: the search for the largest model that trains (calibrate, predict, verify);
- `roundtrip`: HF -> Megatron -> HF, checked and timed;
- `hf_folder`: HF folders of a named real shape (Qwen2.5-7B) written by transformers, or only their config and tensor names;
- `report`: a run's JSON, written where --out says.

The boundary: perf sits above the runtime (it imports engine, train, models, memory), and the rest of the kit
imports only `flops` (notebook_model's MFU), `timeline` / `profile`'s trace analysis (plots) and `options` (rl.cli),
which bring nothing of the training stack at import time. The timers the runtime itself uses live below it:
`distributed.clock` (the one timer of device work) and `distributed.stopwatch` (host work in phases).
tests/test_layout.py (`PERF_FOR_THE_RUNTIME`) checks both.
"""
