"""What the planner needs to know about a model: parameter sizes in registration order, the stage-3 units, and
the dimensions that drive activations. Built from an `nn.Module` (meta or real), a "module:factory" string
(called under `torch.device("meta")`), a Hugging Face `config.json`, or a parameter count (a synthetic
transformer of that size). The last two build a small meta-device module too, so every path goes through the
engine's own unit rules (`zero/stage3/units.plan_units`). torch is imported only here, when needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.planner.prefetch import UnitShape

if TYPE_CHECKING:
    from slipstream.config.precision_plans import AutocastPlan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Dims:
    """Transformer dimensions for the activation estimate (any may be unknown)."""

    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    vocab: int | None = None


@dataclasses.dataclass(kw_only=True)
class ModelShape:
    """A model's parameters (distinct, registration order) and, for stage 3, a way to get its units."""

    module: Any
    """The nn.Module (often on the meta device) the stage-3 units are planned on."""
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    dims: Dims
    source: str
    _units: dict[tuple[object, ...], list[UnitShape]] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def trainable_numels(self) -> list[int]:
        return [n for n, t in zip(self.numels, self.trainable) if t]

    @property
    def frozen_numel(self) -> int:
        return sum(n for n, t in zip(self.numels, self.trainable) if not t)

    def units(
        self,
        threshold: int,
        leaf_classes: tuple[str, ...] = (),
        leaf_names: tuple[str, ...] = (),
        leaf_suffixes: tuple[str, ...] = (),
        autocast: AutocastPlan | None = None,
    ) -> list[UnitShape]:
        """The stage-3 units; with `autocast` (an `AutocastPlan`) each carries its parameters' reduce dtypes."""
        key = (threshold, leaf_classes, leaf_names, leaf_suffixes, autocast)
        if key not in self._units:
            with reduce_dtypes_marked(self.module, autocast):
                self._units[key] = plan_unit_shapes(
                    self.module,
                    threshold=threshold,
                    leaf_classes=leaf_classes,
                    leaf_names=leaf_names,
                    leaf_suffixes=leaf_suffixes,
                )
        return self._units[key]

    def trainable_reduce_dtypes(self, autocast: AutocastPlan | None) -> list[str | None]:
        """The reduce dtype of each trainable parameter (registration order) under `autocast` (an `AutocastPlan`
        or None), as `precision/reduce_dtypes.py` marks it for the engine (None: the ZeRO reduce dtype)."""
        if autocast is None or self.module is None:
            return [None] * len(self.trainable_numels)
        from slipstream.precision.reduce_dtypes import reduce_dtype_of

        with reduce_dtypes_marked(self.module, autocast):
            return [reduce_dtype_of(p) for p in self.module.parameters() if p.requires_grad]


@contextlib.contextmanager
def reduce_dtypes_marked(module: Any, autocast: AutocastPlan | None) -> Iterator[None]:
    """`module`'s parameters marked by the engine's own `mark_reduce_dtypes` for `autocast` (on the accelerator's
    device type) while inside; the attributes the marking added are removed after, so the caller's model is
    left as it was (an engine's model, already marked, keeps its marks)."""
    if autocast is None:
        yield
        return
    from slipstream.accelerator import get_accelerator
    from slipstream.precision.reduce_dtypes import mark_reduce_dtypes

    params = list(module.parameters())
    before = [set(vars(p)) for p in params]
    mark_reduce_dtypes(module, autocast, device_type=get_accelerator().device_name())
    try:
        yield
    finally:
        for param, keys in zip(params, before):
            for added in set(vars(param)) - keys:
                delattr(param, added)


def from_module(module: Any, *, source: str = "model", dims: Dims | None = None) -> ModelShape:
    params = list(module.parameters())  # distinct: a tied weight is listed once
    found = dims or Dims()
    if dims is None or dims.hidden is None:
        found = _guess_dims(module, found)
    return ModelShape(
        module=module,
        numels=tuple(p.numel() for p in params),
        trainable=tuple(bool(p.requires_grad) for p in params),
        dims=found,
        source=source,
    )


def from_factory(spec: str) -> ModelShape:
    """`"package.module:factory"`: `factory()` is called under `torch.device("meta")` (no memory is used)."""
    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: write it as 'package.module:factory', a callable returning an nn.Module")
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"--model {spec!r} returned {type(module).__name__}, not a torch.nn.Module")
    return from_module(module, source=spec)


