#!/usr/bin/env bash
# Download (on a machine with registry access) the wheels a GPU node without network needs
# beside its own torch: into .whl/, which scripts/gpu_check.sh installs from. Python 3.12 by default
# (the GPU image's python3). JUPYTER: the stack the `notebooks` section needs (nbval runs each notebook
# in an ipykernel whose %px cells drive ipyparallel engines); the image has none of it, but has
# pytest, coverage, attrs, python-dateutil, tqdm, psutil, pygments, packaging, matplotlib and jinja2.
# Versions are the ones `make test` runs nbval with on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYV:-3.12}
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for pkg in megatron-core==0.16.1 megatron-bridge==0.3.1 transformers==4.57.3 huggingface-hub==0.36.0 \
           tokenizers==0.22.1 omegaconf==2.3.0 einops psutil pytest pluggy iniconfig \
           peft==0.21.2 accelerate==1.16.0; do   # peft: 08_lora and bench/lora.py load the adapter with it
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
JUPYTER=(ipykernel==7.4.0 ipyparallel==9.2.0 ipython==9.18.1 ipython-pygments-lexers==1.1.1
         jupyter-client==8.10.0 jupyter-core==5.9.1 nbval==0.11.0 nbformat==5.11.1 ipywidgets==8.1.9
         widgetsnbextension==4.0.16 jupyterlab-widgets==3.0.17 comm==0.2.3 debugpy==1.8.22
         matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 pyzmq==27.3.0 tornado==6.6.1 traitlets==5.16.1
         decorator==5.3.1 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53
         wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
         fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
         rpds-py==2026.9.1 platformdirs==4.14.9)
for pkg in "${JUPYTER[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only upstream
ls .whl
