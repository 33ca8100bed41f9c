"""The package's shape, checked from source with `ast`: no import cycle, short modules, tests that
use only public names of the kit and nothing of bench/, perf/ above the runtime (`PERF_FOR_THE_RUNTIME`),
a root of a few modules (`ROOT_MODULES`) with every other module in a subpackage that docs/design.md's tree
lists, tests/ mirroring the package, and the notebooks' short imports served by `mfsdp_kit.SHORT_NAMES`.
Run alone: pytest tests/test_layout.py -s."""
import ast
import re
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
    assert len(graph) > 20 and graph[f"{PACKAGE}.distributed.memory"]  # the scan sees the package and its edges
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



ROOT_MODULES = {"__init__", "cache", "demo", "fieldtypes", "folders"}
"""The package root holds these only (issue 52); every other module lives in a subpackage named for its role."""
HELPER_TEST_FOLDERS = {"dist": "the multi-process launcher and its scenarios", "bench": "the bench scripts run as a user does"}
ROOT_TESTS = {
    "test_layout": "the package's shape", "test_cache": "mfsdp_kit/cache.py", "test_demo": "mfsdp_kit/demo.py",
    "test_folders": "mfsdp_kit/folders.py", "test_commit_msg": "scripts/hooks/commit-msg",
    "test_gpu_sections": "scripts/gpu_sections.py", "test_make_notebooks": "notebooks/make_notebooks.py",
    "test_loopback": "a local world (cluster, runtime, gloo) listens on 127.0.0.1 only",
    "test_ui_live": "the notebooks in a browser",
    "test_docstrings": "every docstring of the package states a contract, not a measured figure",
}
"""The tests at tests/'s top, each with what it tests: a root module or something that is no one subpackage's."""


def subpackages() -> dict[str, set[str]]:
    """Each folder of the package ("" for the root, "rl/rollout") -> its modules' names."""
    top = ROOT / PACKAGE
    return {str(init.parent.relative_to(top)).replace(".", ""): {p.stem for p in init.parent.glob("*.py")}
            for init in top.rglob("__init__.py")}


def design_tree() -> dict[str, set[str]]:
    """docs/design.md's tree of the package (its first fenced block starting `mfsdp_kit/`): folder -> the names
    listed on its line (parenthesised notes dropped)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = next(b for b in text.split("```")[1::2] if b.lstrip("\n").startswith(f"{PACKAGE}/"))
    tree, path = {}, []
    for line in block.strip("\n").splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        folder, _, names = line.strip().partition("/")
        path = path[:depth] + [folder]
        tree["/".join(path[1:])] = set(re.findall(r"[A-Za-z_]\w*", re.sub(r"\([^)]*\)", "", names)))
    return tree


def test_the_root_holds_only_a_few_modules():
    assert subpackages()[""] == ROOT_MODULES, f"modules at the package root beyond {sorted(ROOT_MODULES)}: " \
        f"{sorted(subpackages()[''] - ROOT_MODULES)} (each belongs in a subpackage: docs/design.md's tree)"


def test_design_tree_lists_every_folder_and_module():
    tree, actual = design_tree(), subpackages()
    assert len(tree) > 10, "the scan finds no tree in docs/design.md"
    assert tree.keys() == actual.keys(), f"folders: only in docs/design.md {sorted(tree.keys() - actual.keys())}, " \
                                         f"only in the package {sorted(actual.keys() - tree.keys())}"
    bad = {f: (sorted(tree[f] - actual[f]), sorted(actual[f] - tree[f] - {"__init__"})) for f in actual
           if tree[f] - actual[f] or actual[f] - tree[f] - {"__init__"}}
    assert not bad, f"docs/design.md's tree vs the package, per folder (listed but absent, present but not listed): {bad}"


def test_tests_mirror_the_package():
    folders, bad = subpackages(), []
    for path in (ROOT / "tests").rglob("test_*.py"):
        folder = path.parent.relative_to(ROOT / "tests")
        if folder.parts and folder.parts[0] in HELPER_TEST_FOLDERS:
            continue
        if not folder.parts:
            if path.stem not in ROOT_TESTS:
                bad.append(f"tests/{path.name}: at the top of tests/ (a module's tests go in tests/<its subpackage>/; "
                           f"else a row of ROOT_TESTS)")
        elif str(folder) not in folders:
            bad.append(f"tests/{folder}/{path.name}: mfsdp_kit/{folder}/ is no subpackage")
    assert not bad, "\n".join(bad)
    stale = [name for name in ROOT_TESTS if not (ROOT / "tests" / f"{name}.py").exists()]
    assert not stale, f"ROOT_TESTS rows whose file is gone (delete them): {stale}"


def short_names() -> dict[str, str]:
    """mfsdp_kit.SHORT_NAMES, read from source (importing the package would import nothing more, but read it anyway)."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SHORT_NAMES")
    return ast.literal_eval(node.value)


