"""The package's shape, checked from source with `ast`: no import cycle, short modules, tests that
use only public names of the kit and nothing of bench/, perf/ above the runtime (`PERF_FOR_THE_RUNTIME`).
Run alone: pytest tests/test_layout.py -s."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mfsdp_kit"
MAX_LINES = 400
LONG_REASON = "Longer than 400 lines because"  # a module over MAX_LINES says why in its docstring


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in the file, lazy ones inside functions included."""
    tree, here = ast.parse(path.read_text()), module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.append((target, [alias.name for alias in node.names]))
    return out


def kit_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> kit modules it imports (`from pkg import submodule` counts as the submodule)."""
    modules = kit_modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, names in imports(path):
            subs = {f"{target}.{n}" for n in names} & modules.keys()
            edges |= subs or ({target} & modules.keys())
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None
    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 20 and graph[f"{PACKAGE}.memory"]  # the scan sees the package and its edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_modules_are_short_or_say_why():
    long = {name: n for name, p in kit_modules().items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and LONG_REASON not in (ast.get_docstring(ast.parse(p.read_text())) or "")}
    assert not long, f"modules over {MAX_LINES} lines without '{LONG_REASON} ...' in their docstring: {long}"


def test_tests_import_no_bench_and_no_private_kit_names():
    bad = []
    for path in (ROOT / "tests").rglob("*.py"):
        for target, names in imports(path):
            top = target.split(".")[0]
            if top == "bench":  # tests/bench runs the scripts as a user does, it never imports them
                bad.append(f"{path.relative_to(ROOT)}: imports {target}")
            if top == PACKAGE:
                bad += [f"{path.relative_to(ROOT)}: {target}.{n}" for n in names if n.startswith("_")]
                bad += [f"{path.relative_to(ROOT)}: {target}" for part in target.split(".") if part.startswith("_")]
        bad += [f"{path.relative_to(ROOT)}: {name}" for name in private_attributes(path)]
    assert not bad, "\n".join(bad)


def private_attributes(path: Path) -> list[str]:
    """`module._name` where `module` was imported from the kit (e.g. `from mfsdp_kit import engine`)."""
    tree = ast.parse(path.read_text())
    aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").split(".")[0] == PACKAGE for alias in node.names}
    return [f"{node.value.id}.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in aliases and node.attr.startswith("_")
            and not node.attr.startswith("__")]


PERF = f"{PACKAGE}.perf"
PERF_FOR_THE_RUNTIME = {f"{PERF}.flops", f"{PERF}.timeline", f"{PERF}.profile", f"{PERF}.options",
                        f"{PERF}.clock"}
"""The boundary of perf/ (measuring training: what bench/ and the tests compute). perf sits above the runtime - it
imports engine, train, models, memory - and the rest of the kit imports only these of its modules: FLOPs and MFU
(notebook_model), a trace's intervals and exposed communication (plots), command-line options made from a config
dataclass (rl.cli) and the one clock of device work (rl.rollout's per-batch timer, offload's synchronize), which
at import time bring nothing of the training stack (their own imports of it are inside the functions that train)."""
PERF_LIGHT_IMPORTS = {f"{PERF}.timeline", f"{PERF}.flops", f"{PACKAGE}.models.gpt", f"{PACKAGE}.fieldtypes"}
"""What those modules may import from the kit at module level."""


def top_level_kit_imports(name: str) -> set[str]:
    """The kit modules `name` imports at module level (not inside functions)."""
    path, modules = kit_modules()[name], kit_modules()
    tree = ast.parse(path.read_text())
    body_imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    package = name.rpartition(".")[0]
    out = set()
    for node in body_imports:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & modules.keys()
            continue
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        out |= ({f"{target}.{a.name}" for a in node.names} & modules.keys()) or ({target} & modules.keys())
    return out


def test_perf_sits_above_the_runtime():
    graph = import_graph()
    in_perf = {m for m in graph if m == PERF or m.startswith(PERF + ".")}
    reached = {m: edges & in_perf for m, edges in graph.items() if m not in in_perf and edges & in_perf}
    assert reached, "the scan sees no import of perf: it would pass whatever the kit did"
    bad = {m: sorted(e - PERF_FOR_THE_RUNTIME) for m, e in reached.items() if e - PERF_FOR_THE_RUNTIME}
    assert not bad, f"modules outside perf/ that import more of it than {sorted(PERF_FOR_THE_RUNTIME)}: {bad}"
    heavy = {m: sorted(top_level_kit_imports(m) - PERF_LIGHT_IMPORTS) for m in PERF_FOR_THE_RUNTIME}
    assert not any(heavy.values()), f"perf modules the runtime imports pull in at import time: {heavy}"
    assert top_level_kit_imports(f"{PERF}.trainers") - PERF_LIGHT_IMPORTS  # the scan sees module-level imports


DOOR = f"{PACKAGE}.compat"
"""The one door into megatron-core's and Megatron-Bridge's internals (docs/design.md, "The door"): only modules
of this package import Megatron-FSDP's source package or the bridge's submodules, name them in strings, or touch
the internal attributes below. Everything else asks it (`compat.access.fsdp`, `compat.patches.bridge`, ...)."""
INTERNAL_MODULES = ("megatron.core.distributed.fsdp.src", "megatron.bridge.")
"""Megatron-FSDP's implementation package (what megatron's public adapter wraps) and every bridge submodule
(`from megatron.bridge import AutoBridge`, the bridge's front door, stays open to all)."""
INTERNAL_ATTRS = frozenset({
    # Megatron-FSDP (megatron/core/distributed/fsdp/src/megatron_fsdp/): its buffers, pipelines, hooks
    "param_and_grad_buffer", "all_gather_pipeline", "bucket_status", "dist_main_grad", "param_to_param_group",
    "parameter_groups", "optimizer_named_parameters", "update_main_grads", "release_bucket",
    "param_gather_event_map", "grad_acc_hooks", "is_param_fsdp_distributed", "_replace_param_with_raw_if_needed",
    "install_optimized_model_weights", "_GLOBAL_MEMORY_BUFFER",
    # Megatron-Bridge: the model bridge behind AutoBridge and its conversion machinery
    "_model_bridge", "mapping_registry", "maybe_modify_loaded_hf_weight", "build_conversion_tasks",
    "load_weights_hf_to_megatron",
})
"""Attributes that belong to megatron's or the bridge's internals, however the object was reached."""


def door_violations(path: Path) -> list[str]:
    """Where a file outside the door imports, names or touches megatron's or the bridge's internals."""
    tree, out = ast.parse(path.read_text()), []
    internal = lambda name: name.startswith(INTERNAL_MODULES) or name == INTERNAL_MODULES[0]  # noqa: E731
    out += [f"imports {target}" for target, _ in imports(path) if internal(target + ".") and target != "megatron.bridge"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRS:
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(INTERNAL_MODULES):
            out.append(f"line {node.lineno}: {node.value!r}")
    return out


def test_one_door_into_megatron_internals():
    bad = {name: v for name, path in kit_modules().items()
           if not (name == DOOR or name.startswith(DOOR + ".")) and (v := door_violations(path))}
    assert not bad, f"modules outside {DOOR} reaching into megatron's or the bridge's internals: {bad}"
    inside = [v for name, path in kit_modules().items() if name.startswith(DOOR + ".") for v in door_violations(path)]
    assert inside, "the scan finds nothing even inside the door: it would pass whatever the kit did"
