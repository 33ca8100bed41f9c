#!/usr/bin/env bash
# Everything GPU in one run: on a node with N GPUs (default: all) and no network, install the wheels
# carried in .whl/ (scripts/fetch_gpu_wheels.sh) over the node's own torch, then run each section
# under torchrun/NCCL (the sections: scripts/gpu_sections.py). Each section prints its table and writes JSON
# under $RESULTS. SECTIONS takes names separated by spaces or commas.
#   bash scripts/gpu_check.sh                 # all sections
#   SECTIONS="parity" NGPU=2 bash scripts/gpu_check.sh
#   SECTIONS="throughput max_model" bash scripts/gpu_check.sh   # max_model runs only when listed
#   SECTIONS="notebooks nb_throughput load_7b moe cluster_start" bash scripts/gpu_check.sh   # not in the default SECTIONS either
# Every result JSON records its commit (perf.report.provenance): where the tree travels without its .git (the device
# tool), pass it: MFSDP_COMMIT=$(git rev-parse --short=12 HEAD) SECTIONS=... bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# NVLink multicast stays off (shared hosts; see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
RESULTS=${RESULTS:-runs/gpu}
SECTIONS=${SECTIONS:-$(python3 scripts/gpu_sections.py --default)}
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
  # the log keeps every line (a notebook's failure names the warnings its cell showed); the screen skips warnings
  "$@" 2>&1 | tee "$RESULTS/$name.log" | grep -v -E "UserWarning|warnings.warn|FutureWarning|^\s*$"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "SECTION $name FAILED rc=$rc"; status=1; }
  # On the device machine only a few files come back from $OUT: one archive of everything written so far
  # (after every section, so a run cut off by its time limit keeps what it measured).
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_check_results.tgz" -C "$RESULTS" . 2>/dev/null
  return 0
}
trun() { torchrun --nproc_per_node "$NGPU" --master_port $((29400 + RANDOM % 1000)) "$@"; }

# The sections are rows of one table (scripts/gpu_sections.py: name, script, arguments, what each writes); per name
# it prints the `section ...` lines to run here (python3 scripts/gpu_sections.py --list shows them all).
for s in ${SECTIONS//,/ }; do
  lines=$(python3 scripts/gpu_sections.py --ngpu "$NGPU" --results "$RESULTS" "$s") || { status=1; continue; }
  eval "$lines"
done
echo; echo "gpu_check: $([ $status = 0 ] && echo ALL SECTIONS PASSED || echo SOME SECTIONS FAILED)"
exit $status
