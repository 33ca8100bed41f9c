"""gpu_check's sections as data: one `Row` per run (name, script, arguments, what it writes), grouped by the names
SECTIONS takes. scripts/gpu_check.sh prepares the node and, per name, runs the shell lines this prints:

    python3 scripts/gpu_sections.py --ngpu 2 --results runs/gpu checkpoint_shm   # the lines for one name
    python3 scripts/gpu_sections.py --list                                       # every name, its rows
    python3 scripts/gpu_sections.py --json                                       # every row, resolved

A row's `args` is one shell-like string: {ngpu}, {results} and the knobs in KNOBS (environment variables with
defaults, as gpu_check.sh always took them) are filled in, then it is split as the shell splits words. `writes`
adds `--out {results}/<writes>` at the end, or where the args say {out}. torchtitan keeps its experiments the same
way (`OverrideDefinitions`): adding one is adding a row.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, replace

LAUNCH = {"trun": "trun", "torchrun1": "torchrun --nproc_per_node 1 --master_port $((29400 + RANDOM % 1000))",
          "python": "python3", "bash": "bash"}
"""How a row's script starts; `trun` is gpu_check.sh's torchrun over NGPU GPUs (these are shell text, not quoted)."""
KNOBS = {"GRPO_LR": "3e-5", "GRPO_ITERS": "180", "GRPO_TAG": None, "GRPO_ARGS": "", "NB_PREWRITE": "1",
         "NOTEBOOKS": "", "SFT_VARIANTS": "ddp-local,fsdp-local,ddp-sdpa,fsdp-sdpa,ddp-sdpa-fused,fsdp-sdpa-fused",
         "NB_SETUP_PROFILE": "40", "CS_REPEATS": "3", "CS_VARIANTS": "plain,preload,noimport", "CS_MODEL": "",
         "LOAD_ROOT": "/dev/shm", "GRPO_BACKENDS": "continuous",
         "ROLLOUT_VARIANTS": "compiled,eager",
         "PACKING_WAYS": "padded,packed-sdpa,packed-flex", "PACKING_SFT_WAYS": "padded,packed-sdpa,packed-flex",
         "PACKING_ARGS": "", "GRPO_ITER_ARGS": "", "ROWS": ""}
"""Environment variables some rows read, with their defaults (GRPO_TAG's: lr<GRPO_LR>). ROWS (row names, comma-
separated) runs only those rows of the sections named, e.g. the rest of a release run cut short by a time limit."""


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    """The section's name in the output: its log is $RESULTS/<name>.log."""
    script: str
    """What runs: a bench/ script, or `-m module`, started by `launch`."""
    args: str = ""
    """Its arguments (see the module docstring)."""
    writes: str | None = None
    """The JSON file it writes under $RESULTS (None: its log only)."""
    launch: str = "trun"
    """A key of LAUNCH."""
    env: str = ""
    """VAR=value words set for this row only (shell text)."""
    prefix: str = ""
    """Shell text before the command (`$IMAGE_ENV`, `env VAR=...`)."""
    globs: str = ""
    """Arguments the shell expands at run time (file patterns), after the rest."""
    after: str = ""
    """A shell command run after the section (cleanup)."""
    needs: str = ""
    """A folder that must exist, else the row fails with a message naming `made_by`, the section that makes it."""
    made_by: str = ""
    only_if: str = ""
    """KNOB=value: run only when the knob has that value."""


COLD = "TRITON_CACHE_DIR=/tmp/cold_{0}/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cold_{0}/inductor"
"""A row's env for compile caches that hold nothing (`first_iteration`): what a fresh machine's first run meets."""
CLEAN_COLD = "rm -rf /tmp/cold_{0}"
CK = "--layers 16 --hidden 1024 --heads 16 --vocab 32768 --seq 1024 --dtype bf16"
SHM = "--root /dev/shm/mfsdp_ckpt"
CLEAN_SHM = "rm -rf /dev/shm/mfsdp_ckpt"
THROUGHPUT = "--spec 1.7b --attention sdpa"
T = "bench/throughput.py"
IMPORTS_SH = ('for i in 1 2; do /usr/bin/time -f "run $i: %e s" python3 -X importtime \\\n'
              '                  -c "import mfsdp_kit, megatron.core" 2> "$0/importtime$i.txt"; tail -1 "$0/importtime$i.txt"; done\n'
              '                  sort -t"|" -k2 -n -r "$0/importtime2.txt" | head -30')


def ckpt(name: str, args: str, writes: str, *, after: str = "") -> Row:
    return Row(name=name, script="bench/checkpoint.py", args=args, writes=writes, after=after)