def test_short_names_cover_what_notebooks_and_readme_import():
    """`from mfsdp_kit import X` in the notebooks, their generator and README: X is a subpackage, a root module or a
    SHORT_NAMES entry, and each entry names a module of the kit."""
    names, modules = short_names(), kit_modules()
    assert not {n: m for n, m in names.items() if m not in modules}, f"SHORT_NAMES naming no module: {names}"
    real = ({f.split("/")[0] for f in subpackages()} | ROOT_MODULES) - {"", "__init__"}   # what needs no short name
    assert not names.keys() & real, f"SHORT_NAMES shadowing a real subpackage or module: {names.keys() & real}"
    texts = [p.read_text() for p in [*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "notebooks").glob("*.py"),
                                     ROOT / "README.md"]]
    used = {n.strip() for t in texts for line in re.findall(rf"from {PACKAGE} import ([\w, ]+)", t)
            for n in line.split(",") if n.strip()}
    assert used, "the scan finds no import in the notebooks"
    missing = used - names.keys() - real
    assert not missing, f"names the notebooks or README import from {PACKAGE} that it does not have: {missing}"

PERF = f"{PACKAGE}.perf"
PERF_FOR_THE_RUNTIME = {f"{PERF}.flops", f"{PERF}.timeline", f"{PERF}.profile", f"{PERF}.options"}
"""The boundary of perf/ (measuring training: what bench/ and the tests compute). perf sits above the runtime - it
imports engine, train, models, memory - and the rest of the kit imports only these of its modules: FLOPs and MFU
(notebook_model), a trace's intervals and exposed communication (plots) and command-line options made from a config
dataclass (rl.cli), which at import time bring nothing of the training stack (their own imports of it are inside the
functions that train). The timers the runtime uses are below it: distributed.clock, distributed.stopwatch."""
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


def stated_layers() -> dict[str, int]:
    """docs/design.md's layer line (`compat < fieldtypes, folders, cache < config < ...`): folder or root module -> its
    place, bottom first."""
    line = re.search(r"^\s+(compat <.*)$", (ROOT / "docs" / "design.md").read_text(), re.M)
    assert line, "docs/design.md states no layer order (a line 'compat < ... < notebook')"
    return {name.strip(): i for i, group in enumerate(line.group(1).split("<")) for name in group.split(",")}


