"""The layering rules of docs/design.md, checked over the import graph (every import statement, including
those inside functions). A rule broken by a new import fails here with the importing module named."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slipstream"
LEAF_HELPERS = {"utils", "git_version_info", "git_version_info_installed"}


def _imports() -> dict[str, set[str]]:
    """Module -> the slipstream modules it imports."""
    graph: dict[str, set[str]] = {}
    for source in PACKAGE.rglob("*.py"):
        parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("slipstream")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("slipstream"):
                found.add(str(node.module))
        graph[module] = found
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _violations(graph: dict[str, set[str]], layer: str, allowed: set[str]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.items() if _layer(module) == layer
                  for target in targets if _layer(target) not in allowed | {layer})


def test_nothing_imports_the_engine_but_the_entry_point() -> None:
    graph = _imports()
    bad = sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts
                 if _layer(t) == "engine" and _layer(m) not in ("engine", "api"))
    assert not bad, f"the engine is where the parts meet; only api.py builds it: {bad}"


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


def test_zero_reaches_compat_only_for_the_parameter_attributes() -> None:
    graph = _imports()
    bad = sorted(f"{m} imports {t}" for m, ts in graph.items() if _layer(m) == "zero" for t in ts
                 if _layer(t) == "compat" and t != "slipstream.compat.param_attrs")
    assert not bad, f"zero/ may use compat's ds_* attribute mixin (a leaf) and nothing else of compat: {bad}"


def test_pipe_builds_on_zero_and_comm_but_not_the_engine() -> None:
    allowed = {"accelerator", "config", "comm", "zero", "offload", "checkpoint", "planner"} | LEAF_HELPERS
    bad = _violations(_imports(), "pipe", allowed)
    assert not bad, f"pipe/ runs stages over zero/ and comm/; the engine's builders reach it from api.py: {bad}"


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