SECTIONS = {
    "parity": [Row(name="parity", script="bench/parity.py", args="--dtype bf16", writes="parity.json")],
    "roundtrip": [Row(name="roundtrip", script="bench/roundtrip.py", args="--size m --dtype bf16", writes="roundtrip.json")],
    # MoE router replay in bf16: routing flips between the rollout engine and the trainer, the log-prob mismatch
    # with and without replay (issue 71; error figures, no floor)
    "router_replay": [Row(name="router_replay", script="bench/router_replay.py",
                          args="--dtype bf16 --prompts 16 --samples 4 --max-new-tokens 64", writes="router_replay.json")],
    # GRPO, in two steps that share runs/ on one warm node (a call's machine stays warm ~30 s):
    # grpo_start: 2-digit SFT, then 3-digit SFT rounds until held-out >= 0.2 (reached at 600 steps: 0.233);
    # saves the start. grpo: GRPO_ITERS iterations of 64 prompts x 16 samples at GRPO_LR, sampling at T 0.5
    # (near the greedy answer the held-out accuracy scores), from that start, against the gold-SFT control
    # (as many SFT steps at the same lr from the same start); held-out greedy and sampled accuracy.
    # GRPO_ARGS adds (or, as later flags win, overrides) bench/sft_grpo.py flags; GRPO_TAG names the log and JSON.
    "grpo_start": [Row(name="grpo_start", script="bench/sft_grpo.py", writes="grpo_start.json",
                       args="--size m --sft-steps 400 --rl-digits 3 --heldout 400 --rl-start-accuracy 0.2 "
                            "--save-rl-start runs/m3d_start --grpo-iterations 0")],
    "grpo": [Row(name="grpo_{GRPO_TAG}", script="bench/sft_grpo.py", writes="grpo_{GRPO_TAG}.json", needs="runs/m3d_start",
                 made_by="grpo_start",
                 args="--size m --skip-sft1 --rl-digits 3 --heldout 400 --rl-sft-steps 0 --init-from runs/m3d_start "
                      "--save-rl-start /tmp/m3d_copy --ceiling-sft-steps {GRPO_ITERS} --ceiling-sft-lr {GRPO_LR} "
                      "--grpo-prompts 64 --grpo-samples 16 --grpo-minibatches 1 --grpo-reward digits "
                      "--grpo-temperature 0.5 --grpo-lr {GRPO_LR} --grpo-warmup 10 --grpo-iterations {GRPO_ITERS} "
                      "--grpo-eval-every 30 --grpo-micro-batch-size 256 {GRPO_ARGS}")],
    # the planned sync (weights.plan) and the bridge path, with the all-gather / on-device copy ceiling of the same ranks
    "sync": [Row(name="sync", script="bench/sync.py", args="--size l --repeats 5", writes="sync_l.json")],
    # a 7.6 B Qwen2.5-7B-shaped model (random megatron chunks from the bridge's provider, the rollout built from the
    # config on the GPU, checked bit-exact against the bridge's export), Megatron-FSDP only, planned path only
    "sync_7b": [Row(name="sync_7b", script="bench/sync.py", args="--shape qwen2.5-7b --modes fsdp --paths planned --repeats 5",
                    writes="sync_7b.json")],
    "offload": [Row(name="offload", script="bench/offload.py", args="--size l --repeats 3", writes="offload_l.json")],
    "checkpoint": [ckpt("checkpoint_fsdp", f"--fsdp {CK}", "checkpoint_fsdp.json"),
                   ckpt("checkpoint_fsdp_async", f"--fsdp {CK} --async-save --probe-mb 0", "checkpoint_fsdp_async.json"),
                   ckpt("checkpoint_fsdp_shm", f"--fsdp {CK} {SHM}", "checkpoint_fsdp_shm.json", after=CLEAN_SHM),
                   ckpt("checkpoint_ddp", f"{CK} --probe-mb 0", "checkpoint_ddp.json")],
    # memory-backed storage only: the kit's own save/load path, every phase in the JSON (save_phases_s, load_phases_s);
    # default (no host staging, background prune, 8 writer/reader threads on GPU nodes), the format before (raw bytes,
    # which stock torch cannot read: the A/B of the default, same node), staged (the A/B), 16 threads, async
    "checkpoint_shm": [
        ckpt("checkpoint_fsdp_shm", f"--fsdp {CK} --repeats 5 {SHM} --probe-mb 1024", "checkpoint_fsdp_shm.json", after=CLEAN_SHM),
        ckpt("checkpoint_fsdp_shm_raw", f"--fsdp {CK} --repeats 5 {SHM} --tensor-format raw --probe-mb 0",
             "checkpoint_fsdp_shm_raw.json", after=CLEAN_SHM),
        ckpt("checkpoint_fsdp_shm_staged", f"--fsdp {CK} --repeats 5 {SHM} --host-staging on --probe-mb 0",
             "checkpoint_fsdp_shm_staged.json", after=CLEAN_SHM),
        ckpt("checkpoint_fsdp_shm_t16", f"--fsdp {CK} --repeats 5 {SHM} --threads 16 --read-threads 16 --probe-mb 0",
             "checkpoint_fsdp_shm_t16.json", after=CLEAN_SHM),
        ckpt("checkpoint_fsdp_async", f"--fsdp {CK} --repeats 5 --async-save --probe-mb 0 {SHM}",
             "checkpoint_fsdp_async_shm.json", after=CLEAN_SHM)],
    # the checkpoint tests that move tensors between GPU and host (items through pinned buffers), ~2 min
    "gpu_tests_ckpt": [Row(name="gpu_tests_ckpt", script="-m pytest", launch="python",
                           args="-q -p no:cacheprovider tests/checkpoint/test_format.py tests/checkpoint/test_checkpoint.py "
                                "-k 'roundtrip or resume or async or io_options or reshard or format'")],
    # the tests that only a GPU can decide (e.g. that train.start_step makes no host-blocking CUDA call; that public
    # calls take CPU inputs for a GPU model), ~1 min
    # (and that engines started with device="cpu" see none of the node's GPUs; that a killed kernel's engines and
    # controller exit, under the image's Python; that Stop pauses a %%px fit on an NCCL engine, 02_sft's cells in a
    # real kernel)
    "gpu_tests_gpu": [Row(name="gpu_tests_gpu", script="-m pytest", launch="python",
                          args="-q -p no:cacheprovider tests/train/test_train.py tests/notebook/test_gpus.py tests/distributed/test_grad_upcast.py "
                               "tests/notebook/test_cluster.py tests/distributed/test_keep_gathered.py tests/models/test_varlen.py "
                               "tests/rl/rollout/test_engine.py tests/rl/rollout/test_model_runner.py tests/distributed/test_runtime.py "
                               "tests/train/test_token_budget.py tests/distributed/test_engine.py tests/notebook/test_kernel_stop.py "
                               "-k 'on_a_gpu or gpus or cpu_engines or kernel_that_started_them or barrier or stop_during_fit'")],
    # every architecture that works on CPU (docs/architectures.md), written by transformers, on the GPUs: TP 1 (and 2
    # on two GPUs), the notebooks' GPU attention, fp32: logits, loss, greedy tokens, export, save_hf reload vs HF
    "archs": [Row(name="archs", script="-m tests.models.arch_table", launch="python", args="--gpus {ngpu} {out}",
                  writes="architectures_gpu.json")],
    "gpu_tests": [Row(name="gpu_tests", script="-m pytest", launch="python",   # NCCL, one GPU per rank
                      args="-q -p no:cacheprovider tests/checkpoint/test_checkpoint.py tests/checkpoint/test_hardening.py")],
}


