"""The engine's `compile()`, `is_compiled` and its backward pass through compiled autograd (a mixin of the
engine's DeepSpeed methods; it reads the engine's `plan`, `module`, `zero_model` and `global_rank`).

`engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)` has DeepSpeed's signature. It
compiles each repeated block of the model on its own (regions.py, [Note: compiled regions]) at every ZeRO
stage, keeps ZeRO's hooks outside the compiled graphs, and counts the graph breaks of each block
(graph_breaks.py). DeepCompile (`compile.deepcompile`, the `schedule` argument) is not built: compile()
refuses it by name rather than compiling something else.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.compile.autograd import compiled_backward, require_compiled_autograd
from slipstream.compile.graph_breaks import GraphBreakLedger
from slipstream.compile.regions import (
    CompiledRegion,
    choose_regions,
    compile_region,
    fit_cache_to_regions,
    torch_compiler,
)
from slipstream.config.plan import CompilePlan
from slipstream.utils.logging import log_rank0


@dataclasses.dataclass
class CompileState:
    """What one `engine.compile()` set up."""

    backend: str
    regions: list[CompiledRegion]
    ledger: GraphBreakLedger
    backward_compiler: Any
    """torch.compile's wrapper for compiled autograd; None when it is off."""


def _hooked_modules(zero_model: Any) -> dict[nn.Module, str]:
    """ZeRO-3's units' modules (they carry the gather / release hooks), by unit name; empty at stages 0-2."""
    if zero_model is None:
        return {}
    return {unit.module: unit.name for unit in zero_model.units if unit.module is not None}


def _refuse_deepcompile(plan: CompilePlan, schedule: object) -> None:
    if plan.deepcompile:
        raise NotImplementedError(
            "engine.compile(): compile.deepcompile is true, but DeepCompile's graph passes are not built in "
            "Slipstream; set compile.deepcompile to false to compile each block with torch.compile"
        )
    if schedule is not None:
        raise NotImplementedError(
            f"engine.compile(schedule={schedule!r}): schedules are DeepCompile's, which Slipstream does not "
            "build; call engine.compile() without a schedule"
        )


def _refuse_compiled_autograd_at_stage3(zero_model: object) -> None:
    """Compiled autograd traces every backward hook into its graph. Stage 3's hooks gather and reduce-scatter
    through process-group calls and queue the end-of-backward reduction with `queue_callback`, which dynamo
    accepts only under compiled autograd's fullgraph=True (torch 2.13), where the collectives cannot be traced.
    Kept out of the graph (`torch._dynamo.disable`), the hooks ran, but the compiled backward handed one
    parameter's gradient hook its gradient twice in one pass (checked on torch 2.13, 2 ranks)."""
    if zero_model is not None:
        raise NotImplementedError(
            "engine.compile(compiled_autograd_enabled=True) at ZeRO stage 3: compiled autograd would trace stage "
            "3's backward hooks, which gather and reduce-scatter through the process group and queue the "
            "end-of-backward reduction (torch's compiled autograd takes queue_callback only with fullgraph=True, "
            "where those collectives cannot be traced); pass compiled_autograd_enabled=False (each block's "
            "backward is still compiled) or use stage 0-2"
        )


def _torch_options(compile_kwargs: Mapping[str, object]) -> dict[str, Any]:
    options = dict(compile_kwargs)
    if "backend" in options:
        warnings.warn(
            "engine.compile(): the 'backend' in compile_kwargs is ignored; pass backend= instead", stacklevel=3
        )
        del options["backend"]
    return options


class CompiledEngine:
    """`compile()`, `is_compiled`, `graph_breaks` and `_backward_pass()` of the engine (see the module doc)."""

    plan: Any
    module: nn.Module
    zero_model: Any
    global_rank: int
    _compile_state: CompileState | None = None

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: Mapping[str, object] | None = None,
        schedule: object = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the model's blocks with `torch.compile(backend=backend, **compile_kwargs)`; `backend` defaults
        to the accelerator's (`get_accelerator().get_compile_backend()`, "inductor"). A second call does
        nothing, as in DeepSpeed."""
        _refuse_deepcompile(self.plan.compile, schedule)
        if self._compile_state is not None:
            return
        backend = backend or get_accelerator().get_compile_backend()
        options = _torch_options(compile_kwargs or {})
        compiler = torch_compiler(backend, options)
        backward_compiler = None
        if compiled_autograd_enabled:
            _refuse_compiled_autograd_at_stage3(self.zero_model)
            require_compiled_autograd()
            backward_compiler = compiler
        chosen = choose_regions(self.module, _hooked_modules(self.zero_model))
        fit_cache_to_regions(len(chosen))
        ledger = GraphBreakLedger([name for name, _ in chosen], rank=self.global_rank)
        regions = [compile_region(name, module, compiler=compiler, ledger=ledger) for name, module in chosen]
        self._compile_state = CompileState(
            backend=backend, regions=regions, ledger=ledger, backward_compiler=backward_compiler
        )
        log_rank0(
            f"engine.compile(): backend {backend!r}, {len(regions)} regions ({_names(regions)})"
            + (", compiled autograd" if backward_compiler is not None else ""),
            rank=self.global_rank,
        )

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` has run (DeepSpeed's property)."""
        return self._compile_state is not None

    @property
    def graph_breaks(self) -> dict[str, dict[str, int]]:
        """Graph breaks per compiled region (region -> reason -> count), as counted so far; empty before
        compile()."""
        state = self._compile_state
        return {} if state is None else {name: dict(reasons) for name, reasons in state.ledger.breaks.items()}

    def _backward_pass(self, loss: torch.Tensor, *, retain_graph: bool) -> None:
        """`loss.backward()` for `engine.backward`: through compiled autograd when compile() turned it on."""
        state = self._compile_state
        with compiled_backward(None if state is None else state.backward_compiler):
            loss.backward(retain_graph=retain_graph)


def _names(regions: list[CompiledRegion]) -> str:
    names = [region.name for region in regions]
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]}"