def unit_of(module: str) -> str:
    """The layer a module is in: its folder (`mfsdp_kit.train.data` -> train), or itself at the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_point_down():
    """Every import, lazy ones too, goes to the module's own layer or one before it in docs/design.md's order."""
    layers, graph = stated_layers(), import_graph()
    unlisted = {unit_of(m) for m in graph} - layers.keys()
    assert not unlisted, f"folders or root modules docs/design.md's layer order does not place: {sorted(unlisted)}"
    up = {f"{m} -> {t}" for m, edges in graph.items() for t in edges if layers[unit_of(t)] > layers[unit_of(m)]}
    assert not up, "imports that point up a layer (docs/design.md, 'Layers'):\n" + "\n".join(sorted(up))
    assert any(layers[unit_of(t)] < layers[unit_of(m)] for m, e in graph.items() for t in e)   # the scan sees edges


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


ROLLOUT = f"{PACKAGE}.rl.rollout"
ROLLOUT_KERNELS = f"{ROLLOUT}.kernels"


def test_the_rollout_engines_roles_keep_apart():
    """docs/design.md, "The rollout engine": the scheduler is host policy (of the engine it imports only `tools`, no
    model, kernel or device module); the kernels import nothing of the engine (state lives in the model runner); and
    the engine and the HF backend share `backend`, neither built on the other (no base class in engine.py or hf.py)."""
    graph = import_graph()
    engine = {m for m in graph if m.startswith(ROLLOUT + ".") and not m.startswith(ROLLOUT_KERNELS)}
    assert graph[f"{ROLLOUT}.scheduler"] & engine == {f"{ROLLOUT}.tools"}, graph[f"{ROLLOUT}.scheduler"]
    assert not graph[f"{ROLLOUT}.scheduler"] & {m for m in graph if m.startswith(ROLLOUT_KERNELS)}
    kernels = {m: graph[m] & engine for m in graph if m.startswith(ROLLOUT_KERNELS + ".")}
    assert len(kernels) >= 4 and not any(kernels.values()), f"kernels importing the engine's modules: {kernels}"
    for module in ("engine", "hf"):
        tree = ast.parse(kit_modules()[f"{ROLLOUT}.{module}"].read_text())
        based = {n.name: [ast.unparse(b) for b in n.bases] for n in tree.body if isinstance(n, ast.ClassDef) and n.bases}
        assert not based, f"{module}: classes built on others (compose them instead): {based}"


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


PATCHES, ACCESS, DOOR_MODULE = f"{DOOR}.patches", f"{DOOR}.access", f"{DOOR}.door"
"""compat's three parts (docs/design.md, "The door into megatron"): the patches, the read-only accessors, and the
door whose `apply` is the one way a patch is turned on."""
PROCESS_SETTERS = ("os.environ.setdefault", "os.environ.update", "os.environ.pop", "os.environ.clear", "os.putenv",
                   "os.unsetenv", "warnings.filterwarnings", "warnings.simplefilter", "warnings.resetwarnings",
                   "torch.set_default_", "torch.set_num_threads", "torch.set_num_interop_threads",
                   "torch.set_float32_matmul_precision", "torch.set_flush_denormal", "torch.use_deterministic_algorithms",
                   "torch.backends.", "torch._dynamo.config.", "torch._inductor.config.", "sys.meta_path.",
                   "sys.setrecursionlimit", "logging.basicConfig", "logging.disable", "logging.captureWarnings",
                   "logging.getLogger.addFilter", "logging.getLogger.setLevel", "logging.getLogger.addHandler",
                   "signal.signal")
"""Calls that change a process-wide setting (assignments to an imported module's attributes or items, such as
`os.environ[k] = v` or `torch._dynamo.config.x = v`, are found apart). `torch._dynamo.config.patch(...)` (a scoped
change, undone when its block ends) is allowed anywhere."""
KIT_PROCESS_SETTINGS = {
    "mfsdp_kit.distributed.runtime": "os.environ: MASTER_ADDR / MASTER_PORT and GLOO/NCCL_SOCKET_IFNAME, the env:// rendezvous "
                         "torch.distributed reads: the kit's own world, configured the documented way",
    "mfsdp_kit.notebook.on_engine": "os.environ: RANK, WORLD_SIZE, MASTER_ADDR, ... of an engine's torch.distributed world",
    "mfsdp_kit.distributed.stop": "signal.signal: SIGINT's handler inside a kit loop on a notebook engine (Stop as a "
                                  "pause), the previous one restored when the loop ends",
    "mfsdp_kit.notebook.ipengine": "os.environ: IPP_CONNECTION_INFO, what ipyparallel's engine reads to find its controller",
    "mfsdp_kit.notebook.ipcontroller": "os.environ: the kit's own parent-watch marker, dropped in the controller's children",
    "mfsdp_kit.notebook.lab": "signal.signal: the lab launcher's own main(), stopping the server it started",
}
"""Modules outside compat/patches that set a process-wide setting, each for the kit's own processes (no upstream
behaviour changes); anything else goes through `compat.apply` and a registry row."""


ACCESS_RESETS = {
    f"{DOOR}.access.fsdp": ("._GLOBAL_MEMORY_BUFFER =", "reset_buffer_pool drops Megatron-FSDP's module-level buffer "
                            "pool between two measured models (perf.peaks); megatron makes a new one at its next use, "
                            "so nothing it computes changes: memory is freed, no behaviour is patched"),
}
"""The one write an accessor makes to a module it reached, with why it is not a patch."""


def door_features() -> dict[str, str]:
    """compat.door.FEATURES as {feature: "module:function"} (the door imports nothing of megatron)."""
    from mfsdp_kit.compat.door import FEATURES
    return {name: f.target for name, f in FEATURES.items()}


def aliases(tree: ast.AST, here: str) -> dict[str, str]:
    """Every name an import (or `sys.modules` / `importlib.import_module`) binds in the file -> the dotted path it