def throughput(name: str, args: str, *, writes: str | None = None, env: str = "", launch: str = "trun") -> Row:
    return Row(name=name, script=T, args=f"{THROUGHPUT} {args}", writes=writes or f"{name}.json", env=env, launch=launch)


def levers(name: str, modes: str, *, batch: str = "32", steps: int = 5, fused_ce: bool = False, profile: str = "",
           pipelined: bool = False) -> Row:
    """A set of levers: micro-batch 8, 3 interleaved repeats of `modes`, the first round profiled for `profile`."""
    return throughput(name, f"--micro-batch-size 8 --global-batch {batch} --steps {steps} --warmup 2 --fused-kernels"
                      + " --fused-cross-entropy" * fused_ce + " --repeats 3" + " --pipelined" * pipelined
                      + (f" --profile --profile-modes {profile}" if profile else "") + f" --modes {modes}")


SECTIONS.update({
    # headline: fused RoPE/SwiGLU in every mode, fsdp-unfused = the same FSDP without them;
    # profile of ddp/fsdp/fsdp2; traces: $RESULTS/throughput.<mode>.trace.json.gz
    "throughput": [throughput("throughput", "--micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 --fused-kernels "
                              "--profile --modes ddp,fsdp,fsdp2,fsdp-unfused")],
    # two ways to cut FSDP's per-step all-gathers / their cost (not in the default SECTIONS):
    # one micro-batch of 16 per rank (weights gathered once per step, not twice), and NCCL's Simple protocol
    "throughput_mb16": [throughput("throughput_mb16", "--micro-batch-size 16 --global-batch 32 --steps 6 --warmup 2 "
                                   "--fused-kernels --profile --modes ddp,fsdp,fsdp2")],
    # FSDP's prefetch budget (suggested_communication_unit_size) against its peak memory, at mb 16
    "throughput_unit": [throughput("throughput_unit", "--micro-batch-size 16 --global-batch 32 --steps 6 --warmup 2 "
                                   "--fused-kernels --modes fsdp,fsdp-unit-1e9,fsdp2")],
    "throughput_unit8": [throughput("throughput_unit8", "--micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 "
                                    "--fused-kernels --modes fsdp,fsdp-unit-1e9,fsdp2")],
    # the large end (the largest size where all three modes fit): 7b spec, mb 2, where all three modes fit
    "throughput_7b": [Row(name="throughput_7b", script=T, writes="throughput_7b.json",
                          args="--spec 7b --attention sdpa --micro-batch-size 2 --global-batch 8 --steps 4 --warmup 2 "
                               "--fused-kernels --modes ddp,fsdp,fsdp2")],
    # the same at micro-batch 4 (the kit's defaults since 2026-11-30: fused Adam, 2-layer FSDP unit): MFU at 7b
    "throughput_7b_mb4": [Row(name="throughput_7b_mb4", script=T, writes="throughput_7b_mb4.json",
                              args="--spec 7b --attention sdpa --micro-batch-size 4 --global-batch 16 --steps 4 --warmup 2 "
                                   "--fused-kernels --modes ddp,fsdp,fsdp2")],
    "throughput_simple": [throughput("throughput_simple", "--micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 "
                                     "--fused-kernels --modes ddp,fsdp,fsdp2", env="NCCL_PROTO=Simple")],
    # the eighth set: Megatron-FSDP keeping each unit's gathered weights through the step (fsdp_keep_gathered: one
    # all-gather per unit per step instead of 2 per micro-batch; same bits, CPU test) beside the three systems and
    # FSDP2's same trade (fsdp2-keep-gathered), pipelined steps. On one GPU the buffers are not sharded: the gathers
    # it saves are one-rank copies, so there it measures the hooks' host work (and runs the CUDA path).
    "levers8": [levers("levers8", "ddp,fsdp,fsdp-keep-gathered,fsdp2,fsdp2-keep-gathered", batch="{gb16}", steps=6,
                        fused_ce=True, pipelined=True)],
    # the FSDP knobs, unfused (docs/results/h200x2/throughput_knobs.json); not in the default SECTIONS
    "throughput_knobs": [throughput("throughput_knobs", "--micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 "
                                    "--profile --modes ddp,fsdp,fsdp2,fsdp-no-overlap,fsdp-unit2x,fsdp-recompute,"
                                    "fsdp-optoffload")],
    # issue 22's levers, each one knob from the kit's defaults (fused Adam and the 2-layer FSDP unit since
    # 2026-11-30), all in one run, 3 interleaved repeats (medians); fsdp and fsdp2 profiled in the first round
    "levers": [levers("levers", "ddp,fsdp,fsdp2,fsdp-foreach-adam,ddp-foreach-adam,fsdp-unit-1e9,fsdp-grad-fp32,"
                       "fsdp-double-buffer,fsdp-nccl-ub", profile="fsdp,fsdp2")],
    # the second set of levers: Megatron-FSDP's all-gathers on their own communicator, high-priority NCCL
    # streams, megatron's native fused cross-entropy (2026-12-01)
    "levers2": [levers("levers2", "ddp,fsdp,fsdp2,fsdp-ag-group,fsdp-high-prio,fsdp-ag-group-hp,fsdp-ce-fusion",
                        profile="fsdp,fsdp-ag-group")],
    # the third set: NCCL's SM budget. Data-parallel collectives capped at 8 / 16 CTAs (Hopper default 32 of 132 SMs),
    # so the GEMMs they overlap keep more SMs (2026-12-01)
    "levers3": [levers("levers3", "ddp,fsdp,fsdp2,fsdp-ctas8,fsdp-ctas16,ddp-ctas8", profile="fsdp,fsdp-ctas8")],
    # the fourth set, compute side (runs on 1 GPU too; global batch 16 per GPU = 2 micro-batches, as on 2 GPUs):
    # the kit's cross-entropy on each system, 3 interleaved repeats; fsdp profiled with and without (2026-12-01)
    "levers4": [levers("levers4", "ddp,fsdp,fsdp2,ddp-fused-ce,fsdp-fused-ce,fsdp2-fused-ce", batch="{gb16}",
                        profile="fsdp,fsdp-fused-ce")],
    # the fifth set: megatron's finalize_model_grads (a host sync on the token count after backward) against the
    # kit's engine.finalize_grads, at the kit's GPU settings (fused RoPE/SwiGLU and cross-entropy); 1 GPU or more
    "levers5": [levers("levers5", "ddp,fsdp,fsdp2,ddp-megatron-finalize,fsdp-megatron-finalize", batch="{gb16}",
                        fused_ce=True, profile="fsdp,fsdp-megatron-finalize")],
    # the sixth set: the same systems as levers5, each step timed alone (synchronized before and after) and as a
    # loop that starts each step before it reads the last one's loss (--pipelined: train.start_step, no host sync)
    "levers6": [levers(f"levers6_{how}", "ddp,fsdp,fsdp2", batch="{gb16}", steps=6, fused_ce=True,
                       pipelined=how == "pipelined") for how in ("alone", "pipelined")],
    # the seventh set: Megatron-FSDP's fp32 grads for Adam made a part at a time inside the step (grad_upcast, the
    # default since 2026-12-01) vs megatron's whole-shard copy held through the step: tokens/s and the step's peak at
    # 1.37 B; max_model_upcast: the largest 7b-width model of each beside FSDP2's (1 GPU or more)
    "levers7": [levers("levers7", "fsdp,fsdp-upcast-whole,fsdp2", batch="{gb16}", steps=6, fused_ce=True)],
    # (without recompute, and with full recompute: activations then no longer hide the optimizer step's peak)
    "max_model_upcast": [Row(name=f"max_model_upcast_{rc}", script="bench/max_model.py",
                             args=f"--spec 7b --modes fsdp,fsdp-upcast-whole,fsdp2 --recompute {rc} --layer-step 2 "
                                  "--max-trials 8", writes=f"max_model_upcast_{rc}.json") for rc in ("none", "full")],
    # the same with two micro-batches a step: FSDP2's fp32 grads then also live through a forward
    "max_model_accum": [Row(name="max_model_accum", script="bench/max_model.py", writes="max_model_accum.json",
                            args="--spec 7b --modes fsdp,fsdp2 --micro-batches 2 --layer-step 2 --max-trials 8")],
    # each non-GEMM op of a step alone: megatron's kernel vs the kit's, time, memory held, error (bench/fusions.py)
    "fusions": [Row(name="fusions", script="bench/fusions.py", launch="torchrun1", writes="fusions.json",
                    args="--spec 1.7b --micro-batch-size 8")],
    # the three systems at their defaults, 3 interleaved repeats: the ratios issue 22 asks for. The kit's GPU
    # settings: fused RoPE/SwiGLU and, since levers4 (2026-12-01: +1.9 % tokens/s, -1 GiB peak), fused cross-entropy
    "headline": [levers("headline", "ddp,fsdp,fsdp2", fused_ce=True, profile="fsdp,fsdp2")],
    # tokens/s under a memory cap: each system at micro-batch 4 and 16 without recompute and 8 with full
    # recompute (mb 8 without: the headline section); bench/memory_cap.py picks the best under 40 and 80 GiB
    "memcap": [*(throughput(f"memcap_mb{mb}", f"--micro-batch-size {mb} --global-batch 32 --steps 4 --warmup 2 "
                            "--fused-kernels --modes ddp,fsdp,fsdp2") for mb in (4, 16)),
               throughput("memcap_mb8_recompute", "--micro-batch-size 8 --global-batch 32 --steps 4 --warmup 2 "
                          "--fused-kernels --modes ddp-recompute,fsdp-recompute,fsdp2-recompute"),
               Row(name="memory_cap", script="bench/memory_cap.py", launch="python", args="--caps 40 80 {out}",
                   writes="memory_cap.json", globs='"$RESULTS"/headline.json "$RESULTS"/memcap_mb*.json')],
    # packed sequences vs padding (issue #38): real tokens/s at 1.37 B on 1 GPU, SFT-like and RL-like length mixes,
    # padded vs packed (varlen flash attention) vs packed through flex_attention, micro-batch budgets equal in
    # positions (8 rows x S, throughput1's micro-batch); peak memory and the padding fraction of the padded batches
    # (not in the default SECTIONS). The RL mix's ways are PACKING_WAYS, the SFT mix's PACKING_SFT_WAYS.
    "packing": [Row(name=f"packing_{mix}", script="bench/packing.py", launch="torchrun1", writes=f"packing_{mix}.json",
                    args=f"--spec 1.7b --mixes {mix} --ways {{{knob}}} --sequences 64 "
                         "--micro-batch-size 8 --steps 5 --warmup 2 {PACKING_ARGS}")
                for mix, knob in (("rl", "PACKING_WAYS"), ("sft", "PACKING_SFT_WAYS"))],
    # the attention kernels for one packed RL row alone (FA2 varlen, cuDNN ragged, per sequence, padded dense):
    # agreement with an fp32 reference and TFLOP/s, to pick the packed path's kernel (not in the default SECTIONS)
    "varlen_kernels": [Row(name="varlen_kernels", script="bench/varlen_kernels.py", launch="python",
                           args="--mix rl --budget 9216 --heads 16 --head-dim 128", writes="varlen_kernels.json")],
    # the 1-GPU column of the same comparison
    "throughput1": [throughput("throughput1", "--micro-batch-size 8 --global-batch 16 --steps 6 --warmup 2 "
                               "--fused-kernels --modes ddp,fsdp,fsdp2", writes="throughput_1gpu.json", launch="torchrun1")],
    # not in the default SECTIONS: largest 7b-width model, Megatron-FSDP vs DDP (~12 builds of up to ~15 B params)
    "max_model": [Row(name="max_model", script="bench/max_model.py", args="--spec 7b --max-trials 8", writes="max_model.json")],
    # the largest 7b-width model, Megatron-FSDP vs FSDP2 (issue 22 item 2)
    "max_model_fsdp2": [Row(name="max_model_fsdp2", script="bench/max_model.py", writes="max_model_fsdp2.json",
                            args="--spec 7b --modes fsdp,fsdp2 --layer-step 4 --max-trials 8")],
})
SECTIONS.update({
    # where 02_sft's GPU step goes (32 sequences of 16 tokens in fp32, the notebooks' GPU model by default): the
    # notebook's recipe per wrapper x attention backend x fused kernels; kernels, host copies and syncs per step
    "sft_step": [Row(name="sft_step", script="bench/sft_step.py", args="{out} --variants {SFT_VARIANTS}",
                     writes="sft_step.json")],
    # where a notebook's set-up goes on the node: the one-time tiny model write (draw, write), then models.hf.load's
    # phases per wrapper in the notebooks' GPU dtype, the first steps, and cProfile's top functions of the loads
    "nb_setup": [Row(name="nb_setup", script="bench/notebook_setup.py", args="--profile {NB_SETUP_PROFILE}",
                     writes="notebook_setup.json")],
    # every notebook under nbval with %px engines on the GPUs (the .whl/ Jupyter stack), timed per notebook
    # the notebooks' model is written first, as `make lab` does while JupyterLab starts (its seconds in
    # notebook_model.log); NB_PREWRITE=0 leaves that to the first notebook, as on a machine without `make lab`
    "notebooks": [Row(name="notebook_model", script="-m mfsdp_kit.notebook.model", launch="python", only_if="NB_PREWRITE=1"),
                  Row(name="notebooks", script="bench/notebook_suite.py", launch="python", args="{out} {NOTEBOOKS}",
                      writes="notebooks.json")],
    # the same on a folder the kit did not make (tests/user_folder.py: transformers' Llama, a Llama 3 template
    # trained by tokenizers, no pad token), as MFSDP_MODEL=/path/to/your/folder make lab gives it to the notebooks
    "notebooks_user": [Row(name="user_folder", script="-m tests.user_folder", launch="python",
                           args="/tmp/mfsdp_user_llama3 --style llama3"),
                       Row(name="notebooks_user", script="bench/notebook_suite.py", launch="python",
                           prefix="env MFSDP_MODEL=/tmp/mfsdp_user_llama3", args="{out} {NOTEBOOKS}",
                           writes="notebooks_user.json")],
    # 06_memory's speed table outside nbval (which keeps no output): tokens/s, MFU, memory vs ZeRO
    "nb_throughput": [Row(name="nb_throughput", script="bench/notebook_throughput.py", writes="notebook_throughput.json")],
    # MoE (Qwen3-MoE-shaped moe-1.3b, 0.26 B active): DDP vs Megatron-FSDP at expert-parallel size 1 vs 2
    "moe": [Row(name="moe", script="bench/moe_throughput.py", writes="moe_throughput.json",
                args="--spec moe-1.3b --micro-batch-size 4 --steps 8 --warmup 2")],
    # engines up: cluster.start / restart / stop phases with one engine per GPU (not torchrun: the bench starts them)
    # CS_MODEL (a tiny size): the engines load and train it before restart and stop, as a notebook's do;
    # $IMAGE_ENV: the image's bytecode settings, as a user's engines start
    "cluster_start": [Row(name="cluster_start", script="bench/cluster_start.py", launch="python", prefix="$IMAGE_ENV",
                          args="--n {ngpu} --repeats {CS_REPEATS} --variants {CS_VARIANTS} {CS_MODEL_FLAG} {out}",
                          writes="cluster_start.json")],
    # where an engine's imports go (issue 21: engines up fast): -X importtime of the kit + megatron, twice
    # (the second run finds whatever bytecode the first wrote), the 30 largest cumulative entries; then whether
    # bytecode is cached where the image keeps its packages, and what CUDA costs an engine before its first kernel
    "imports": [Row(name="imports", script="-c", launch="bash", args=shlex.quote(IMPORTS_SH).replace("{", "{{")
                    .replace("}", "}}") + " {results}"),
                Row(name="pyc_cache", script="bench/pyc_cache.py", launch="python")],
    # a ~7.6 B HF folder (Qwen2.5-7B shape, random bf16, safetensors shards) written on this node, then
    # models.hf.load's phases into Megatron-FSDP on every GPU: time, host RSS and GPU memory per rank
    "load_7b": [Row(name="load_7b", script="bench/load_hf.py", args="--shape qwen2.5-7b --root {LOAD_ROOT} --train-steps 1",
                    writes="load_7b.json")],
    # issue 37: HF generate vs the kit's engine (rl.rollout.ContinuousRollout) on one GPU, the floor beside them,
    # then its bf16 greedy tokens and log-probs against HF's; rollout_7b: the same at the 7 B shape
    "rollout": [Row(name="rollout", script="bench/rollout.py", launch="python",
                    args="--shape qwen2-1.8b --batches 1,64,256,512 --variants {ROLLOUT_VARIANTS}",
                    writes="rollout.json")],
    # issue 72 item 3: the prefill of 16 prompts of 1,024 tokens x 8 samples (GRPO's rows) with each prompt prefilled
    # once and its KV copied to its samples (`DecodeConfig.share_prefill`, the default) against a prefill per row:
    # prefill seconds, the prompt tokens each ran, the same tokens sampled (no decode rows: --batches '')
    "rollout_prefill": [Row(name="rollout_prefill", script="bench/rollout.py", launch="python",
                            writes="rollout_prefill.json",
                            args="--shape qwen2-1.8b --batches '' --prompt-tokens 1024 --shared-prefill 16 --samples 8 "
                                 "--repeats 5 --agreement-rows 0")],
    # issue 72 item 2: FP8 rollout weights (`DecodeConfig.weights="fp8"`) against bf16 at 7 B, 64 rows: decode ms a
    # step beside each one's weights floor ("weights ms"), the greedy check's log-prob mismatch against the bf16 model;
    # then the GPU tests of the FP8 GEMMs and of the engine with them (close to bf16, a refresh picked up)
    "rollout_fp8": [Row(name="rollout_fp8", script="bench/rollout.py", launch="python", writes="rollout_fp8.json",
                        args="--shape qwen2-7b --batches 64 --variants compiled,fp8 --agreement-rows 64 "
                             "--hf-new-tokens 8"),
                    Row(name="rollout_fp8_tests", script="-m pytest", launch="python",
                        args="-q -p no:cacheprovider tests/rl/rollout/kernels/test_fp8.py "
                             "tests/rl/rollout/test_fp8_weights.py")],
    # GRPO from grpo_start's start with the rollout's weights bf16, then FP8, both with rollout_correction
    # token-truncate: reward and train-rollout log-prob mismatch per iteration, held-out accuracy every 30
    "grpo_fp8": [Row(name=f"grpo_rollout_{w}", script="bench/sft_grpo.py", writes=f"grpo_rollout_{w}.json",
                     needs="runs/m3d_start", made_by="grpo_start",
                     args="--size m --skip-sft1 --rl-digits 3 --heldout 400 --rl-sft-steps 0 --init-from runs/m3d_start "
                          "--grpo-prompts 64 --grpo-samples 16 --grpo-minibatches 1 --grpo-reward digits "
                          "--grpo-temperature 0.5 --grpo-lr {GRPO_LR} --grpo-warmup 10 --grpo-iterations 60 "
                          "--grpo-eval-every 30 --grpo-micro-batch-size 256 --grpo-rollout-correction token-truncate "
                          f"--rollout-weights {w}") for w in ("model", "fp8")] + [
        # the same comparison at 1.7 B (`l`, untrained) in bench/grpo_iteration.py: each iteration's time split too
        Row(name="grpo_iteration_fp8", script="bench/grpo_iteration.py", writes="grpo_iteration_fp8.json",
            args="--size l --iterations 4 --backends continuous,continuous_fp8 --rollout-correction token-truncate")],
    # issue 40: LoRA rank 16 on every linear vs full fine-tuning on 1 GPU, the Qwen2.5-7B-shaped folder of load_7b
    # (written under LOAD_ROOT, removed after): peak GiB, tokens/s, optimizer state against 12 B per trainable param;
    # then the largest 7b-width GPT each trains on 1 GPU (max_model's search, the fsdp-lora16 variant)
    "lora": [Row(name="lora", script="bench/lora.py", launch="torchrun1", args="--shape qwen2.5-7b --root {LOAD_ROOT}",
                 writes="lora.json"),
             Row(name="lora_max_model", script="bench/max_model.py", launch="torchrun1", writes="lora_max_model.json",
                 args="--spec 7b --modes fsdp,fsdp-lora16 --layer-step 4 --max-trials 8 --trial-timeout-s 600")],
    # where a decode step's GPU time goes at 256 rows: kernels of the eager engine, the captured step, `pick`
    "rollout_profile": [Row(name="rollout_profile", script="bench/rollout.py", launch="python", writes="rollout_profile.json",
                            args="--shape qwen2-1.8b --batches 256 --variants compiled --hf-new-tokens 2 "
                                 "--agreement-rows 0 --profile-batch 256")],
    # what making a cache's graphs up front costs (`model_runner.ModelRunner.cache_for`, 81 graphs at 512 x 576) and one capture's parts
    "rollout_capture": [Row(name="rollout_capture", script="bench/rollout.py", launch="python",
                            writes="rollout_capture.json",
                            args="--shape qwen2-1.8b --batches 2 --new-tokens 8 --variants compiled --hf-new-tokens 2 "
                                 "--agreement-rows 0 --capture-split 512,576")],
    # the decode step in the kit's Triton kernels (DecodeConfig.kernels, "auto" on a GPU): their GPU tests, decode
    # attention alone against cuDNN's SDPA per rows x bucket, then GRPO iterations with them and with the torch path
    "decode_kernels": [
        Row(name="decode_kernels_tests", script="-m pytest", launch="python",
            args="-q -p no:cacheprovider tests/rl/rollout/kernels/test_attention.py tests/rl/rollout/kernels/test_elementwise.py "
                 "tests/rl/rollout/test_model_runner.py tests/rl/rollout/kernels/test_draw.py "
                 "-k 'gpu or kernels or rope or add_rms or splits or draw'"),
        Row(name="decode_attention", script="bench/decode_attention.py", launch="python", writes="decode_attention.json"),
        Row(name="grpo_iteration_triton", script="bench/grpo_iteration.py", writes="grpo_iteration_triton.json",
            args="--size l --iterations 3 --profile --backends continuous_triton,continuous_torch")],
    # issue 49: RoPE and SwiGLU in the kit's Triton kernels (`kernels.fusion_kernels`, "auto" on a GPU): their tests on the
    # GPU, and each op alone against torch.compile's kernels (first call = compile, kernel time, error)
    "training_kernels": [
        Row(name="training_kernels_tests", script="-m pytest", launch="python",
            args="-q -p no:cacheprovider tests/models/test_triton_fusions.py tests/models/test_fusions.py "
                 "tests/models/test_triton_launch.py tests/perf/test_compile_time.py"),
        Row(name="fusions_triton", script="bench/fusions.py", launch="torchrun1", writes="fusions_triton.json",
            args="--spec 1.7b --micro-batch-size 8 --ops rope,swiglu", env=COLD.format("fusions"),
            after=CLEAN_COLD.format("fusions"))],
    # issue 49: the first iteration on compile caches that hold nothing (torch.compile's and Triton's), one process
    # each: the torch path (torch.compile, cuDNN) against the Triton kernels (the default on a GPU since 2026-12-05)
    "first_iteration": [
        Row(name=f"grpo_first_{kind}", script="bench/grpo_iteration.py", writes=f"grpo_first_{kind}.json",
            args=f"--size l --iterations 2 {args}", env=COLD.format(kind), after=CLEAN_COLD.format(kind))
        for kind, args in (("torch", "--backends continuous_torch --fusion-kernels torch"),
                           ("triton", "--backends continuous_triton --fusion-kernels triton"))],
    # the same first iteration with the decode kernels compiled ahead on threads (the default) and one by one at
    # their first launch: serial, ahead, serial, so that neither alone is the machine's first process
    # (ROWS=grpo_first_ahead,grpo_first_serial_b: ahead first, on the colder machine)
    "compile_ahead": [
        Row(name=f"grpo_first_{name}", script="bench/grpo_iteration.py", writes=f"grpo_first_{name}.json",
            args=f"--size l --iterations 1 --backends {backend}", env=COLD.format(name), after=CLEAN_COLD.format(name))
        for name, backend in (("serial_a", "continuous_serial"), ("ahead", "continuous"),
                              ("serial_b", "continuous_serial"))],
    # the update's token budget: the default (`train.token_budget.memory_budget`) against fixed budgets, three
    # iterations each with the last profiled (its host gaps named by the host events under them) and each
    # iteration's peak memory
    "update_budget": [
        Row(name=f"grpo_budget_{name}", script="bench/grpo_iteration.py", writes=f"grpo_budget_{name}.json",
            args=f"--size l --iterations 3 --profile --backends continuous {args}")
        for name, args in (("auto", ""), ("12k", "--max-tokens-per-micro-batch 12288"),
                           ("16k", "--max-tokens-per-micro-batch 16384"),
                           ("24k", "--max-tokens-per-micro-batch 24576"))],
    # the same update with each FSDP unit gathered once a step (`fsdp_keep_gathered`): at the default budget and 12k
    "update_keep": [
        Row(name=f"grpo_keep_{name}", script="bench/grpo_iteration.py", writes=f"grpo_keep_{name}.json",
            args=f"--size l --iterations 3 --profile --backends continuous --keep-gathered on {args}")
        for name, args in (("auto", ""), ("12k", "--max-tokens-per-micro-batch 12288"))],
    "rollout_7b": [Row(name="rollout_7b", script="bench/rollout.py", launch="python", writes="rollout_7b.json",
                       args="--shape qwen2-7b --batches 1,64,256 --variants compiled --hf-new-tokens 16")],
    # issue 37: one GRPO iteration of tiny `l` (64 prompts x 8 samples, <= 512 new tokens), split into sync /
    # rollout / logprob / update seconds, HF generate against the kit's engine
    # (GRPO_BACKENDS: a subset of hf,continuous,continuous_freed; GRPO_ITER_ARGS: more options, e.g. --fused-kernels)
    # issue 49 item 5, the seed's scale: the Qwen2.5-7B shape (random bf16 weights under LOAD_ROOT, removed after),
    # LoRA rank 16, 32 prompts x 8 samples, <= 1024 new tokens; the iteration split with its floors
    "grpo_lora_7b": [Row(name="grpo_lora_7b", script="bench/grpo_iteration.py", writes="grpo_lora_7b.json",
                         args="--shape qwen2.5-7b --root {LOAD_ROOT} --lora-rank 16 --prompts 32 --samples 8 "
                              "--max-new-tokens 1024 --iterations 3 --backends continuous --profile")],
    # issue 71, partial rollouts on 1 GPU: the tiny `l` GRPO setting (untrained: long responses) at <= 2,048 new
    # tokens, rollout seconds per iteration without and with (half the groups in flight end an iteration's sampling,
    # staleness <= 2); then the reward curves of both from the SFT'd start grpo_start writes (60 iterations each)
    "grpo_partial": [Row(name=f"grpo_partial_{name}", script="bench/grpo_iteration.py", writes=f"grpo_partial_{name}.json",
                         args=f"--size l --prompts 32 --samples 8 --max-new-tokens 2048 --iterations 4 "
                              f"--backends continuous {extra}")
                     for name, extra in (("off", ""), ("on", "--partial-fraction 0.5 --max-staleness 2"))],
    "grpo_partial_rewards": [Row(name=f"grpo_partial_rewards_{name}", script="bench/sft_grpo.py",
                                 writes=f"grpo_partial_rewards_{name}.json", needs="runs/m3d_start",
                                 made_by="grpo_start",
                                 args="--size m --skip-sft1 --rl-digits 3 --heldout 400 --rl-sft-steps 0 "
                                      "--init-from runs/m3d_start --grpo-prompts 64 --grpo-samples 16 "
                                      "--grpo-minibatches 1 --grpo-reward digits --grpo-temperature 0.5 "
                                      "--grpo-lr {GRPO_LR} --grpo-warmup 10 --grpo-iterations 60 "
                                      f"--grpo-eval-every 30 --grpo-micro-batch-size 256 {extra}")
                             for name, extra in (("off", ""), ("on", "--grpo-partial-fraction 0.5 "
                                                                     "--grpo-max-staleness 2"))],
    "grpo_iteration": [Row(name="grpo_iteration", script="bench/grpo_iteration.py",
                           args="--size l --iterations 4 --profile --backends {GRPO_BACKENDS} {GRPO_ITER_ARGS}",
                           writes="grpo_iteration.json")],
})
# issue 49: the decode batch buckets with 3/4 steps (`DecodeConfig.buckets_per_doubling` 2, the default) against
# the powers of two (`continuous_pow2`), each its own process (later iterations compared; the default's last profiled)
SECTIONS["decode_buckets"] = [
    SECTIONS["decode_kernels"][0],
    *[Row(name=f"grpo_{name}", script="bench/grpo_iteration.py", writes=f"grpo_{name}.json",
          args=f"--size l --backends {backend} {args}")
      for name, backend, args in (("pow2", "continuous_pow2", "--iterations 3"),
                                  ("buckets", "continuous", "--iterations 4 --profile"))]]
