"""FLOPs, MACs, parameters and latency per module: DeepSpeed's `FlopsProfiler` and `get_model_profile`.

FLOPs come from PyTorch's own `torch.utils.flop_counter.FlopCounterMode`, which knows the formula of every
matmul-class op (linear, matmul, bmm, baddbmm, convolutions and their transposes, scaled-dot-product attention
in each backend), instead of a hand-kept table of module formulas. What it counts is what MFU means: the
multiply-adds (one MAC = 2 FLOPs). Elementwise ops (activations, norms, softmax outside SDPA) are not counted;
DeepSpeed adds rough figures for some of them, so its totals run a few percent higher on small layers.

Latency per module is measured in a separate pass with forward hooks (the counting pass runs under a torch
dispatch mode, which would distort it), after `warm_up` unmeasured passes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode


def _cpu_attention(query_shape: object, key_shape: object, value_shape: object, *args: object, **kwargs: object) -> int:
    return int(flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_attention_backward(
    grad_shape: object, query_shape: object, key_shape: object, value_shape: object, *args: object, **kwargs: object
) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape))


def _extra_formulas() -> dict[Any, Any]:
    """Ops FlopCounterMode has no formula for (torch 2.4-2.13): the CPU flash-attention kernels that SDPA uses
    on the CPU, counted with torch's own SDPA formulas (full score matrix, as it counts every SDPA backend)."""
    aten = torch.ops.aten
    found: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            found[op] = formula
    return found


__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "number_to_string", "training_flops"]


@dataclasses.dataclass
class ModuleProfile:
    """One module's figures; FLOPs and latency include its children."""

    name: str
    type: str
    depth: int
    params: int
    flops: int = 0
    latency_s: float = 0.0

    @property
    def macs(self) -> int:
        return self.flops // 2


