"""A stand-in for `python -m slipstream.launcher.runner script.py --deepspeed_config PATH` in the tuner's tests: no
torch, no ranks. The profile request is answered with `device = 1000 x micro batch` bytes per candidate; a trial
of ZeRO stage S behaves as FAKE_TRIALS (JSON: stage -> "fail" | "oom" | "hang" | a throughput) says; FAKE_PROFILE
(JSON) is the model's profile in the answer."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    config = json.loads(Path(argv[argv.index("--deepspeed_config") + 1]).read_text())
    request_path = os.environ.get("SLIPSTREAM_AUTOTUNING_PROFILE")
    if request_path:
        request = json.loads(Path(request_path).read_text())
        answer = {
            name: {"device": 1000 * c["train_micro_batch_size_per_gpu"], "host": 0}
            for name, c in request["candidates"].items()
        }
        profile = json.loads(os.environ.get("FAKE_PROFILE", "null"))
        written = {"candidates": answer, "activations_per_sample": None, "profile": profile}
        Path(request["answer"]).write_text(json.dumps(written))
        return
    behaviour = json.loads(os.environ["FAKE_TRIALS"])[str(config["zero_optimization"]["stage"])]
    if behaviour == "fail":
        raise RuntimeError("fake trial failed")
    if behaviour == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory", flush=True)
        sys.exit(1)
    if behaviour == "hang":
        time.sleep(60)
    metrics = {"throughput": float(behaviour), "latency": 1.0 / float(behaviour)}
    Path(config["autotuning"]["metric_path"]).write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
