"""Loading foreign torch `.pt` pickles (DeepSpeed checkpoints) without letting them run code.

Owns `safe_load` and the allow-list of pickle globals it accepts. Two gates, both before anything is built:

1. A static pass over the pickle opcodes (`pickletools.genops`, which constructs nothing) collects every global
   the pickle would import, `GLOBAL` and `STACK_GLOBAL` alike, and refuses any that is not on `ALLOWED_GLOBALS`
   with `UnsafeCheckpoint` naming `module.attr` and the file.
2. The actual load is `torch.load(..., weights_only=True)`, torch's restricted unpickler, never
   `weights_only=False`. DeepSpeed's own classes are not importable here, so each DeepSpeed global a checkpoint
   needs is registered (via `torch.serialization.safe_globals`) as an inert `DeepSpeedStub` subclass carrying the
   DeepSpeed module path: it records its constructor arguments and pickled state and has no behaviour.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slipstream.checkpoint.deepspeed.subparam import SubparamShape
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError, UnsafeCheckpoint
from slipstream.utils.torch_versions import safe_globals

if TYPE_CHECKING:
    from typing_extensions import Self


class DeepSpeedStub:
    """Inert stand-in for a DeepSpeed class found in a checkpoint.

    `args` are the arguments the pickle passed to the class (an enum's value, e.g. `ZeroStageEnum(3)` gives
    `args == (3,)`); `state` is the attribute dict the pickle restored (e.g. a LossScaler's `cur_scale`).
    """

    deepspeed_path: str = ""

    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: object) -> Self:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state), as pickle's load_build
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, dict) else {"state": state}

    @property
    def value(self) -> Any:
        """The first constructor argument (an enum's value), or None."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<stub {self.deepspeed_path} args={self.args!r} state={self.state!r}>"


def _make_stub(path: str) -> type[DeepSpeedStub]:
    module, _, name = path.rpartition(".")
    stub = type(name, (DeepSpeedStub,), {"__module__": module, "__qualname__": name, "deepspeed_path": path})
    return stub


# The DeepSpeed 0.19 globals its checkpoints contain (found by disassembling the fixtures written by
# tools/make_deepspeed_fixtures.py); DynamicLossScaler is what fp16 with dynamic loss scaling writes instead of
# LossScaler.
DEEPSPEED_STUBS: dict[str, type[DeepSpeedStub]] = {
    path: _make_stub(path)
    for path in (
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.checkpoint.universal_checkpoint.SubparamShape",  # universal files of fused TP parameters
    )
}

_STORAGES = (
    "Float",
    "Double",
    "Half",
    "BFloat16",
    "Long",
    "Int",
    "Short",
    "Char",
    "Byte",
    "Bool",
    "ComplexFloat",
    "ComplexDouble",
)
_DTYPES = sorted(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))

# Everything else a plain tensor / container pickle (torch.save protocol 2) refers to.
TORCH_AND_BUILTIN_GLOBALS: frozenset[str] = frozenset(
    {
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.Size",
        "torch.device",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        *(f"torch.{kind}Storage" for kind in _STORAGES),
        *(f"torch.{dtype}" for dtype in _DTYPES),
        "collections.OrderedDict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.tuple",
        "builtins.list",
        "builtins.dict",
        "builtins.slice",
        "builtins.complex",
        "_codecs.encode",
    }
)

# Slipstream's own record classes that its DeepSpeed-format writers pickle: plain dataclasses (no behaviour on
# construction), built by the restricted unpickler like the stubs.
_OWN_RECORDS: dict[str, type] = {"slipstream.checkpoint.deepspeed.subparam.SubparamShape": SubparamShape}

ALLOWED_GLOBALS: frozenset[str] = TORCH_AND_BUILTIN_GLOBALS | frozenset(DEEPSPEED_STUBS) | frozenset(_OWN_RECORDS)

# Builtins torch's restricted unpickler does not allow by itself; registered next to the stubs.
_EXTRA_SAFE_GLOBALS: list[Any] = [set, frozenset, slice, complex, *_OWN_RECORDS.values()]

_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
)
_MARK = object()
_UNKNOWN = object()
# A torch legacy (non-zip) file is five pickles in a row followed by raw storage bytes.
_LEGACY_NUM_PICKLES = 5


