#!/usr/bin/env bash
# Everything GPU in one run: on a node with N GPUs (default: all) and no network, install the wheels
# carried in .whl/ (scripts/fetch_gpu_wheels.sh) over the node's own torch, then run each section
# under torchrun/NCCL. Each section prints its table and writes JSON under $RESULTS.
#   bash scripts/gpu_check.sh                 # all sections
#   SECTIONS="parity" NGPU=2 bash scripts/gpu_check.sh
#   SECTIONS="throughput max_model" bash scripts/gpu_check.sh   # max_model runs only when listed
#   SECTIONS="notebooks nb_throughput load_7b moe cluster_start" bash scripts/gpu_check.sh   # not in the default SECTIONS either
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# NVLink multicast stays off (shared hosts; see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
RESULTS=${RESULTS:-runs/gpu}
SECTIONS=${SECTIONS:-parity roundtrip sync offload checkpoint gpu_tests throughput throughput1 grpo_start grpo}
mkdir -p "$RESULTS"
if compgen -G ".whl/*.whl" >/dev/null; then
  # once per machine for a given set of wheels (a second gpu_check in the same call keeps the files, so their bytecode)
  stamp=$(ls .whl/*.whl | md5sum | cut -c1-32)
  if [ "$(cat /tmp/mfsdp_site/.wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mfsdp_site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
    echo "$stamp" > /tmp/mfsdp_site/.wheels
  fi
  export PYTHONPATH=/tmp/mfsdp_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# The image sets PYTHONDONTWRITEBYTECODE=1, so every process would compile torch, sympy and megatron from source
# (~10 s). Keep bytecode the way the kit's engines and `make lab` do (mfsdp_kit/cache.py); IMAGE_ENV undoes it
# for a section that measures what the kit itself does (cluster_start).
IMAGE_ENV="env PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-} PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-}"
eval "$(python3 -c 'from mfsdp_kit.cache import bytecode_env; print("".join(f"export {k}={v!r};" for k, v in bytecode_env().items()))')"
# The bytecode of every importable module, compiled here as `pip install` compiles it on a user's machine (the
# wheels above go in with --no-compile and the image keeps none): without this, each module's first importer pays
# its compile inside whatever section runs first (PRECOMPILE=0 leaves that as it is, to measure it).
if [ "${PRECOMPILE:-1}" = 1 ]; then
  t0=$SECONDS
  dirs=$(python3 -c 'import os, site, sys; print(*[d for d in sys.argv[1:] + site.getsitepackages() if os.path.isdir(d)])' \
         "$PWD/mfsdp_kit" /tmp/mfsdp_site)
  python3 -m compileall -q -j 0 $dirs >/dev/null 2>&1; rc=$?
  echo "bytecode: $dirs compiled in $((SECONDS - t0)) s into ${PYTHONPYCACHEPREFIX:-__pycache__}" \
       "(compileall rc $rc: 1 = some files are not valid Python, kept as source)" | tee "$RESULTS/bytecode.log"
fi
python3 -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__, "transformers", transformers.__version__, "mcore", m.__version__, "gpus", torch.cuda.device_count())'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

status=0
section() {  # section NAME command...: run, keep the log, remember failures
  local name=$1; shift
  echo; echo "================ $name ================"
  "$@" 2>&1 | grep -v -E "UserWarning|warnings.warn|FutureWarning|^\s*$" | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "SECTION $name FAILED rc=$rc"; status=1; }
  # On the device machine only a few files come back from $OUT: one archive of everything written so far
  # (after every section, so a run cut off by its time limit keeps what it measured).
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_check_results.tgz" -C "$RESULTS" . 2>/dev/null
  return 0
}
trun() { torchrun --nproc_per_node "$NGPU" --master_port $((29400 + RANDOM % 1000)) "$@"; }

for s in $SECTIONS; do
  case $s in
    parity)     section parity     trun bench/parity.py --dtype bf16 --out "$RESULTS/parity.json" ;;
    roundtrip)  section roundtrip  trun bench/roundtrip.py --size m --dtype bf16 --out "$RESULTS/roundtrip.json" ;;
    # GRPO, in two steps that share runs/ on one warm node (a call's machine stays warm ~30 s):
    # grpo_start: 2-digit SFT, then 3-digit SFT rounds until held-out >= 0.2 (reached at 600 steps: 0.233);
    # saves the start. grpo: GRPO_ITERS iterations of 64 prompts x 16 samples at GRPO_LR, sampling at T 0.5
    # (near the greedy answer the held-out accuracy scores), from that start, against the gold-SFT control
    # (as many SFT steps at the same lr from the same start); held-out greedy and sampled accuracy.
    # GRPO_ARGS adds (or, as later flags win, overrides) bench/sft_grpo.py flags; GRPO_TAG names the log and JSON.
    grpo_start) section grpo_start trun bench/sft_grpo.py --size m --sft-steps 400 --rl-digits 3 --heldout 400 \
                  --rl-start-accuracy 0.2 --save-rl-start runs/m3d_start --grpo-iterations 0 \
                  --out "$RESULTS/grpo_start.json" ;;
    grpo)       [ -d runs/m3d_start ] || { echo "grpo: runs/m3d_start missing: SECTIONS=grpo_start first"
                                           status=1; continue; }
                GRPO_LR=${GRPO_LR:-3e-5} GRPO_ITERS=${GRPO_ITERS:-180}
                GRPO_TAG=${GRPO_TAG:-lr$GRPO_LR}
                section "grpo_$GRPO_TAG" trun bench/sft_grpo.py --size m --skip-sft1 --rl-digits 3 --heldout 400 \
                  --rl-sft-steps 0 --init-from runs/m3d_start --save-rl-start /tmp/m3d_copy \
                  --ceiling-sft-steps "$GRPO_ITERS" --ceiling-sft-lr "$GRPO_LR" \
                  --grpo-prompts 64 --grpo-samples 16 --grpo-minibatches 1 --grpo-reward digits \
                  --grpo-temperature 0.5 --grpo-lr "$GRPO_LR" --grpo-warmup 10 --grpo-iterations "$GRPO_ITERS" \
                  --grpo-eval-every 30 --grpo-micro-batch-size 256 ${GRPO_ARGS:-} \
                  --out "$RESULTS/grpo_$GRPO_TAG.json" ;;
    # the planned sync (sync_plan) and the bridge path, with the all-gather / on-device copy ceiling of the same ranks
    sync)       section sync       trun bench/sync.py --size l --repeats 5 --out "$RESULTS/sync_l.json" ;;
    # a 7.6 B Qwen2.5-7B-shaped model (random megatron chunks from the bridge's provider, the rollout built from the
    # config on the GPU, checked bit-exact against the bridge's export), Megatron-FSDP only, planned path only
    sync_7b)    section sync_7b    trun bench/sync.py --shape qwen2.5-7b --modes fsdp --paths planned --repeats 5 \
                  --out "$RESULTS/sync_7b.json" ;;
    offload)    section offload    trun bench/offload.py --size l --repeats 3 --out "$RESULTS/offload_l.json" ;;
    checkpoint) CK="--layers 16 --hidden 1024 --heads 16 --vocab 32768 --seq 1024 --dtype bf16"
                section checkpoint_fsdp trun bench/checkpoint.py --fsdp $CK --out "$RESULTS/checkpoint_fsdp.json"
                section checkpoint_fsdp_async trun bench/checkpoint.py --fsdp $CK --async-save --probe-mb 0 \
                  --out "$RESULTS/checkpoint_fsdp_async.json"
                section checkpoint_fsdp_shm trun bench/checkpoint.py --fsdp $CK --root /dev/shm/mfsdp_ckpt \
                  --out "$RESULTS/checkpoint_fsdp_shm.json"; rm -rf /dev/shm/mfsdp_ckpt
                section checkpoint_ddp  trun bench/checkpoint.py $CK --probe-mb 0 --out "$RESULTS/checkpoint_ddp.json" ;;
    # memory-backed storage only: the kit's own save/load path, every phase in the JSON (save_phases_s, load_phases_s);
    # default (no host staging, background prune, 8 writer/reader threads on GPU nodes), staged (the A/B), 16 threads, async
    checkpoint_shm) CK="--layers 16 --hidden 1024 --heads 16 --vocab 32768 --seq 1024 --dtype bf16 --repeats 5"
                section checkpoint_fsdp_shm trun bench/checkpoint.py --fsdp $CK --root /dev/shm/mfsdp_ckpt --probe-mb 1024 \
                  --out "$RESULTS/checkpoint_fsdp_shm.json"; rm -rf /dev/shm/mfsdp_ckpt
                # the format before (raw bytes, which stock torch cannot read), same node: the A/B of the default
                section checkpoint_fsdp_shm_raw trun bench/checkpoint.py --fsdp $CK --root /dev/shm/mfsdp_ckpt \
                  --tensor-format raw --probe-mb 0 --out "$RESULTS/checkpoint_fsdp_shm_raw.json"; rm -rf /dev/shm/mfsdp_ckpt
                section checkpoint_fsdp_shm_staged trun bench/checkpoint.py --fsdp $CK --root /dev/shm/mfsdp_ckpt \
                  --host-staging on --probe-mb 0 --out "$RESULTS/checkpoint_fsdp_shm_staged.json"; rm -rf /dev/shm/mfsdp_ckpt
                section checkpoint_fsdp_shm_t16 trun bench/checkpoint.py --fsdp $CK --root /dev/shm/mfsdp_ckpt \
                  --threads 16 --read-threads 16 --probe-mb 0 --out "$RESULTS/checkpoint_fsdp_shm_t16.json"; rm -rf /dev/shm/mfsdp_ckpt
                section checkpoint_fsdp_async trun bench/checkpoint.py --fsdp $CK --async-save --probe-mb 0 \
                  --root /dev/shm/mfsdp_ckpt --out "$RESULTS/checkpoint_fsdp_async_shm.json"; rm -rf /dev/shm/mfsdp_ckpt ;;
    # the checkpoint tests that move tensors between GPU and host (raw items through pinned buffers), ~2 min
    gpu_tests_ckpt) section gpu_tests_ckpt python3 -m pytest -q -p no:cacheprovider tests/test_checkpoint_format.py \
                  tests/test_checkpoint.py -k "roundtrip or resume or async or io_options or reshard or format" ;;
    # the tests that only a GPU can decide (e.g. that train.start_step makes no host-blocking CUDA call), ~1 min
    # (and that engines started with device="cpu" see none of the node's GPUs; that a killed kernel's engines and
    # controller exit, under the image's Python)
    gpu_tests_gpu) section gpu_tests_gpu python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_gpus.py \
                  tests/test_grad_upcast.py tests/test_cluster.py tests/test_keep_gathered.py \
                  -k "on_a_gpu or gpus or cpu_engines or kernel_that_started_them" ;;
    # every architecture that works on CPU (docs/architectures.md), written by transformers, on the GPUs: TP 1 (and 2
    # on two GPUs), the notebooks' GPU attention, fp32: logits, loss, greedy tokens, export, save_hf reload vs HF
    archs)      section archs python3 -m tests.models.arch_table --gpus "$NGPU" --out "$RESULTS/architectures_gpu.json" ;;
    gpu_tests)  section gpu_tests  python3 -m pytest -q -p no:cacheprovider tests/test_checkpoint.py \
                  tests/test_checkpoint_hardening.py ;;  # NCCL, one GPU per rank
    # headline: fused RoPE/SwiGLU in every mode, fsdp-unfused = the same FSDP without them;
    # profile of ddp/fsdp/fsdp2; traces: $RESULTS/throughput.<mode>.trace.json.gz
    throughput) section throughput trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 6 --warmup 2 --fused-kernels --profile \
                  --modes ddp,fsdp,fsdp2,fsdp-unfused --out "$RESULTS/throughput.json" ;;
    # two ways to cut FSDP's per-step all-gathers / their cost (not in the default SECTIONS):
    # one micro-batch of 16 per rank (weights gathered once per step, not twice), and NCCL's Simple protocol
    throughput_mb16) section throughput_mb16 trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size 16 --global-batch 32 --steps 6 --warmup 2 --fused-kernels --profile \
                  --modes ddp,fsdp,fsdp2 --out "$RESULTS/throughput_mb16.json" ;;
    # FSDP's prefetch budget (suggested_communication_unit_size) against its peak memory, at mb 16
    throughput_unit) section throughput_unit trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size 16 --global-batch 32 --steps 6 --warmup 2 --fused-kernels \
                  --modes fsdp,fsdp-unit-1e9,fsdp2 --out "$RESULTS/throughput_unit.json" ;;
    throughput_unit8) section throughput_unit8 trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 --fused-kernels \
                  --modes fsdp,fsdp-unit-1e9,fsdp2 --out "$RESULTS/throughput_unit8.json" ;;
    # the large end (the largest size where all three modes fit): 7b spec, mb 2, where all three modes fit
    throughput_7b) section throughput_7b trun bench/throughput.py --spec 7b --attention sdpa \
                  --micro-batch-size 2 --global-batch 8 --steps 4 --warmup 2 --fused-kernels \
                  --modes ddp,fsdp,fsdp2 --out "$RESULTS/throughput_7b.json" ;;
    # the same at micro-batch 4 (the kit's defaults since 2026-11-30: fused Adam, 2-layer FSDP unit): MFU at 7b
    throughput_7b_mb4) section throughput_7b_mb4 trun bench/throughput.py --spec 7b --attention sdpa \
                  --micro-batch-size 4 --global-batch 16 --steps 4 --warmup 2 --fused-kernels \
                  --modes ddp,fsdp,fsdp2 --out "$RESULTS/throughput_7b_mb4.json" ;;
    throughput_simple) NCCL_PROTO=Simple section throughput_simple trun bench/throughput.py --spec 1.7b \
                  --attention sdpa --micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 --fused-kernels \
                  --modes ddp,fsdp,fsdp2 --out "$RESULTS/throughput_simple.json" ;;
    # the eighth set: Megatron-FSDP keeping each unit's gathered weights through the step (fsdp_keep_gathered: one
    # all-gather per unit per step instead of 2 per micro-batch; same bits, CPU test) beside the three systems and
    # FSDP2's same trade (fsdp2-keep-gathered), pipelined steps. On one GPU the buffers are not sharded: the gathers
    # it saves are one-rank copies, so there it measures the hooks' host work (and runs the CUDA path).
    levers8)    section levers8 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch $((16 * NGPU)) --steps 6 --warmup 2 --fused-kernels --fused-cross-entropy --repeats 3 \
                  --pipelined --modes ddp,fsdp,fsdp-keep-gathered,fsdp2,fsdp2-keep-gathered --out "$RESULTS/levers8.json" ;;
    # the FSDP knobs, unfused (docs/results/h200x2/throughput_knobs.json); not in the default SECTIONS
    throughput_knobs) section throughput_knobs trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size 8 --global-batch 32 --steps 6 --warmup 2 --profile \
                  --modes ddp,fsdp,fsdp2,fsdp-no-overlap,fsdp-unit2x,fsdp-recompute,fsdp-optoffload \
                  --out "$RESULTS/throughput_knobs.json" ;;
    # issue 22's levers, each one knob from the kit's defaults (fused Adam and the 2-layer FSDP unit since
    # 2026-11-30), all in one run, 3 interleaved repeats (medians); fsdp and fsdp2 profiled in the first round
    levers)     section levers trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 5 --warmup 2 --fused-kernels --repeats 3 --profile --profile-modes fsdp,fsdp2 \
                  --modes ddp,fsdp,fsdp2,fsdp-foreach-adam,ddp-foreach-adam,fsdp-unit-1e9,fsdp-grad-fp32,fsdp-double-buffer,fsdp-nccl-ub \
                  --out "$RESULTS/levers.json" ;;
    # the second set of levers: Megatron-FSDP's all-gathers on their own communicator, high-priority NCCL
    # streams, megatron's native fused cross-entropy (2026-12-01)
    levers2)    section levers2 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 5 --warmup 2 --fused-kernels --repeats 3 --profile --profile-modes fsdp,fsdp-ag-group \
                  --modes ddp,fsdp,fsdp2,fsdp-ag-group,fsdp-high-prio,fsdp-ag-group-hp,fsdp-ce-fusion \
                  --out "$RESULTS/levers2.json" ;;
    # the third set: NCCL's SM budget. Data-parallel collectives capped at 8 / 16 CTAs (Hopper default 32 of 132 SMs),
    # so the GEMMs they overlap keep more SMs (2026-12-01)
    levers3)    section levers3 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 5 --warmup 2 --fused-kernels --repeats 3 --profile --profile-modes fsdp,fsdp-ctas8 \
                  --modes ddp,fsdp,fsdp2,fsdp-ctas8,fsdp-ctas16,ddp-ctas8 --out "$RESULTS/levers3.json" ;;
    # the fourth set, compute side (runs on 1 GPU too; global batch 16 per GPU = 2 micro-batches, as on 2 GPUs):
    # the kit's cross-entropy on each system, 3 interleaved repeats; fsdp profiled with and without (2026-12-01)
    levers4)    section levers4 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch $((16 * NGPU)) --steps 5 --warmup 2 --fused-kernels --repeats 3 --profile \
                  --profile-modes fsdp,fsdp-fused-ce --modes ddp,fsdp,fsdp2,ddp-fused-ce,fsdp-fused-ce,fsdp2-fused-ce \
                  --out "$RESULTS/levers4.json" ;;
    # the fifth set: megatron's finalize_model_grads (a host sync on the token count after backward) against the
    # kit's engine.finalize_grads, at the kit's GPU settings (fused RoPE/SwiGLU and cross-entropy); 1 GPU or more
    levers5)    section levers5 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch $((16 * NGPU)) --steps 5 --warmup 2 --fused-kernels --fused-cross-entropy --repeats 3 \
                  --profile --profile-modes fsdp,fsdp-megatron-finalize \
                  --modes ddp,fsdp,fsdp2,ddp-megatron-finalize,fsdp-megatron-finalize --out "$RESULTS/levers5.json" ;;
    # the sixth set: the same systems as levers5, each step timed alone (synchronized before and after) and as a
    # loop that starts each step before it reads the last one's loss (--pipelined: train.start_step, no host sync)
    levers6)    for how in alone pipelined; do section "levers6_$how" trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size 8 --global-batch $((16 * NGPU)) --steps 6 --warmup 2 --fused-kernels \
                  --fused-cross-entropy --repeats 3 $([ $how = pipelined ] && echo --pipelined) --modes ddp,fsdp,fsdp2 \
                  --out "$RESULTS/levers6_$how.json"; done ;;
    # the seventh set: Megatron-FSDP's fp32 grads for Adam made a part at a time inside the step (grad_upcast, the
    # default since 2026-12-01) vs megatron's whole-shard copy held through the step: tokens/s and the step's peak at
    # 1.37 B; max_model_upcast: the largest 7b-width model of each beside FSDP2's (1 GPU or more)
    levers7)    section levers7 trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch $((16 * NGPU)) --steps 6 --warmup 2 --fused-kernels --fused-cross-entropy --repeats 3 \
                  --modes fsdp,fsdp-upcast-whole,fsdp2 --out "$RESULTS/levers7.json" ;;
    # (without recompute, and with full recompute: activations then no longer hide the optimizer step's peak)
    max_model_upcast) for rc in none full; do section "max_model_upcast_$rc" trun bench/max_model.py --spec 7b \
                  --modes fsdp,fsdp-upcast-whole,fsdp2 --recompute $rc \
                  --layer-step 2 --max-trials 8 --out "$RESULTS/max_model_upcast_$rc.json"; done ;;
    # the same with two micro-batches a step: FSDP2's fp32 grads then also live through a forward
    max_model_accum) section max_model_accum trun bench/max_model.py --spec 7b --modes fsdp,fsdp2 --micro-batches 2 \
                  --layer-step 2 --max-trials 8 --out "$RESULTS/max_model_accum.json" ;;
    # each non-GEMM op of a step alone: megatron's kernel vs the kit's, time, memory held, error (bench/fusions.py)
    fusions)    section fusions torchrun --nproc_per_node 1 --master_port $((29400 + RANDOM % 1000)) bench/fusions.py \
                  --spec 1.7b --micro-batch-size 8 --out "$RESULTS/fusions.json" ;;
    # the three systems at their defaults, 3 interleaved repeats: the ratios issue 22 asks for. The kit's GPU
    # settings: fused RoPE/SwiGLU and, since levers4 (2026-12-01: +1.9 % tokens/s, -1 GiB peak), fused cross-entropy
    headline)   section headline trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 5 --warmup 2 --fused-kernels --fused-cross-entropy --repeats 3 --profile \
                  --profile-modes fsdp,fsdp2 \
                  --modes ddp,fsdp,fsdp2 --out "$RESULTS/headline.json" ;;
    # tokens/s under a memory cap: each system at micro-batch 4 and 16 without recompute and 8 with full
    # recompute (mb 8 without: the headline section); bench/memory_cap.py picks the best under 40 and 80 GiB
    memcap)     for mb in 4 16; do section "memcap_mb$mb" trun bench/throughput.py --spec 1.7b --attention sdpa \
                  --micro-batch-size $mb --global-batch 32 --steps 4 --warmup 2 --fused-kernels --modes ddp,fsdp,fsdp2 \
                  --out "$RESULTS/memcap_mb$mb.json"; done
                section memcap_mb8_recompute trun bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 \
                  --global-batch 32 --steps 4 --warmup 2 --fused-kernels --modes ddp-recompute,fsdp-recompute,fsdp2-recompute \
                  --out "$RESULTS/memcap_mb8_recompute.json"
                section memory_cap python3 bench/memory_cap.py --caps 40 80 --out "$RESULTS/memory_cap.json" \
                  "$RESULTS"/headline.json "$RESULTS"/memcap_mb*.json ;;
    # packed sequences vs padding (issue #38): real tokens/s at 1.37 B on 1 GPU, SFT-like and RL-like length mixes,
    # padded vs packed (one SDPA per sequence) vs packed through flex_attention, micro-batch budgets equal in
    # positions (8 rows x S, throughput1's micro-batch); peak memory and the padding fraction of the padded batches (not in the default SECTIONS)
    packing)    for mix in sft rl; do section "packing_$mix" torchrun --nproc_per_node 1 \
                  --master_port $((29400 + RANDOM % 1000)) bench/packing.py --spec 1.7b --mixes $mix \
                  --ways padded,packed-sdpa,packed-flex --sequences 64 --micro-batch-size 8 --steps 5 --warmup 2 \
                  --out "$RESULTS/packing_$mix.json"; done ;;
    # the 1-GPU column of the same comparison
    throughput1) section throughput1 torchrun --nproc_per_node 1 --master_port $((29400 + RANDOM % 1000)) \
                  bench/throughput.py --spec 1.7b --attention sdpa --micro-batch-size 8 --global-batch 16 \
                  --steps 6 --warmup 2 --fused-kernels --modes ddp,fsdp,fsdp2 --out "$RESULTS/throughput_1gpu.json" ;;
    # not in the default SECTIONS: largest 7b-width model, Megatron-FSDP vs DDP (~12 builds of up to ~15 B params)
    max_model)  section max_model  trun bench/max_model.py --spec 7b --max-trials 8 --out "$RESULTS/max_model.json" ;;
    # the largest 7b-width model, Megatron-FSDP vs FSDP2 (issue 22 item 2)
    max_model_fsdp2) section max_model_fsdp2 trun bench/max_model.py --spec 7b --modes fsdp,fsdp2 --layer-step 4 --max-trials 8 \
                  --out "$RESULTS/max_model_fsdp2.json" ;;
    # where 02_sft's GPU step goes (32 sequences of 16 tokens in fp32, the notebooks' GPU model by default): the
    # notebook's recipe per wrapper x attention backend x fused kernels; kernels, host copies and syncs per step
    sft_step)   section sft_step trun bench/sft_step.py --out "$RESULTS/sft_step.json" \
                  --variants "${SFT_VARIANTS:-ddp-local,fsdp-local,ddp-sdpa,fsdp-sdpa,ddp-sdpa-fused,fsdp-sdpa-fused}" ;;
    # where a notebook's set-up goes on the node: the one-time tiny model write (draw, write), then models.hf.load's
    # phases per wrapper in the notebooks' GPU dtype, the first steps, and cProfile's top functions of the loads
    nb_setup)   section nb_setup trun bench/notebook_setup.py --profile "${NB_SETUP_PROFILE:-40}" \
                  --out "$RESULTS/notebook_setup.json" ;;
    # every notebook under nbval with %px engines on the GPUs (the .whl/ Jupyter stack), timed per notebook
    # the notebooks' model is written first, as `make lab` does while JupyterLab starts (its seconds in
    # notebook_model.log); NB_PREWRITE=0 leaves that to the first notebook, as on a machine without `make lab`
    notebooks)  [ "${NB_PREWRITE:-1}" = 1 ] && section notebook_model python3 -m mfsdp_kit.notebook_model
                section notebooks python3 bench/notebook_suite.py --out "$RESULTS/notebooks.json" ${NOTEBOOKS:-} ;;
    # the same on a folder the kit did not make (tests/user_folder.py: transformers' Llama, a Llama 3 template
    # trained by tokenizers, no pad token), as MFSDP_MODEL=/path/to/your/folder make lab gives it to the notebooks
    notebooks_user) section user_folder python3 -m tests.user_folder /tmp/mfsdp_user_llama3 --style llama3
                section notebooks_user env MFSDP_MODEL=/tmp/mfsdp_user_llama3 python3 bench/notebook_suite.py \
                  --out "$RESULTS/notebooks_user.json" ${NOTEBOOKS:-} ;;
    # 06_memory's speed table outside nbval (which keeps no output): tokens/s, MFU, memory vs ZeRO
    nb_throughput) section nb_throughput trun bench/notebook_throughput.py --out "$RESULTS/notebook_throughput.json" ;;
    # a ~7.6 B HF folder (Qwen2.5-7B shape, random bf16, safetensors shards) written on this node, then
    # models.hf.load's phases into Megatron-FSDP on every GPU: time, host RSS and GPU memory per rank
    # MoE (Qwen3-MoE-shaped moe-1.3b, 0.26 B active): DDP vs Megatron-FSDP at expert-parallel size 1 vs 2
    moe)        section moe trun bench/moe_throughput.py --spec moe-1.3b --micro-batch-size 4 --steps 8 --warmup 2 \
                  --out "$RESULTS/moe_throughput.json" ;;
    # engines up: cluster.start / restart / stop phases with one engine per GPU (not torchrun: the bench starts them)
    # CS_MODEL (a tiny size): the engines load and train it before restart and stop, as a notebook's do
    cluster_start) section cluster_start $IMAGE_ENV python3 bench/cluster_start.py --n "$NGPU" --repeats "${CS_REPEATS:-3}" \
                  --variants "${CS_VARIANTS:-plain,preload,noimport}" ${CS_MODEL:+--model "$CS_MODEL"} \
                  --out "$RESULTS/cluster_start.json" ;;
    # where an engine's imports go (issue 21: engines up fast): -X importtime of the kit + megatron, twice
    # (the second run finds whatever bytecode the first wrote), the 30 largest cumulative entries
    imports)    section imports bash -c 'for i in 1 2; do /usr/bin/time -f "run $i: %e s" python3 -X importtime \
                  -c "import mfsdp_kit, megatron.core" 2> "$0/importtime$i.txt"; tail -1 "$0/importtime$i.txt"; done
                  sort -t"|" -k2 -n -r "$0/importtime2.txt" | head -30' "$RESULTS"
                # is bytecode cached where the image keeps its packages? (an import that finds no .pyc and cannot
                # write one compiles every module, every time)
                section pyc_cache python3 - <<'PY'
import importlib.util, os, subprocess, sys, time
for name in ("sympy", "torch", "megatron.core", "ipyparallel"):
    spec = importlib.util.find_spec(name)
    d = os.path.dirname(spec.origin)
    cached = importlib.util.cache_from_source(spec.origin)
    print(f"{name:14} {d}  writable={os.access(d, os.W_OK)}  pyc={os.path.exists(cached)}")
def t(env=None):
    t0 = time.perf_counter(); subprocess.run([sys.executable, "-c", "import sympy"], env={**os.environ, **(env or {})}); return time.perf_counter() - t0
print("import sympy, s:", [round(t(), 2) for _ in range(2)],
      "with PYTHONPYCACHEPREFIX:", [round(t({"PYTHONPYCACHEPREFIX": "/tmp/pyc"}), 2) for _ in range(3)])
# what CUDA costs an engine before its first kernel: driver init, the device's context, cuBLAS
import torch
t0 = time.perf_counter(); torch.cuda.init(); t1 = time.perf_counter()
torch.cuda.set_device(0); t2 = time.perf_counter()
x = torch.ones(64, 64, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
(x @ x).sum().item(); t4 = time.perf_counter()
print(f"cuda init {t1 - t0:.3f} s, set_device {t2 - t1:.3f} s, first tensor {t3 - t2:.3f} s, first matmul {t4 - t3:.3f} s")
PY
                ;;
    load_7b)    section load_7b trun bench/load_hf.py --shape qwen2.5-7b --root "${LOAD_ROOT:-/dev/shm}" \
                  --train-steps 1 --out "$RESULTS/load_7b.json" ;;
    # issue 37: HF generate vs the kit's engine (rl.rollout.ContinuousRollout) on one GPU, the floor beside them,
    # then its bf16 greedy tokens and log-probs against HF's; rollout_7b: the same at the 7 B shape
    rollout)    section rollout python3 bench/rollout.py --shape qwen2-1.8b --batches 1,64,256,512 \
                  --out "$RESULTS/rollout.json" ;;
    rollout_7b) section rollout_7b python3 bench/rollout.py --shape qwen2-7b --batches 1,64,256 --attention flex \
                  --hf-new-tokens 16 --out "$RESULTS/rollout_7b.json" ;;
    # issue 37: one GRPO iteration of tiny `l` (64 prompts x 8 samples, <= 512 new tokens), split into sync /
    # rollout / logprob / update seconds, HF generate against the kit's engine
    # (GRPO_BACKENDS: a subset of hf,continuous,continuous_kept)
    grpo_iteration) section grpo_iteration trun bench/grpo_iteration.py --size l --iterations 2 \
                  --backends "${GRPO_BACKENDS:-hf,continuous,continuous_kept}" \
                  --out "$RESULTS/grpo_iteration.json" ;;
    *) echo "unknown section $s"; status=1 ;;
  esac
done
echo; echo "gpu_check: $([ $status = 0 ] && echo ALL SECTIONS PASSED || echo SOME SECTIONS FAILED)"
exit $status