stands for."""
    package, out = here.rpartition(".")[0], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.update({a.asname or a.name: f"{module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Call, ast.Subscript)):
            source = ast.unparse(node.value.func if isinstance(node.value, ast.Call) else node.value.value)
            if source in ("sys.modules.get", "sys.modules", "importlib.import_module"):   # a module fetched at run time
                out.update({t.id: f"<{ast.unparse(node.value)}>" for t in node.targets if isinstance(t, ast.Name)})
    return out


def dotted(node: ast.AST, names: dict[str, str], *, calls: bool = True) -> str | None:
    """`a.b[c].d` (through calls `a.f(x).g` where `calls`) -> the imported path of `a` + ".b.d" ("...f.g"), or None
    when `a` is not an imported name (a local object: its own attributes are the kit's business)."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Call) and not calls:
            return None
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *reversed(parts)])


def foreign_changes(path: Path) -> list[str]:
    """Where a file assigns (or deletes, or setattr's) an attribute or item of something it imported, or calls a
    process-wide setter (PROCESS_SETTERS) other than a scoped `torch._dynamo.config.patch`."""
    tree = ast.parse(path.read_text())
    names, out = aliases(tree, module_name(path)), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and (name := dotted(t, names, calls=False)):
                    out.append(f"line {node.lineno}: {name} =")
        if isinstance(node, ast.Call):
            func = dotted(node.func, names)
            if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args \
                    and (name := dotted(node.args[0], names, calls=False)):
                out.append(f"line {node.lineno}: {node.func.id}({name}, ...)")
            elif func and func.startswith(PROCESS_SETTERS) and func != "torch._dynamo.config.patch":
                out.append(f"line {node.lineno}: {func}(...)")
    return out


def test_foreign_changes_finds_them():
    import tempfile
    source = ("import os, warnings\nfrom torch import _dynamo\nfrom megatron.core import utils\nx = {}\nx['a'] = 1\n"
              "utils.f = None\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\nwarnings.filterwarnings('ignore')\n"
              "setattr(utils, 'g', 1)\nwith _dynamo.config.patch(recompile_limit=8):\n    pass\n")
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:
        path = Path(folder) / "probe.py"
        path.write_text(source)
        found = foreign_changes(path)
    assert [f.split(":")[0] for f in found] == ["line 6", "line 7", "line 8", "line 9", "line 10"], found