def _guess_dims(module: object, dims: Dims) -> Dims:
    """Read hidden/layers/heads/vocab from a `config` attribute (Hugging Face or GPTConfig-style) if there is one."""
    config = getattr(module, "config", None)
    if config is None:
        return dims

    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    return Dims(
        hidden=dims.hidden or first("hidden_size", "n_embd", "d_model"),
        layers=dims.layers or first("num_hidden_layers", "n_layer", "num_layers"),
        heads=dims.heads or first("num_attention_heads", "n_head"),
        vocab=dims.vocab or first("vocab_size"),
    )


def plan_unit_shapes(
    module: Any,
    *,
    threshold: int,
    leaf_classes: tuple[str, ...] = (),
    leaf_names: tuple[str, ...] = (),
    leaf_suffixes: tuple[str, ...] = (),
) -> list[UnitShape]:
    """The engine's stage-3 units of `module` (`plan_units`) and, per hooked unit, the units it borrows from."""
    from slipstream.zero.stage3.leaves import leaf_matches
    from slipstream.zero.stage3.units import plan_units

    found, _ = leaf_matches(module, leaf_classes, leaf_names, leaf_suffixes)
    marked = [m for _, m in found if not getattr(m, "_z3_leaf", False)]
    for m in marked:
        m._z3_leaf = True  # type: ignore[assignment]
    try:
        specs = plan_units(module, threshold=threshold)
    finally:
        for m in marked:
            del m._z3_leaf
    owner = {id(p): i for i, spec in enumerate(specs) for _, p in spec.params}
    hooked = {id(spec.module) for spec in specs if spec.module is not None}
    subtree = {
        i: {id(p) for p in spec.module.parameters()}
        for i, spec in enumerate(specs)
        if spec.module is not None and spec.module is not module
    }
    shapes = []
    for i, spec in enumerate(specs):
        borrow: list[int] = []
        stack = [spec.module] if spec.module is not None else []
        while stack:
            current = stack.pop()
            params = [*current.parameters(recurse=False), *getattr(current, "_z3_external_params", ())]
            for param in params:
                other = owner.get(id(param))
                if other is not None and other != i and not specs[other].persistent and other not in borrow:
                    borrow.append(other)
            stack.extend(c for c in current.children() if id(c) not in hooked)
        hosts: tuple[int, ...] = ()
        if spec.persistent:
            ids = {id(p) for _, p in spec.params if p.requires_grad}
            hosts = tuple(j for j, inside in subtree.items() if ids & inside)
            if any(not any(id(p) in inside for inside in subtree.values()) for _, p in spec.params if p.requires_grad):
                hosts = ()  # some parameter lives with the root: complete only at the end of backward
        shapes.append(
            UnitShape(
                name=spec.name,
                numels=tuple(p.numel() for _, p in spec.params),
                trainable=tuple(bool(p.requires_grad) for _, p in spec.params),
                persistent=spec.persistent,
                hooked=spec.module is not None,
                is_root=spec.module is module,
                borrow=tuple(borrow),
                hosts=hosts,
                reduce_dtypes=_reduce_dtypes([p for _, p in spec.params]),
            )
        )
    return shapes


def _reduce_dtypes(params: list[Any]) -> tuple[str | None, ...]:
    """The parameters' reduce dtypes as marked (empty when none is marked)."""
    from slipstream.precision.reduce_dtypes import reduce_dtype_of

    dtypes = tuple(reduce_dtype_of(p) for p in params)
    return dtypes if any(dtypes) else ()


# ---- synthetic and Hugging Face shapes (meta-device modules) ----