# issue 49: RoPE and the cache write inside the attention kernel (`DecodeConfig.fuse_rope`: one launch a layer
# fewer) and the draw in one kernel (`sampler="triton"`, a row split over programs below one row per SM), each against
# the default: the decode kernels' GPU tests, the rollout bench at 8, 32 and 256 rows (a 152k vocabulary: the draw's
# bytes), then GRPO iterations, one process each
SECTIONS["decode_levers"] = [
    SECTIONS["decode_kernels"][0],   # the kernels' tests (the engine's kernel-sampler test is in gpu_tests_gpu)
    Row(name="levers_rollout", script="bench/rollout.py", launch="python", writes="levers_rollout.json",
        args="--shape qwen2-1.5b --batches 8,32,256 --variants compiled,fused_rope,sampler --hf-new-tokens 2 "
             "--agreement-rows 64"),
    *[Row(name=f"grpo_{backend}", script="bench/grpo_iteration.py", writes=f"grpo_{backend}.json",
          args=f"--size l --iterations 3 --profile --backends {backend}")   # the 3rd profiled: kernels by name
      for backend in ("continuous", "continuous_fused_rope", "continuous_sampler")]]
# The release set (issue 50): what a change to mfsdp_kit/ or notebooks/ is checked and measured with, on 1 H200 in
# under 10 minutes. Each row writes the one current file of its kind under docs/results/<device>/ (RELEASE_FILES);
# `make docs` turns them into the README's figures and the top table of docs/benchmarks.md. Shorter than the
# sections they come from: rollout at 1 and 256 sequences (compiled graphs only), 3 GRPO iterations (the 1st, then
# steady ones), the RL mix packed vs padded, LoRA vs full fine-tuning without the largest-model search.
SECTIONS["release"] = [
    SECTIONS["notebooks"][0],   # three notebooks at once: their tiny models leave the GPU and most cores idle
    replace(SECTIONS["notebooks"][1], args="{out} --jobs 3 --balance docs/results/h200x1/notebooks.json {NOTEBOOKS}"),
    replace(SECTIONS["rollout"][0], args="--shape qwen2-1.8b --batches 1,256 --variants compiled --agreement-rows 64"),
    replace(SECTIONS["grpo_iteration"][0], args="--size l --iterations 3 --profile --backends continuous"),
    replace(SECTIONS["throughput1"][0], args=SECTIONS["throughput1"][0].args.replace("--steps 6", "--steps 4")),
    replace(SECTIONS["packing"][0], args="--spec 1.7b --mixes rl --ways padded,packed-sdpa --sequences 64 "
                                         "--micro-batch-size 8 --steps 4 --warmup 2"),
    replace(SECTIONS["lora"][0], args=SECTIONS["lora"][0].args + " --steps 3")]
