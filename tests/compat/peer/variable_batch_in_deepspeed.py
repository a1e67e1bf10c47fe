"""Run in DeepSpeed's environment: DeepSpeed's dynamic-batching packing and LR scaling on the cases of a JSON
file, written to another JSON file.

    python variable_batch_in_deepspeed.py cases.json out.json

cases.json: {"lengths": [...], "packings": [{batch_by_seqlens keyword arguments}, ...],
             "scalings": [[base_batch_size, batch_size, base_lr, method], ...]}
"""

from __future__ import annotations

import json
import sys

from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens, scale_lr


def main(cases_path: str, out_path: str) -> None:
    with open(cases_path) as stream:
        cases = json.load(stream)
    packings = [list(batch_by_seqlens(cases["lengths"], **kwargs)) for kwargs in cases["packings"]]
    scalings = [scale_lr(*args) for args in cases["scalings"]]
    with open(out_path, "w") as stream:
        json.dump({"packings": packings, "scalings": scalings}, stream, default=int)  # numpy ids (filtered case)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