def pickle_globals(data: bytes, *, max_pickles: int = 1) -> list[str]:
    """The `module.attr` of every global the pickle(s) in `data` import, in order, without building anything.

    The opcode stream is simulated only far enough to know which strings `STACK_GLOBAL` consumes; a
    `STACK_GLOBAL` whose operands are not literal strings is reported as `<dynamic>`.
    """
    found: list[str] = []
    stream = io.BytesIO(data)
    for index in range(max_pickles):
        if stream.tell() >= len(data):
            break
        try:
            _scan_one(stream, found)
        except (ValueError, EOFError, IndexError, pickle.UnpicklingError):
            if index == 0:
                raise
            break  # past a legacy file's header pickles: raw storage bytes, which torch reads as data
    return found


def _scan_one(stream: io.BytesIO, found: list[str]) -> None:
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    for op, arg, _pos in pickletools.genops(stream):
        name = op.name
        if name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            found.append(f"{module}.{attr}")
            stack.append(_UNKNOWN)
        elif name == "STACK_GLOBAL":
            operands: list[Any] = [stack.pop() if stack else _UNKNOWN for _ in range(2)]
            attr_name, module_name = operands
            ok = isinstance(module_name, str) and isinstance(attr_name, str)
            found.append(f"{module_name}.{attr_name}" if ok else "<dynamic>")
            stack.append(_UNKNOWN)
        elif name in _STRING_OPS:
            stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else _UNKNOWN
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(str(arg))] = stack[-1] if stack else _UNKNOWN
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(int(str(arg)), _UNKNOWN))
        else:
            _apply_stack_effect(stack, op)


def _apply_stack_effect(stack: list[object], op: pickletools.OpcodeInfo) -> None:
    before = op.stack_before
    if pickletools.markobject in before:
        while stack and stack.pop() is not _MARK:
            pass
        num_pops = before.index(pickletools.markobject)
    else:
        num_pops = len(before)
    del stack[max(0, len(stack) - num_pops) :]
    stack.extend([_UNKNOWN] * len(op.stack_after))


def _pickle_bytes(path: Path) -> tuple[bytes, int]:
    """The bytes torch.load would unpickle from `path`, and how many pickles they hold."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            records = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(records) != 1:
                raise CheckpointCorrupt(
                    f"{path} is a zip file but not a torch.save checkpoint: expected one data.pkl record, found "
                    f"{records}. Re-save it with torch.save, or point at the right file."
                )
            return archive.read(records[0]), 1
    return path.read_bytes(), _LEGACY_NUM_PICKLES


def check_globals(path: str | os.PathLike[str]) -> list[str]:
    """Statically list the globals of the pickle in `path`; raise `UnsafeCheckpoint` if any is not allowed."""
    path = Path(path)
    data, num_pickles = _pickle_bytes(path)
    try:
        names = pickle_globals(data, max_pickles=num_pickles)
    except (ValueError, EOFError, IndexError, pickle.UnpicklingError) as exc:
        raise CheckpointCorrupt(
            f"{path} is not a readable pickle ({exc}); the file is truncated or corrupt, restore it from a good copy."
        ) from exc
    refused = sorted({name for name in names if name not in ALLOWED_GLOBALS})
    if refused:
        raise UnsafeCheckpoint(
            f"refusing to load {path}: its pickle imports {', '.join(refused)}, which the restricted loader "
            "does not allow (it could run code). Only tensors, plain containers and the DeepSpeed globals "
            f"{sorted(DEEPSPEED_STUBS)} are accepted; if you trust this file, convert it with its own tooling "
            "to safetensors first."
        )
    return names


def safe_load(path: str | os.PathLike[str]) -> Any:
    """Load a torch `.pt` file (zip or legacy) onto the CPU with the restricted unpickler.

    DeepSpeed objects come back as `DeepSpeedStub` instances; everything else is tensors and plain containers.
    Raises `UnsafeCheckpoint` (a disallowed global, found before anything is built), `CheckpointCorrupt`
    (unreadable file) or `CheckpointError` (missing file).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {path} does not exist; check the path and that every rank's files were copied."
        )
    check_globals(path)
    with safe_globals([*DEEPSPEED_STUBS.values(), *_EXTRA_SAFE_GLOBALS]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"refusing to load {path}: torch's restricted unpickler rejected it: {exc}") from exc
        except (RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointCorrupt(
                f"{path} could not be read as a torch checkpoint ({exc}); the file is "
                "truncated or corrupt, restore it from a good copy."
            ) from exc
