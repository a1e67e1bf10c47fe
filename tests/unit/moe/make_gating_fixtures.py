"""Write tests/fixtures/moe_gating/deepspeed_gating.json: real DeepSpeed's `top1gating` / `top2gating` /
`topkgating` on fixed logits, as plain numbers. Runs only where DeepSpeed is installed (the peer environment of
bench/make_peer_venv.sh); Slipstream's tests read the committed file and never import DeepSpeed.

    .bench-venv/bin/python tests/unit/moe/make_gating_fixtures.py [OUT_JSON]

Each case holds the gate's inputs (logits, k, capacity_factor, min_capacity, drop_tokens, use_rts, and the seed
torch.manual_seed was given just before the call: top-1's random token selection draws from it) and DeepSpeed's
outputs: l_aux, the capacity (the combine tensor's last size), exp_counts, and every nonzero of combine_weights
as [token, expert, slot, weight] (dispatch_mask has the same nonzeros; checked here). Noisy gating is off.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "moe_gating" / "deepspeed_gating.json"

# (name, k, tokens, experts, capacity_factor, min_capacity, drop_tokens, use_rts, seed, bias on expert 0)
CASES = [
    ("top1_drop_rts", 1, 40, 4, 0.5, 1, True, True, 5, 1.5),
    ("top1_drop_rts_float32_capacity", 1, 25, 2, 1.2, 1, True, True, 7, 2.0),
    ("top1_fits", 1, 24, 4, 2.0, 4, True, False, 2, 0.0),
    ("top1_drop_first_tokens", 1, 40, 4, 0.5, 1, True, False, 1, 1.5),
    ("top1_dropless", 1, 33, 8, 1.0, 4, False, False, 4, 1.0),
    ("top2_unit_test_logits", 2, 24, 4, 0.5, 1, True, False, 3, 2.0),
    ("top2_drop", 2, 50, 5, 1.0, 4, True, False, 8, 1.0),
    ("top2_float32_capacity", 2, 35, 3, 0.3, 1, True, False, 9, 0.0),
    ("top2_dropless", 2, 30, 6, 1.0, 4, False, False, 10, 1.5),
    ("top3_unit_test_logits", 3, 24, 4, 0.25, 1, True, False, 3, 2.0),
    ("top3_drop", 3, 50, 5, 0.75, 4, True, False, 11, 1.0),
    ("top3_float32_capacity", 3, 50, 6, 0.2, 1, True, False, 12, 0.0),
    ("top3_dropless", 3, 40, 8, 1.0, 4, False, False, 13, 1.0),
    ("top4_float32_capacity", 4, 35, 6, 0.3, 1, True, False, 14, 1.5),
]


def make_logits(tokens: int, experts: int, seed: int, bias: float) -> torch.Tensor:
    """The unit test's recipe at seed 3 (randn * 3, expert 0 favoured); randn * 2 otherwise."""
    scale = 3.0 if seed == 3 else 2.0
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * scale
    logits[:, 0] += bias
    return logits


def run_case(k: int, logits: torch.Tensor, factor: float, minimum: int, drop: bool, rts: bool, seed: int) -> dict:
    from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating

    torch.manual_seed(seed)
    if k == 1:
        out = top1gating(logits.clone(), factor, minimum, drop_tokens=drop, use_rts=rts)
    elif k == 2:
        out = top2gating(logits.clone(), factor, minimum, drop_tokens=drop, top2_2nd_expert_sampling=False)
    else:
        out = topkgating(logits.clone(), k, factor, minimum, drop_tokens=drop)
    l_aux, combine, dispatch, exp_counts = out
    nonzero = combine.nonzero()
    if not torch.equal(nonzero, dispatch.nonzero()):
        raise RuntimeError("DeepSpeed's dispatch_mask and combine_weights have different nonzeros")
    routes = [[*map(int, idx), float(combine[tuple(idx)])] for idx in nonzero.tolist()]
    return {
        "l_aux": float(l_aux),
        "capacity": int(combine.shape[2]),
        "exp_counts": [int(c) for c in exp_counts],
        "routes": routes,
    }


def generate() -> dict:
    import deepspeed

    cases = []
    for name, k, tokens, experts, factor, minimum, drop, rts, seed, bias in CASES:
        logits = make_logits(tokens, experts, seed, bias)
        case = {
            "name": name,
            "k": k,
            "capacity_factor": factor,
            "min_capacity": minimum,
            "drop_tokens": drop,
            "use_rts": rts,
            "seed": seed,
            "logits": logits.tolist(),
        }
        case["deepspeed"] = run_case(k, logits, factor, minimum, drop, rts, seed)
        cases.append(case)
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "cases": cases}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(generate(), indent=1)
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)  # a row a line
    out.write_text(text + "\n")
    print(out)


if __name__ == "__main__":
    main()
