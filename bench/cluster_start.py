"""Where `cluster.start` spends its time, phase by phase, and what stop and restart cost.

    python bench/cluster_start.py [--n 2] [--repeats 3] [--out runs/bench/cluster_start.json] [--engines mpi]
                                  [--variants plain,preload,noimport]

"Ready" means `start()` returned: every engine registered, ran `runtime.init`, and %%px would work.
Phases (`handle.startup_s`): controller and engines_spawn (the kit's local engines are spawned first and
wait for the controller's connection file) -> client_connect -> register (engine processes boot, import
ipyparallel and register) -> identify (ranks, free port) -> world_init (every engine:
engine.preload_wait (imports begun at engine boot), engine.import_torch, engine.import_megatron,
engine.runtime_init = process group + megatron state; the slowest rank's). The import floor -- one interpreter importing each module cold, alone -- is measured
too, so a reader can tell the kit's overhead from the libraries' import time. Runs on CPU (gloo, 2
engines) and on GPUs (nccl, one engine per GPU) alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

IMPORTS = {"python": "pass", "ipyparallel engine": "import ipyparallel.engine.app",
           "torch": "import torch, torch.distributed", "megatron.core": "import megatron.core.parallel_state",
           "mfsdp_kit + megatron.core": "import mfsdp_kit, megatron.core.parallel_state"}
"""The last is what an engine imports (the kit's compat rows change megatron's import); the one before is megatron
as upstream ships it."""
MODEL_WORK = """
from mfsdp_kit import data, engine, runtime, train
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.hf import load
cfg = nbm.engine_config(use_megatron_fsdp=True)
runtime.init(cfg)
model = load(nbm.path, cfg)
opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-5), cfg)
for b in data.random_token_batches(steps=2, global_batch=32, seq_len_tokens=16, vocab_size=model.vocab_size):
    train.step(model.chunks, opt, b, micro_batch_size=32 // world_size)   # one micro-batch per rank, as 02_sft
"""
ALL_REDUCE = ("import torch, torch.distributed as dist\nfrom mfsdp_kit import runtime\n"
              "x = torch.ones(1, device=runtime.current().device)\ndist.all_reduce(x)")


def import_floor(names: list[str] | None = None) -> dict:
    """Seconds for a fresh interpreter to import each module stack alone (what each engine pays); `names`: those
    of IMPORTS only (default: all)."""
    unknown = sorted(set(names or ()) - set(IMPORTS))
    if unknown:
        raise SystemExit(f"--import-floor {','.join(unknown)} is not allowed; allowed: {' | '.join(IMPORTS)}")
    out = {}
    for name, code in IMPORTS.items():
        if names is not None and name not in names:
            continue
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, capture_output=True)
        out[name] = time.perf_counter() - t0
    return out


def variant_kwargs(variant: str, engines: str | None) -> dict:
    """`start` keywords for one variant:
    - `plain`: ipyparallel's own engine, spawned once the controller is up (the kit before its own engine);
    - `preload`: the kit's engine (launch.ENGINE_CMD) importing torch/megatron in a thread from its first instant;
    - `noimport`: the kit's engine without that thread (the imports run in runtime.init);
    - `nobytecode`: `preload` under the environment's own bytecode policy (the kit before `cache.bytecode_env`:
      an image with PYTHONDONTWRITEBYTECODE=1 compiles every module at every start);
    - `default`: whatever the kit picks here (launch.preload_by_default).
    The kit's local engines are spawned before the controller (launch.start_processes); MPI ones after it."""
    from traitlets.config import Config

    from mfsdp_kit.notebook import ipengine, launch
    kwargs = {"engines": engines} if engines else {}
    if variant in ("preload", "noimport", "plain", "nobytecode"):
        from ipyparallel.cluster.launcher import ipengine_cmd_argv
        section = "MPIEngineSetLauncher" if engines == "mpi" else "LocalEngineSetLauncher"
        cmd = ipengine_cmd_argv if variant == "plain" else launch.ENGINE_CMD
        env = {ipengine.PRELOAD_ENV: "0" if variant == "noimport" else "1"}
        if variant == "nobytecode":   # a caller's environment wins over the kit's bytecode_env
            env.update({k: os.environ.get(k, "") for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")})
        kwargs["config"] = Config({section: {"engine_cmd": cmd, "environment": env}})
    return kwargs


def measure_once(*, n_engines: int, launcher: dict, nbm=None) -> dict:
    """One start, all-reduce, restart, stop. With `nbm` (a notebook model), the engines load it and train two
    steps before the restart and again before the stop, so both tear down what a notebook's engines hold."""
    from mfsdp_kit.notebook import cluster
    t0 = time.perf_counter()
    handle = cluster.start(n_engines, **launcher)
    out = dict(ready_s=time.perf_counter() - t0, backend=handle.backend, devices=handle.devices)
    out.update({f"start.{k}": v for k, v in handle.startup_s.items()})
    try:
        t1 = time.perf_counter()
        handle.run(ALL_REDUCE)
        out["first_all_reduce_s"] = time.perf_counter() - t1
        if nbm is not None:
            out["model_s"] = model_work(handle, nbm)
        t1 = time.perf_counter()
        handle.restart()
        out["restart_s"] = time.perf_counter() - t1
        out.update({f"restart.{k}": v for k, v in handle.startup_s.items()})
        if nbm is not None:
            out["model_after_restart_s"] = model_work(handle, nbm)
    finally:
        t1 = time.perf_counter()
        handle.stop()
        out["stop_s"] = time.perf_counter() - t1
        out.update({f"stop.{k}": v for k, v in handle.stop_s.items()})
    return out


def model_work(handle, nbm) -> float:
    """Seconds for every engine to load `nbm` under Megatron-FSDP and train 2 steps of 02_sft's shape."""
    t0 = time.perf_counter()
    handle.view.push(dict(nbm=nbm))
    handle.run(MODEL_WORK)
    return time.perf_counter() - t0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summarize(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    return {k: dict(median=statistics.median(r[k] for r in runs), min=min(r[k] for r in runs),
                    max=max(r[k] for r in runs)) for k in keys}


def print_table(summary: dict) -> None:
    print(f"{'phase (seconds)':<34}{'median':>9}{'min':>9}{'max':>9}")
    for k, v in summary.items():
        indent = "    " if "." in k else ""
        print(f"{indent + k:<34}{v['median']:>9.2f}{v['min']:>9.2f}{v['max']:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2, help="engines per start")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=None, help="ipyparallel launcher, e.g. mpi (default: local)")
    parser.add_argument("--variants", default="plain,preload,noimport",
                        help="comma-separated: plain (ipyparallel's engine), preload (the kit's engine, imports at boot), "
                             "noimport (the kit's engine, imports in runtime.init), nobytecode (preload, the "
                             "environment's bytecode policy), default (the kit picks); "
                             "run alternately, so all see the same load")
    parser.add_argument("--model", default=None,
                        help="a notebook model (tiny size or HF folder, as MFSDP_MODEL): the engines load it and train "
                             "2 steps before restart and stop, so those tear down a notebook's state")
    parser.add_argument("--import-floor", default=",".join(IMPORTS),
                        help="comma-separated: which import floors to measure (default: all of IMPORTS)")
    parser.add_argument("--out", default="runs/bench/cluster_start.json")
    args = parser.parse_args()
    nbm = None
    if args.model:
        from mfsdp_kit.notebook import model as notebook_model
        nbm = notebook_model.prepare(args.model)
    variants = args.variants.split(",")
    load_before, floor = load(), import_floor(args.import_floor.split(","))
    runs = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            runs[v].append(measure_once(n_engines=args.n, launcher=variant_kwargs(v, args.engines), nbm=nbm))
    first = runs[variants[0]][0]
    print(f"cluster.start({args.n}{', engines=' + repr(args.engines) if args.engines else ''}) x {args.repeats}, "
          f"backend {first['backend']}, devices {first['devices']}, {os.cpu_count()} CPUs, "
          f"load average {load_before} before, {load()} after")
    print("import floor (one fresh interpreter, alone): " + ", ".join(f"{k} {v:.2f} s" for k, v in floor.items()))
    results = {}
    for v in variants:
        results[v] = dict(summary=summarize(runs[v]), runs=runs[v])
        print(f"\n[{v}]")
        print_table(results[v]["summary"])
    from mfsdp_kit.perf.report import write_json   # here, not at the top: the parent measures import floors
    write_json(args.out, dict(n_engines=args.n, repeats=args.repeats, engines=args.engines or "local",
                              model=args.model,
                              cpus=os.cpu_count(), host=platform.node(), load_before=load_before, load_after=load(),
                              import_floor_s=floor, variants=results), indent=2)


if __name__ == "__main__":
    main()
