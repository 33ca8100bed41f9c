"""Entry of one rank: `worker.py [MODULE:]SCENARIO JSON_KWARGS OUT_PATH`; rank 0 writes the result.

SCENARIO alone is looked up in scenarios.py; `scenarios_train:sft` names another module here.
torchrun runs this file as a script, so Python puts its folder (tests/dist) first on sys.path:
that is how `scenarios*` import each other by bare name; mfsdp_kit comes from the installed package.
pool.py's forked ranks call `main` with the same arguments and the same sys.path."""
import importlib
import json
import os
import sys


def main(name: str, kwargs: dict, out: str) -> None:
    module, _, function = name.rpartition(":")
    result = getattr(importlib.import_module(module or "scenarios"), function)(**kwargs)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    # End as a user's job should: leave megatron's groups and the world before the interpreter
    # exits. Left to exit-time destruction, gloo's threads raced torch.profiler's state and
    # aborted a rank ("terminate called without an active exception") after a profiled scenario.
    from mfsdp_kit.distributed import runtime
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
