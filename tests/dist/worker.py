"""torchrun entry: `worker.py SCENARIO JSON_KWARGS OUT_PATH`; rank 0 writes the result."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    import scenarios
    name, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    result = getattr(scenarios, name)(**kwargs)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
