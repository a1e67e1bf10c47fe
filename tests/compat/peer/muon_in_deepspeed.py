"""Run in DeepSpeed's environment: three steps of DeepSpeed's MuonWithAuxAdam (its inline AdamW for the 1-D
parameters) on the model and gradients in `inputs.pt`, Newton-Schulz in fp32; write the parameters to `out.pt`.

    python muon_in_deepspeed.py inputs.pt out.pt
"""

from __future__ import annotations

import sys

import torch


def main(inputs: str, out: str) -> None:
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32  # the peer's bf16/fp16 off, for 2e-5
    data = torch.load(inputs)
    params = {name: torch.nn.Parameter(value.clone()) for name, value in data["params"].items()}
    muon = [p for p in params.values() if p.dim() >= 2]
    adam = [p for p in params.values() if p.dim() < 2]
    optimizer = MuonWithAuxAdam([{"params": muon, "use_muon": True, "lr": data["muon_lr"]},
                                 {"params": adam, "use_muon": False, "lr": data["adam_lr"]}])
    for grads in data["grads"]:
        for name, p in params.items():
            p.grad = grads[name].clone()
        optimizer.step()
    torch.save({name: p.detach() for name, p in params.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