def _decoder(
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    vocab: int,
    kv_hidden: int | None = None,
    tied: bool = False,
    bias: bool = True,
    norm_bias: bool = True,
    positions: int = 0,
    gated: bool = False,
) -> Any:
    """A decoder-only transformer on the meta device with Hugging Face's module tree (model.layers.N, lm_head).
    The defaults make the plain GPT-style block: full-width key/value (kv_hidden = hidden), untied embeddings,
    biases everywhere, no learned positions, an ungated MLP."""
    kv_width = hidden if kv_hidden is None else kv_hidden
    import torch
    from torch import nn

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(hidden))
            self.bias = nn.Parameter(torch.empty(hidden)) if norm_bias else None

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
            self.q_proj = nn.Linear(hidden, hidden, bias=bias)
            self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
            self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
            self.o_proj = nn.Linear(hidden, hidden, bias=bias)
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False) if gated else None
            self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
            self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden) if vocab else None
            self.embed_positions = nn.Embedding(positions, hidden) if positions else None
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = Norm()

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(hidden, vocab, bias=False) if vocab else None
            if tied and self.lm_head is not None and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    with torch.device("meta"):
        return Decoder()


def synthetic(
    *, params: float | None, hidden: int | None, layers: int | None, vocab: int | None, heads: int | None
) -> ModelShape:
    """A GPT-style decoder of about `params` parameters. Missing dimensions follow the usual aspect ratio
    (hidden = 128 x layers, MLP 4 x hidden); with `params` given, the MLP width is chosen so the total matches."""
    if params is None and (hidden is None or layers is None):
        raise ValueError("give --params, or both --hidden and --layers (or --model / --hf-config)")
    vocab = vocab or 0
    total = float(params) if params is not None else None
    if hidden is None and layers is None:
        assert total is not None
        layers = max(1, round((total / (12 * 128**2)) ** (1 / 3)))
    if hidden is None:
        assert total is not None and layers is not None
        hidden = max(64, round(math.sqrt(total / (12 * layers)) / 64) * 64)
    if layers is None:
        assert total is not None
        layers = max(1, round((total - 2 * vocab * hidden) / (12 * hidden * hidden)))
    intermediate = 4 * hidden
    if total is not None:
        # per layer: 4h^2 + 2hI weights, 4h + I biases, 4h norm parameters; plus 2 vocab h and a final norm
        per_layer = (total - 2 * vocab * hidden - 2 * hidden) / layers
        intermediate = max(1, round((per_layer - 4 * hidden * hidden - 8 * hidden) / (2 * hidden + 1)))
    module = _decoder(hidden=hidden, layers=layers, intermediate=intermediate, vocab=vocab)
    dims = Dims(hidden=hidden, layers=layers, heads=heads or max(1, hidden // 128), vocab=vocab or None)
    return from_module(module, source=f"synthetic decoder ({layers} x {hidden}, MLP {intermediate})", dims=dims)


def from_hf_config(config: dict[str, object] | str | Path) -> ModelShape:
    """A decoder from a Hugging Face `config.json` (Llama/Mistral/Qwen-style keys, or GPT-2's n_embd/n_layer)."""
    values: dict[str, Any] = config if isinstance(config, dict) else json.loads(Path(config).read_text())

    def get(*names: str, default: object = None) -> Any:
        for name in names:
            if values.get(name) is not None:
                return values[name]
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    if hidden is None or layers is None:
        raise ValueError(
            "--hf-config: the config has no hidden_size/n_embd or num_hidden_layers/n_layer; "
            "pass --params with --hidden and --layers instead"
        )
    hidden, layers = int(hidden), int(layers)
    heads = get("num_attention_heads", "n_head", default=max(1, hidden // 128))
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim", default=hidden // heads)
    gpt2 = get("model_type") == "gpt2" or "n_embd" in values
    intermediate = get("intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden
    vocab = get("vocab_size", default=0)
    gated = (
        not gpt2
        and get("model_type") != "gpt_neox"
        and get("hidden_act", default="silu") in ("silu", "swiglu", "gelu_pytorch_tanh")
    )
    module = _decoder(
        hidden=hidden,
        layers=layers,
        intermediate=intermediate,
        vocab=vocab,
        kv_hidden=kv_heads * head_dim,
        tied=bool(get("tie_word_embeddings", default=gpt2)),
        bias=bool(get("attention_bias", "mlp_bias", default=gpt2)),
        norm_bias=gpt2,
        positions=get("n_positions", default=0) if gpt2 else 0,
        gated=gated,
    )
    return from_module(
        module,
        source=f"hf config ({get('model_type', default='decoder')})",
        dims=Dims(hidden=hidden, layers=layers, heads=heads, vocab=vocab or None),
    )
