"""The layering rules of docs/design.md, checked over the import graph (every import statement, including
those inside functions). A rule broken by a new import fails here with the importing module named."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slipstream"
LEAF_HELPERS = {"utils", "git_version_info", "git_version_info_installed"}
PIPELINE_ENGINE = "slipstream.pipe.engine"
"""The engine with a pipeline schedule (a subclass of the engine): the one module of pipe/ that imports engine/."""


def _module_name(source: Path) -> str:
    parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The slipstream modules one import statement loads: relative imports resolved against `module`, and
    `from package import name` counted as the submodule when `name` is one."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "slipstream"}
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if base.split(".")[0] != "slipstream":
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Module -> the slipstream modules it imports (every statement, inside functions too); parsed once per run,
    so callers must not change it."""
    sources = {_module_name(source): source for source in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= _targets(node, module, source.name == "__init__.py", set(sources))
        graph[module] = found - {module}
    return graph


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level subpackage -> the other top-level subpackages its modules import (the package's top modules,
    api.py and the like, are no folder)."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    edges: dict[str, set[str]] = {folder: set() for folder in folders}
    for module, targets in graph.items():
        for target in targets:
            source, dest = _layer(module), _layer(target)
            if source in folders and dest in folders and source != dest:
                edges[source].add(dest)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as its path (first node repeated at the end), or [] when it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, stack = [start], [iter(sorted(graph.get(start, ())))]
        while stack:
            node = next(stack[-1], None)
            if node is None:
                done.add(path.pop())
                stack.pop()
            elif node in path:
                return path[path.index(node) :] + [node]
            elif node not in done:
                path.append(node)
                stack.append(iter(sorted(graph.get(node, ()))))
    return []


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _violations(graph: dict[str, set[str]], layer: str, allowed: set[str]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _layer(module) == layer
        for target in targets
        if _layer(target) not in allowed | {layer}
    )


def _outside_users(graph: dict[str, set[str]], layer: str, users: set[str]) -> list[str]:
    """Imports of `layer` by modules of neither `layer` nor `users`."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if _layer(target) == layer and _layer(module) not in users | {layer}
    )


def test_nothing_imports_the_engine_but_the_entry_point() -> None:
    graph = _imports()
    bad = sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        for t in ts
        if _layer(t) == "engine" and _layer(m) not in ("engine", "api") and m != PIPELINE_ENGINE
    )
    assert not bad, f"the engine is where the parts meet; only api.py builds it (and pipe/engine.py extends it): {bad}"


def test_ops_accelerator_config_and_utils_are_leaves() -> None:
    graph = _imports()
    bad = [v for layer in ("ops", "accelerator", "config", "utils") for v in _violations(graph, layer, LEAF_HELPERS)]
    assert not bad, f"leaf layers import only leaf helpers: {bad}"


def test_comm_knows_nothing_of_sharding() -> None:
    bad = _violations(_imports(), "comm", {"accelerator", "config"} | LEAF_HELPERS)
    assert not bad, f"comm/ is collectives and process groups only: {bad}"


def test_the_launcher_does_not_train() -> None:
    bad = _violations(_imports(), "launcher", {"accelerator", "config"} | LEAF_HELPERS)
    assert not bad, f"launcher/ starts processes; it imports no training code: {bad}"


def test_zero_imports_nothing_of_compat() -> None:
    bad = sorted(
        f"{m} imports {t}" for m, ts in _imports().items() if _layer(m) == "zero" for t in ts if _layer(t) == "compat"
    )
    assert not bad, f"zero/ is core; DeepSpeed's surface in compat/ builds on it, never the reverse: {bad}"


def test_pipe_builds_on_zero_and_comm_and_only_its_engine_on_the_engine() -> None:
    allowed = {"accelerator", "config", "comm", "zero", "offload", "checkpoint", "planner"} | LEAF_HELPERS
    engine = f"{PIPELINE_ENGINE} imports slipstream.engine."
    bad = [v for v in _violations(_imports(), "pipe", allowed) if not v.startswith(engine)]
    assert not bad, f"pipe/ runs stages over zero/ and comm/; only pipe/engine.py builds on the engine: {bad}"


def test_model_parallel_layers_sit_on_comm() -> None:
    graph = _imports()
    # activation/: FPDT's chunk store counts its device bytes with activation.live_bytes
    bad = _violations(graph, "sequence", {"comm", "accelerator", "activation"} | LEAF_HELPERS)
    bad += _violations(graph, "parallel", {"comm", "accelerator", "config"} | LEAF_HELPERS)
    assert not bad, f"parallel/ (TP, the mesh) and sequence/ (Ulysses) build on comm/ and DTensor only: {bad}"


def test_moe_builds_on_comm_and_zero_and_nothing_below_needs_it() -> None:
    graph = _imports()
    bad = _violations(graph, "moe", {"comm", "zero", "config"} | LEAF_HELPERS)
    bad += _outside_users(graph, "moe", {"engine", "api", "compat", "<root>"})
    assert not bad, f"moe/ uses comm/ and zero/; zero/, checkpoint/ and the rest know nothing of it: {bad}"


def test_inference_builds_on_parallel_and_checkpoint_and_only_the_entry_points_use_it() -> None:
    graph = _imports()
    bad = _violations(graph, "inference", {"accelerator", "config", "parallel", "checkpoint", "comm"} | LEAF_HELPERS)
    bad += _outside_users(graph, "inference", {"engine", "api", "compat", "<root>"})
    assert not bad, f"inference/ prepares a model with parallel/ and checkpoint/; training code never needs it: {bad}"


def test_the_tuner_launches_training_and_never_imports_it() -> None:
    allowed = {"accelerator", "config", "launcher", "planner", "profiling"} | LEAF_HELPERS
    bad = _violations(_imports(), "autotuning", allowed)
    assert not bad, f"autotuning/ runs trials as launched jobs over the planner; it imports no training code: {bad}"


def test_precision_sits_on_config_and_the_accelerator() -> None:
    bad = _violations(_imports(), "precision", {"accelerator", "config"} | LEAF_HELPERS)
    assert not bad, f"precision/ turns the precision plan into autocast regions and optimizer settings: {bad}"


def test_our_optimizers_sit_on_zero_and_comm() -> None:
    graph = _imports()
    bad = _violations(graph, "optim", {"accelerator", "comm", "config", "ops", "zero"} | LEAF_HELPERS)
    bad += _outside_users(graph, "optim", {"engine", "api", "compat", "<root>"})
    assert not bad, f"optim/ steps ZeRO's pieces (comm/, zero/, ops/); only the engine and compat/ build on it: {bad}"


def test_the_rules_see_a_violation() -> None:
    graph = {"slipstream.comm.x": {"slipstream.zero.layout"}, "slipstream.config.y": {"slipstream.utils.logging"}}
    assert _violations(graph, "comm", set(LEAF_HELPERS)) == ["slipstream.comm.x imports slipstream.zero.layout"]
    assert _violations(graph, "config", set(LEAF_HELPERS)) == []
    assert "slipstream.zero.build" in _imports()


def test_profiling_and_activation_checkpointing_know_no_training_machinery() -> None:
    graph = _imports()
    bad = _violations(graph, "profiling", set(LEAF_HELPERS))
    bad += _violations(graph, "activation", {"accelerator", "config", "comm"} | LEAF_HELPERS)
    assert not bad, f"profiling/ measures any module; activation/ wraps any function: {bad}"


def test_compile_wraps_the_model_and_knows_no_engine() -> None:
    bad = _violations(_imports(), "compile", {"accelerator", "config", "zero"} | LEAF_HELPERS)
    assert not bad, f"compile/ compiles the model's blocks around ZeRO's hooks; the engine calls it: {bad}"


def test_data_schedules_sit_on_config_and_only_the_engine_uses_them() -> None:
    graph = _imports()
    bad = _violations(graph, "data", {"config"} | LEAF_HELPERS)
    bad += _outside_users(graph, "data", {"engine", "api", "compat", "<root>"})
    assert not bad, f"data/ turns its plan into per-step forward arguments; the engine calls it: {bad}"


def test_compression_sits_on_config_and_only_user_facing_code_uses_it() -> None:
    graph = _imports()
    bad = _violations(graph, "compression", {"config"} | LEAF_HELPERS)
    bad += _outside_users(graph, "compression", {"engine", "api", "compat", "<root>"})
    assert not bad, f"compression/ rewrites a user's layers from its own config section; the engine steps it: {bad}"


def test_no_module_imports_itself_through_others() -> None:
    cycle = _cycle(_imports())
    assert not cycle, (
        f"import cycle between modules (function-level imports count): {' -> '.join(cycle)}; move the piece both "
        "need into the module that should own it (docs/design.md: config -> plan -> components -> engine)"
    )


def test_no_folder_imports_itself_through_others() -> None:
    cycle = _cycle(_folder_graph(_imports()))
    assert not cycle, (
        f"import cycle between slipstream's folders: {' -> '.join(cycle)}; the edges (compat/, cli/) depend "
        "on the core, never the reverse: move the shared piece into the folder that should own it"
    )


def test_the_cycle_check_sees_a_cycle_and_resolves_relative_imports() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    modules = {"slipstream.zero.layout", "slipstream.zero.optimizer", "slipstream.comm"}
    relative = ast.parse("from .layout import x\nfrom ..comm import y\nfrom . import optimizer").body
    found = set().union(*(_targets(node, "slipstream.zero.build", False, modules) for node in relative))  # type: ignore[arg-type]
    assert found == {"slipstream.zero.layout", "slipstream.comm", "slipstream.zero.optimizer"}
    graph = {"slipstream.zero.a": {"slipstream.compat.b"}, "slipstream.compat.b": {"slipstream.zero.c"}}
    assert _cycle(_folder_graph(graph)) in (["compat", "zero", "compat"], ["zero", "compat", "zero"])


# Sizes: a function a reader can hold at once (60 lines), a module with one job (450 lines).
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450
STILL_LONG: dict[str, int] = {}
"""Functions and modules (path relative to slipstream/, `path:Class.function` or `path`) still over the limits,
each with its size now: an entry may shrink (lower its number) or go, never grow, and no other may join."""


def _function_sizes(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Qualified name -> lines (def to last line) of every function in `tree`, nested ones included."""
    sizes: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        name = f"{prefix}{getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sizes[name] = (node.end_lineno or node.lineno) - node.lineno + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            sizes.update(_function_sizes(node, f"{name}."))
        else:
            sizes.update(_function_sizes(node, prefix))
    return sizes


def _oversized(package: Path) -> dict[str, int]:
    """Every function over MAX_FUNCTION_LINES and module over MAX_MODULE_LINES under `package`, with its size."""
    found: dict[str, int] = {}
    for source in sorted(package.rglob("*.py")):
        text, where = source.read_text(), source.relative_to(package).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found[where] = len(text.splitlines())
        for name, lines in _function_sizes(ast.parse(text)).items():
            if lines > MAX_FUNCTION_LINES:
                found[f"{where}:{name}"] = lines
    return found


def _size_problems(found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """What breaks the ratchet: a size over its allowance (none for a name not in `allowed`), or an allowance
    above the size now (it must come down, so the list only shrinks)."""
    grown = [f"{k}: {n} lines, over the limit; split it" for k, n in found.items() if n > allowed.get(k, 0)]
    stale = [
        f"{k}: now {found.get(k, 'within the limit')}; lower or remove its STILL_LONG entry"
        for k, n in allowed.items()
        if found.get(k, 0) < n
    ]
    return grown + stale


def test_functions_and_modules_stay_within_size_limits() -> None:
    problems = _size_problems(_oversized(PACKAGE), STILL_LONG)
    assert not problems, (
        f"functions over {MAX_FUNCTION_LINES} lines or modules over {MAX_MODULE_LINES} in slipstream/: {problems}"
    )


def test_the_size_check_sees_a_long_function_and_a_stale_entry(tmp_path: Path) -> None:
    lines = ["class K:", "    def f(self) -> None:"] + [f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES)]
    (tmp_path / "long.py").write_text("\n".join(lines) + "\n")
    found = _oversized(tmp_path)
    assert found == {"long.py:K.f": MAX_FUNCTION_LINES + 1}
    assert _size_problems(found, {}), "a new long function must fail"
    assert not _size_problems(found, {"long.py:K.f": MAX_FUNCTION_LINES + 1})
    assert _size_problems(found, {"long.py:K.f": MAX_FUNCTION_LINES + 2}), "a shrunk entry must be lowered"
