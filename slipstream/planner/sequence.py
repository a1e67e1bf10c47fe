"""Long context: activation bytes per rank of each long-context option, and the longest sequence each option
trains at within a memory budget (`slipstream plan --sequence`).

The figures are the peak bytes of the tensors a training step of a Llama-style decoder creates (saved
activations, the backward's transient gradients, the parameters' gradients aside), per token of this rank,
in units of the activation dtype's size (`e`). With `h` hidden, `kv` the key/value width, `I` the MLP width,
`V` the vocabulary, `H` heads, `L` layers, and `t` the tokens of one rank (`seq / ulysses`, rounded up):

- one layer saves `S = 8h + 2kv + m + H + 2` per token for its backward (norm inputs and outputs, q/k/v,
  the attention output and its projection's input, the MLP's `m = 4I` gated or `3I` plain, the attention's
  log-sum-exp per head, the norms' inverse RMS); fused attention (SDPA, flash) keeps no seq x seq scores;
- its backward, recomputed under checkpointing, peaks at `R = S + 2I` (the MLP's gradients beside its
  saved tensors);
- the head and loss peak at `3h + 3V + 1` (the final norm and the head's input, the log-softmax, its gradient
  and the logits' gradient);
- tiled MLP and loss (ALST) keep one slice of at most `h` tokens of the MLP and the logits,
  `min(t, h) x max(6I, 3V)` once (the loss' slice lives in the forward, the MLP's in the backward), and the
  recomputed layer peaks at `23h/2 + H` per token besides;
- activation offload keeps two checkpointed inputs on the device (the one recomputed and the one prefetched)
  instead of all `L`;
- FPDT (chunked attention, `slipstream.sequence.fpdt_attention` with `HostChunks`) keeps q, k, v and the
  log-sum-exp on the host, `h + 2kv + H` per token and layer less than plain; one chunk pair's transients
  stay below the loss' peak and are not counted;
- with Ulysses (`u > 1`) each layer saves one more `h` (plain) and a recomputed layer's backward holds the
  all-to-all buffers, `A = 9h/2` per token more.

| option | bytes per rank |
|---|---|
| plain | `e t (L (S + [u > 1] h) + 3h + 3V + 1)` |
| fpdt | `e t (L (S - h - 2kv - H) + 3h + 3V + 1)` |
| checkpointing | `e t (L h + max(3h + 3V + 1, R + A))` |
| checkpointing + offload | `e t (2h + max(3h + 3V + 1, R + A))` |
| checkpointing + tiled | `e (t (L h + 23h/2 + H + A) + min(t, h) max(6I, 3V))` |
| checkpointing + tiled + offload | `e (t (27h/2 + H + A) + min(t, h) max(6I, 3V))` |

The coefficients were counted on bench/_long_context_model.py's decoder (torch's SDPA, RMSNorm and the
SiLU-gated MLP, fp32) with `slipstream.profiling.live_tensors`; tests/unit/planner/test_sequence.py keeps
them within 5% of the counted bytes at two sequence lengths on one rank; the Ulysses terms were counted on
two gloo ranks (bench/long_context.py's two-rank rows check them). Allocator rounding is not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from slipstream.planner.shapes import ModelShape

__all__ = [
    "OPTIONS",
    "SeqDims",
    "SequenceRow",
    "activation_bytes",
    "format_sequence_rows",
    "longest_sequence",
    "seq_dims",
    "sequence_rows",
]

OPTIONS = (
    "plain",
    "fpdt",
    "checkpointing",
    "checkpointing+offload",
    "checkpointing+tiled",
    "checkpointing+tiled+offload",
)
"""The options, from the most memory to the least (each row's `flags` says which features it turns on)."""

_SEARCH_LIMIT = 1 << 40  # tokens: a model whose activations never reach the budget answers this


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SeqDims:
    """The dimensions the activation bytes depend on."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    intermediate: int
    kv_hidden: int
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "intermediate", "kv_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"SeqDims.{name} must be >= 1, got {getattr(self, name)}: give the model's {name}")
        if self.vocab < 0:
            raise ValueError(f"SeqDims.vocab must be >= 0, got {self.vocab}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SequenceRow:
    """One option: its activation bytes per rank at the sequence asked (None without one) and the longest
    sequence it trains at within the budget (None without a budget; 0 when even one token does not fit)."""

    option: str
    ulysses: int
    activations: int | None
    longest: int | None


def _per_token(dims: SeqDims) -> tuple[int, int, int]:
    """(S: one layer's saved elements, R: one layer's recomputed backward peak, the head and loss peak)."""
    h, mlp = dims.hidden, (4 if dims.gated else 3) * dims.intermediate
    saved = 8 * h + 2 * dims.kv_hidden + mlp + dims.heads + 2
    return saved, saved + 2 * dims.intermediate, 3 * h + 3 * dims.vocab + 1


def activation_bytes(dims: SeqDims, option: str, *, seq: int, dtype_bytes: int, ulysses: int = 1) -> int:
    """Peak activation bytes per rank of `option` (one of `OPTIONS`) at `seq` tokens split over `ulysses` ranks."""
    if option not in OPTIONS:
        raise ValueError(f"sequence option {option!r} is not one of {', '.join(OPTIONS)}")
    if seq < 0 or ulysses < 1:
        raise ValueError(f"activation_bytes: seq must be >= 0 and ulysses >= 1, got seq={seq}, ulysses={ulysses}")
    t = math.ceil(seq / ulysses)
    h = dims.hidden
    saved, recompute, head = _per_token(dims)
    kept = 2 * h if "offload" in option else dims.layers * h  # checkpointed inputs on the device
    swaps = 9 * h // 2 if ulysses > 1 else 0  # Ulysses' all-to-all buffers in a recomputed layer's backward
    if option == "plain":
        elements = t * (dims.layers * (saved + (h if ulysses > 1 else 0)) + head)
    elif option == "fpdt":  # q, k, v and the log-sum-exp wait on the host
        elements = t * (dims.layers * (saved - h - 2 * dims.kv_hidden - dims.heads) + head)
    elif "tiled" in option:
        tile = min(t, h) * max(6 * dims.intermediate, 3 * dims.vocab)
        elements = t * (kept + 23 * h // 2 + dims.heads + swaps) + tile
    else:
        elements = t * (kept + max(head, recompute + swaps))
    return elements * dtype_bytes


def longest_sequence(fits: Callable[[int], bool], *, step: int = 1) -> int:
    """The largest multiple of `step` for which `fits` holds, `fits` being monotone (true up to some length):
    doubling, then bisection. 0 when `step` tokens do not fit."""
    if step < 1:
        raise ValueError(f"longest_sequence: step must be >= 1, got {step}")
    if not fits(step):
        return 0
    low, high = 1, 2  # in units of step: low fits, high is unknown until tried
    while fits(high * step):
        low, high = high, high * 2
        if high * step > _SEARCH_LIMIT:
            return low * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


def sequence_rows(
    dims: SeqDims,
    *,
    seq: int | None,
    dtype_bytes: int,
    ulysses: int = 1,
    budget: int | None = None,
    fixed_bytes: int = 0,
) -> list[SequenceRow]:
    """Every option's bytes at `seq` and its longest sequence with `fixed_bytes` (model states) plus the
    activations within `budget` (per rank); sequences are multiples of `ulysses`."""
    rows = []
    for option in OPTIONS:

        def fits(length: int, option: str = option) -> bool:
            used = fixed_bytes + activation_bytes(dims, option, seq=length, dtype_bytes=dtype_bytes, ulysses=ulysses)
            return budget is not None and used <= budget

        at_seq = (
            None if seq is None else activation_bytes(dims, option, seq=seq, dtype_bytes=dtype_bytes, ulysses=ulysses)
        )
        longest = None if budget is None else longest_sequence(fits, step=ulysses)
        rows.append(SequenceRow(option=option, ulysses=ulysses, activations=at_seq, longest=longest))
    return rows


def seq_dims(shape: ModelShape, *, intermediate: int | None = None) -> SeqDims:
    """The dimensions of a planner model: hidden, layers, heads and vocab from its `Dims`; the MLP width, the
    key/value width and whether the MLP is gated from its first layer's projections (Hugging Face names:
    `up_proj`/`gate_proj`/`k_proj`, GPT-2's `c_fc`), else 4 x hidden, hidden and gated."""
    dims = shape.dims
    missing = [name for name in ("hidden", "layers", "heads") if not getattr(dims, name)]
    if missing:
        raise ValueError(
            f"slipstream plan --sequence: the model's {', '.join(missing)} are unknown; give "
            f"{' '.join('--' + m for m in missing)}"
        )
    assert dims.hidden and dims.layers and dims.heads
    found: dict[str, tuple[int, ...]] = {}
    for name, param in getattr(shape.module, "named_parameters", lambda: iter(()))():
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if name.endswith(".weight") and leaf in ("up_proj", "gate_proj", "k_proj", "c_fc") and leaf not in found:
            found[leaf] = tuple(getattr(param, "ds_shape", None) or param.shape)
    width = found.get("up_proj", found.get("c_fc", (4 * dims.hidden,)))
    return SeqDims(
        hidden=dims.hidden,
        layers=dims.layers,
        heads=dims.heads,
        vocab=dims.vocab or 0,
        intermediate=intermediate or (width[0] if "up_proj" in found else width[-1]),
        kv_hidden=found["k_proj"][0] if "k_proj" in found else dims.hidden,
        gated="gate_proj" in found or not found,
    )


def format_sequence_rows(rows: list[SequenceRow], *, seq: int | None, budget: int | None, fixed_bytes: int) -> str:
    """The table `slipstream plan --sequence` prints."""
    lines = []
    if budget is not None:
        lines.append(f"budget per rank {budget / 2**30:.2f} GiB, of which model states {fixed_bytes / 2**30:.2f} GiB")
    at = f"at seq {seq:,}" if seq is not None else ""
    lines.append(f"{'option':30} {'ulysses':>7} {('GiB ' + at).strip():>22} {'longest seq':>14}")
    for row in rows:
        gib = "-" if row.activations is None else f"{row.activations / 2**30:.3f}"
        longest = "-" if row.longest is None else f"{row.longest:,}"
        lines.append(f"{row.option:30} {row.ulysses:>7} {gib:>22} {longest:>14}")
    return "\n".join(lines)
