#!/usr/bin/env bash
# Download (on a machine with registry access) the wheels a GPU node without network needs
# beside its own torch: into .whl/, which scripts/gpu_check.sh installs from. Python 3.12 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYV:-3.12}
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for pkg in megatron-core==0.16.1 megatron-bridge==0.3.1 transformers==4.57.3 huggingface-hub==0.36.0 \
           tokenizers==0.22.1 omegaconf==2.3.0 einops psutil pytest pluggy iniconfig; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only upstream
ls .whl