# The check set: what a change to mfsdp_kit/ or notebooks/ must pass on a GPU, with no benchmark (the GPU-only
# tests, the decode kernels' tests, every notebook): about 5 minutes on 1 H100, for a session short of device time.
SECTIONS["check"] = [SECTIONS["gpu_tests_gpu"][0], SECTIONS["decode_kernels"][0], *SECTIONS["release"][:2]]
RELEASE_FILES = tuple(row.writes for row in SECTIONS["release"] if row.writes)
"""The release set's JSON files, one per section: docs/results/<device>/ keeps these (older runs: history/)."""
DEFAULT = "parity roundtrip sync offload checkpoint gpu_tests throughput throughput1 grpo_start grpo"
"""The names gpu_check.sh runs when SECTIONS is not set."""


def context(*, ngpu: int, results: str, env=os.environ) -> dict:
    """What a row's `args` may name: {ngpu}, {results}, {gb16} (16 sequences per GPU), the KNOBS (environment or
    default) and {CS_MODEL_FLAG} (--model CS_MODEL when set)."""
    ctx = {k: env.get(k, v) for k, v in KNOBS.items()}
    ctx["GRPO_TAG"] = env.get("GRPO_TAG") or f"lr{ctx['GRPO_LR']}"
    ctx["CS_MODEL_FLAG"] = f"--model {shlex.quote(ctx['CS_MODEL'])}" if ctx["CS_MODEL"] else ""
    return {**ctx, "ngpu": ngpu, "results": results, "gb16": 16 * ngpu}


