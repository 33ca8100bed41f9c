"""Measuring training: what the benchmarks in bench/ compute, as library code they and the tests import.

- `clock`: the one timer of device work (CUDA events on a GPU, the host clock after a synchronize elsewhere);
- `stopwatch`: host work split into phases that sum to its total (a cluster's start, a checkpoint's save and load);
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
imports only `flops` (notebook_model's MFU), `timeline` / `profile`'s trace analysis (plots), `options` (rl.cli),
`clock` (rl.rollout's per-batch timer, offload) and `stopwatch` (checkpoint, cluster), which bring nothing of the
training stack at import time.
tests/test_layout.py (`PERF_FOR_THE_RUNTIME`) checks both.
"""