def number_to_string(value: float, unit: str = "", precision: int = 2) -> str:
    """12_300_000 -> '12.3 M' (DeepSpeed's style of figures)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.{precision}f} {prefix}{unit}"
    text = str(int(value)) if float(value).is_integer() else f"{value:.{precision}f}"
    return f"{text} {unit}".rstrip()


def training_flops(forward_flops: int, recompute_fwd_factor: float = 0.0) -> int:
    """FLOPs of one training step from those of its forward: the backward costs two forwards (the gradient
    with respect to the input and to the weights), recomputed activations add `recompute_fwd_factor` forwards."""
    return int(forward_flops * (3.0 + recompute_fwd_factor))


class FlopsProfiler:
    """Profile one or more forward passes of `model` (DeepSpeed's class of the same name).

    `start_profile()`, run the model, `stop_profile()`, read `get_total_flops()` / `get_total_macs()` /
    `get_total_params()` / `get_total_duration()`, `print_model_profile()`, and `end_profile()`.
    """

    def __init__(self, model: nn.Module, ds_engine: object = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self._counter: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._started: dict[int, list[float]] = {}
        self._latency: dict[str, float] = {}
        self._flops: dict[str, int] = {}
        self._duration = 0.0
        self._began = 0.0
        self.started = False

    # ---- DeepSpeed's protocol ----
    def start_profile(
        self, ignore_list: Sequence[type[nn.Module]] | None = None, *, count: bool = True, time_modules: bool = True
    ) -> None:
        """Count FLOPs and time every module's forward until `stop_profile()`. Counting runs the ops under a
        dispatch mode, which slows them: `get_model_profile` counts and times in separate passes."""
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        root = type(self.model).__name__
        for path, module in self.model.named_modules() if time_modules else ():
            if ignored and isinstance(module, ignored):
                continue
            key = self._key(root, path)
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(id(module))))
            self._hooks.append(module.register_forward_hook(self._post_hook(id(module), key)))
        self._counter = FlopCounterMode(display=False, custom_mapping=_extra_formulas()) if count else None
        if self._counter is not None:
            self._counter.__enter__()
        self._began = time.perf_counter()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the figures stay readable until `end_profile()`."""
        if not self.started:
            return
        self._duration = time.perf_counter() - self._began
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._flops = {name: int(sum(ops.values())) for name, ops in self._counter.get_flop_counts().items()}
            self._counter = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.started = False

    def reset_profile(self) -> None:
        self._flops, self._latency, self._started, self._duration = {}, {}, {}, 0.0

    def measure(self, run: Callable[[], None], ignore_list: Sequence[type[nn.Module]] | None = None) -> None:
        """Profile `run()` (one forward) in two passes: FLOPs under the counting mode, then latency without it."""
        self.start_profile(ignore_list=ignore_list, time_modules=False)
        try:
            run()
        finally:
            self.stop_profile()
        counted = dict(self._flops)
        self.start_profile(ignore_list=ignore_list, count=False)
        try:
            run()
        finally:
            self.stop_profile()
        self._flops = counted

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset_profile()
        self._counter = None

    def get_total_flops(self, as_string: bool = False) -> int | str:
        total = self._flops.get("Global", 0)
        return number_to_string(total, "FLOPS") if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        total = self._flops.get("Global", 0) // 2
        return number_to_string(total, "MACs") if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        total = sum(p.numel() for p in self.model.parameters())
        return number_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        return f"{self._duration * 1000:.2f} ms" if as_string else self._duration

    # ---- per module ----
    def module_profiles(self) -> list[ModuleProfile]:
        """Every module of the model in definition order, with its figures (FLOPs include its children)."""
        root = type(self.model).__name__
        profiles: dict[str, ModuleProfile] = {}
        for path, module in self.model.named_modules():
            key = self._key(root, path)
            profiles[path] = ModuleProfile(
                name=path or root,
                type=type(module).__name__,
                depth=0 if not path else path.count(".") + 1,
                params=sum(p.numel() for p in module.parameters()),
                flops=self._flops.get(key, 0),
                latency_s=self._latency.get(key, 0.0),
            )
        # A container that is never called itself (ModuleList, ModuleDict) gets its children's sums, deepest first.
        for path, module in reversed(list(self.model.named_modules())):
            profile = profiles[path]
            if self._key(root, path) in self._latency or not path:
                continue
            children = [profiles[f"{path}.{name}"] for name, _ in module.named_children()]
            if not children:
                continue
            profile.flops = sum(child.flops for child in children)
            profile.latency_s = sum(child.latency_s for child in children)
        return list(profiles.values())

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str:
        """Write the profile (to `output_file`, or stdout) and return it."""
        text = self.render(profile_step, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            _write(sys.stdout, text)
        return text

    def render(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
        flops = int(self.get_total_flops())
        duration = float(self.get_total_duration())
        lines = [
            "-------------------------- Slipstream Flops Profiler --------------------------",
            f"Profile of step:                 {profile_step}",
            f"Params:                          {number_to_string(int(self.get_total_params()))}",
            f"Forward MACs:                    {number_to_string(flops // 2, 'MACs')}",
            f"Forward FLOPs:                   {number_to_string(flops, 'FLOPs')}",
            f"Forward latency:                 {duration * 1000:.2f} ms",
            f"Forward FLOPS (achieved):        {number_to_string(flops / max(duration, 1e-12), 'FLOPS')}",
            f"Training step FLOPs (fwd + bwd): {number_to_string(training_flops(flops, self.recompute_fwd_factor), 'FLOPs')}",
        ]
        profiles = self.module_profiles()
        deepest = max((p.depth for p in profiles), default=0)
        depth = deepest if module_depth < 0 else min(module_depth, deepest)
        lines.append(f"\nTop {top_modules} modules by FLOPs at each depth (up to depth {depth}):")
        for level in range(depth + 1):
            at_level = sorted((p for p in profiles if p.depth == level), key=lambda p: -p.flops)[:top_modules]
            listed = ", ".join(f"{p.name} ({p.type}) {number_to_string(p.flops, 'FLOPs')}" for p in at_level)
            lines.append(f"  depth {level}: {listed}")
        if detailed:
            lines.append("\nPer module: params, FLOPs (% of total), latency, achieved FLOPS")
            for p in profiles:
                if module_depth >= 0 and p.depth > module_depth:
                    continue
                share = 100.0 * p.flops / flops if flops else 0.0
                rate = p.flops / p.latency_s if p.latency_s > 0 else 0.0
                lines.append(
                    f"{'  ' * p.depth}{p.name} ({p.type}): {number_to_string(p.params)} params, "
                    f"{number_to_string(p.flops, 'FLOPs')} ({share:.1f}%), {p.latency_s * 1000:.3f} ms, "
                    f"{number_to_string(rate, 'FLOPS')}"
                )
        lines.append("-" * 80)
        return "\n".join(lines) + "\n"

    # ---- internals ----
    @staticmethod
    def _key(root: str, path: str) -> str:
        return f"{root}.{path}" if path else root

    def _pre_hook(self, ident: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object) -> None:
            self._started.setdefault(ident, []).append(time.perf_counter())

        return hook

    def _post_hook(self, ident: int, key: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            stack = self._started.get(ident)
            if stack:
                self._latency[key] = self._latency.get(key, 0.0) + time.perf_counter() - stack.pop()

        return hook


def _write(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


def _inputs(input_shape: Sequence[int] | None, args: Sequence[object], model: nn.Module) -> list[Any]:
    if input_shape is None:
        return list(args)
    if args:
        raise ValueError("get_model_profile: give input_shape or args, not both (input_shape builds the only input)")
    if not isinstance(input_shape, (tuple, list)) or not all(isinstance(d, int) and d > 0 for d in input_shape):
        raise ValueError(f"get_model_profile: input_shape must be a tuple of positive ints, got {input_shape!r}")
    reference = next(model.parameters(), None)
    kwargs: dict[str, Any] = {}
    if reference is not None:
        kwargs = {"device": reference.device, "dtype": reference.dtype}
    return [torch.ones(tuple(input_shape), **kwargs)]


@torch.no_grad()
def _forward(model: nn.Module, args: Sequence[object], kwargs: dict[str, object]) -> None:
    model(*args, **kwargs)


def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence[object] = (),
    kwargs: dict[str, object] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type[nn.Module]] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """(FLOPs, MACs, parameters) of one forward of `model` (strings such as "1.2 GFLOPs" when `as_string`),
    printing the profile when `print_profile`. DeepSpeed's signature and return values."""
    if mode != "forward":
        raise NotImplementedError(f"get_model_profile(mode={mode!r}): only mode='forward' is implemented")
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    call_args = _inputs(input_shape, args, model)
    call_kwargs = dict(kwargs or {})
    for _ in range(max(warm_up, 0)):
        _forward(model, call_args, call_kwargs)
    profiler = FlopsProfiler(model)
    profiler.measure(lambda: _forward(model, call_args, call_kwargs), ignore_list=ignore_modules)
    flops, params = int(profiler.get_total_flops()), int(profiler.get_total_params())
    if print_profile:
        profiler.print_model_profile(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, output_file=output_file
        )
    profiler.end_profile()
    if as_string:
        return number_to_string(flops, "FLOPS"), number_to_string(flops // 2, "MACs"), number_to_string(params)
    return flops, flops // 2, params