def command(row: Row, ctx: dict) -> list[str]:
    """The row's words after its launcher: script, then its arguments (--out where {out} is, else last)."""
    out = f"--out {shlex.quote(ctx['results'] + '/' + row.writes.format(**ctx))}" if row.writes else ""
    args = row.args if "{out}" in row.args or not out else f"{row.args} {{out}}"
    return shlex.split(row.script) + shlex.split(args.format(**ctx, out=out))


def shell_lines(group: str, ctx: dict) -> list[str]:
    """What gpu_check.sh evaluates for the section `group`: per row `section NAME command`, then its `after`."""
    lines = []
    for row in SECTIONS[group]:
        knob, _, value = row.only_if.partition("=")
        if knob and ctx[knob] != value:
            continue
        name = row.name.format(**ctx)
        if ctx["ROWS"] and name not in ctx["ROWS"].split(","):
            continue
        run = " ".join(filter(None, [row.env, "section", shlex.quote(name), row.prefix, LAUNCH[row.launch],
                                     " ".join(shlex.quote(w) for w in command(row, ctx)), row.globs]))
        if row.needs:
            run = (f"if [ -d {row.needs} ]; then {run}; else echo \"{group}: {row.needs} missing: SECTIONS={row.made_by} "
                   "first\"; status=1; fi")
        lines += [run] + ([row.after] if row.after else [])
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="section names (SECTIONS)")
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--results", default="runs/gpu")
    ap.add_argument("--list", action="store_true", help="every name and its rows")
    ap.add_argument("--default", action="store_true", help="print the names run when SECTIONS is not set")
    ap.add_argument("--json", action="store_true", help="every row as JSON: section, name, command words, writes")
    args = ap.parse_args(argv)
    if args.default:
        print(DEFAULT)
        return 0
    ctx = context(ngpu=args.ngpu, results=args.results)
    if args.json:
        print(json.dumps([dict(section=group, name=r.name.format(**ctx), launch=r.launch, words=command(r, ctx),
                               writes=r.writes and r.writes.format(**ctx)) for group, rows in SECTIONS.items()
                          for r in rows], indent=1))
        return 0
    if args.list:
        for name, rows in SECTIONS.items():
            print(f"{name}: " + ", ".join(f"{r.name.format(**ctx)} ({r.script}"
                                          + (f" -> {r.writes.format(**ctx)})" if r.writes else ")") for r in rows))
        return 0
    unknown = [n for n in args.names if n not in SECTIONS]
    if unknown:
        print(f"unknown section {' '.join(unknown)}; known: {' '.join(SECTIONS)}", file=sys.stderr)
        return 1
    print("\n".join(line for n in args.names for line in shell_lines(n, ctx)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
