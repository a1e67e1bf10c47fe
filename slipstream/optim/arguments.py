"""DeepSpeed's optimizer arguments, declared once: one frozen dataclass per optimizer that checks itself, the
Adam family's common fields in a base, and DeepSpeed's positional order as a tuple.

[Note: declared arguments]
LAMB and the 1-bit optimizers share most of DeepSpeed's arguments (lr, betas, eps, ...), each in its own
positional order. Each class declares its fields as a dataclass (defaults, checks and docs in one place) with
`ORDER`, DeepSpeed's order; its `__init__(self, params, [deepspeed,] *args, **kwargs)` is decorated with
`takes(Arguments)`, which gives it DeepSpeed's signature (what `inspect.signature` and the engine's config
checks read), and calls `bind(Arguments, args, kwargs)`, which maps positional values by `ORDER` and raises
TypeError for an unknown or doubled name, as a written-out signature would.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import ClassVar, TypeVar

__all__ = ["AdamFamily", "bind", "takes"]

Declared = TypeVar("Declared", bound="AdamFamily")
Init = TypeVar("Init", bound=Callable[..., None])


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamFamily:
    """The arguments DeepSpeed's Adam-family optimizers share; `problems()` lists what is wrong with them."""

    ORDER: ClassVar[tuple[str, ...]] = ()
    GROUP_KEYS: ClassVar[tuple[str, ...]] = ()
    """The fields that become param-group defaults (the rest are the optimizer's own)."""

    lr: float = 1e-3
    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    eps_inside_sqrt: bool = False
    """eps added inside the square root of the variance (LAMB); accepted and unused by the 1-bit optimizers."""
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"{self.label()}: " + "; ".join(problems))

    @classmethod
    def label(cls) -> str:
        """The optimizer's name in messages: the class's, less 'Arguments'."""
        return cls.__name__.removesuffix("Arguments")

    def own(self) -> dict[str, object]:
        """The optimizer's own arguments: its fields beyond the family's, less the param-group defaults."""
        family = {f.name for f in dataclasses.fields(AdamFamily)}
        names = [f.name for f in dataclasses.fields(self) if f.name not in family and f.name not in self.GROUP_KEYS]
        return {name: getattr(self, name) for name in names}

    def problems(self) -> list[str]:
        out = []
        if self.amsgrad:
            out.append("amsgrad=True is not supported (nor by DeepSpeed); remove optimizer.params.amsgrad")
        lr, eps, betas = self.lr, self.eps, self.betas
        if lr < 0 or eps < 0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            out.append(f"needs lr >= 0, eps >= 0 and betas in [0, 1); got lr={lr}, eps={eps}, betas={betas}")
        return out

    def group_defaults(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.GROUP_KEYS}


def bind(arguments: type[Declared], args: tuple[object, ...], kwargs: dict[str, object]) -> Declared:
    """`arguments` from positional values (in its ORDER) and keywords, as a written-out signature binds them."""
    order = arguments.ORDER
    if len(args) > len(order):
        raise TypeError(f"{arguments.label()} takes at most {len(order)} arguments after the parameters ({order})")
    named = dict(zip(order, args))
    doubled = sorted(set(named) & set(kwargs))
    unknown = sorted(set(kwargs) - set(order))
    if doubled or unknown:
        raise TypeError(
            f"{arguments.label()} got {'unknown' if unknown else 'doubled'} arguments {unknown or doubled}; "
            f"it accepts {list(order)}"
        )
    return arguments(**named, **kwargs)  # type: ignore[arg-type]


def takes(arguments: type[AdamFamily]) -> Callable[[Init], Init]:
    """Give an `__init__(self, params, ..., *args, **kwargs)` the signature its written-out parameters and
    `arguments` (in ORDER, with their defaults and types) make: DeepSpeed's."""

    def decorate(init: Init) -> Init:
        signature = inspect.signature(init)
        leading = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        fields = {f.name: f for f in dataclasses.fields(arguments)}
        declared = [
            inspect.Parameter(
                name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=fields[name].default,
                annotation=fields[name].type,
            )
            for name in arguments.ORDER
        ]
        init.__signature__ = signature.replace(parameters=[*leading, *declared])  # type: ignore[attr-defined]
        init.__annotations__ = {
            **{p.name: p.annotation for p in leading if p.annotation is not inspect.Parameter.empty},
            **{p.name: p.annotation for p in declared},
            "return": "None",
        }
        return init

    return decorate