def test_only_compat_apply_turns_patches_on():
    features, modules = door_features(), kit_modules()
    turn_ons = {}
    for feature, target in features.items():
        module, _, function = target.partition(":")
        assert module.startswith(PATCHES + ".") and module in modules, f"{feature}: {module} is not in {PATCHES}"
        defined = {n.name for n in ast.parse(modules[module].read_text()).body if isinstance(n, ast.FunctionDef)}
        assert function in defined and function.startswith("_"), f"{feature}: {target} (a private function there)"
        turn_ons.setdefault(function, set()).add(module)
    bad = {}
    for name, path in modules.items():
        if name == DOOR_MODULE:
            continue
        tree = ast.parse(path.read_text())
        uses = [f"line {n.lineno}: {n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in turn_ons]
        uses += [f"line {n.lineno}: {n.id}()" for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in turn_ons]
        uses += [f"imports {a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                 if a.name in turn_ons]
        if not (name == DOOR or name.startswith(DOOR + ".")):   # patch rows are written in compat only
            uses += [f"imports registry.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and (n.module or "").endswith("registry") for a in n.names if a.name in ("Patch", "record")]
            uses += [f"line {n.lineno}: .record(" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and n.attr == "record" and isinstance(n.value, ast.Name) and n.value.id == "registry"]
        if uses:
            bad[name] = uses
    assert not bad, f"patches turned on (or registry rows written) other than through compat.apply: {bad}"
    assert {"_install", "_enable"} <= turn_ons.keys(), "the scan sees no turn-on function: it would pass anything"


def test_accessors_read_and_patches_change():
    modules = kit_modules()
    access = {n: p for n, p in modules.items() if n.startswith(ACCESS + ".")}
    assert {f"{ACCESS}.fsdp", f"{ACCESS}.bridge_model", f"{ACCESS}.aten"} <= access.keys()
    reset = lambda n, finding: n in ACCESS_RESETS and ACCESS_RESETS[n][0] in finding  # noqa: E731
    bad = {n: v for n, p in access.items() if (v := [f for f in foreign_changes(p) if not reset(n, f)])}
    bad |= {n: [f"imports {t}" for t, _ in imports(p) if t.startswith(PATCHES) or t == DOOR_MODULE]
            for n, p in access.items() if any(t.startswith(PATCHES) or t == DOOR_MODULE for t, _ in imports(p))}
    assert not bad, f"accessors (compat/access/) that change what they imported, or use patches: {bad}"
    outside = {n: v for n, p in modules.items() if not n.startswith(PATCHES + ".") and n not in KIT_PROCESS_SETTINGS
               and (v := [f for f in foreign_changes(p) if not reset(n, f)])}
    assert not outside, f"changes to upstream modules or process-wide settings outside {PATCHES} (a patch: a " \
                        f"compat.apply feature and a registry row; a setting of the kit's own: KIT_PROCESS_SETTINGS): " \
                        f"{outside}"
    assert any(foreign_changes(p) for n, p in modules.items() if n.startswith(PATCHES + ".")), "the scan sees nothing"
    stale = [n for n in KIT_PROCESS_SETTINGS if not foreign_changes(modules[n])]
    assert not stale, f"KIT_PROCESS_SETTINGS rows whose module sets nothing any more (delete them): {stale}"


def test_private_aten_ops_only_through_compat_access():
    """torch's private ops (`torch.ops.aten._name`) are called in compat/access/ only, each with a registry row and a
    schema canary (compat/access/aten.py, tests/compat/test_aten.py)."""
    found = {name: [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                    and ast.unparse(n.value).endswith("ops.aten")]
             for name, path in kit_modules().items()}
    assert found[f"{ACCESS}.aten"], "the scan sees no private aten op: it would pass anything"
    bad = {name: uses for name, uses in found.items() if uses and not name.startswith(ACCESS + ".")}
    assert not bad, f"private aten ops called outside {ACCESS}: {bad}"


def test_import_has_no_side_effects_and_short_names_resolve():
    """`import mfsdp_kit` imports no module of the kit, torch or megatron; the notebooks' first line,
    `from mfsdp_kit import cluster, widgets, plots`, gets the modules in notebook/ and still no torch."""
    import subprocess
    import sys
    code = ("import sys, mfsdp_kit\n"
            "before = sorted(m for m in sys.modules if m.startswith(('mfsdp_kit.', 'torch', 'megatron')))\n"
            "from mfsdp_kit import cluster, widgets, plots\n"
            "print(before, cluster.__name__, widgets.__name__, plots.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["[]", f"{PACKAGE}.notebook.cluster", f"{PACKAGE}.notebook.widgets",
                           f"{PACKAGE}.notebook.plots", "False"], out
