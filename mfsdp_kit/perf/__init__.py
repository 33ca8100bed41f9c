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
"""
