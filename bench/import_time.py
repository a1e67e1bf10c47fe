"""How much `import slipstream` costs beyond `import torch`, measured in fresh interpreters.

    python bench/import_time.py [--repeats 7]

Each sample is a new Python process that imports torch, then slipstream, and reports both wall times;
the figure is the median of the slipstream part. The target is under 0.5 s (docs/design.md P17).
It also times `import slipstream` followed by `slipstream.get_accelerator()`, which is what a training
script pays before its first step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import slipstream
t2 = time.perf_counter()
slipstream.get_accelerator()
t3 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "slipstream": t2 - t1, "accelerator": t3 - t2}))
"""


def sample() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    samples = [sample() for _ in range(args.repeats)]
    med = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    print(f"import torch:                       {med['torch'] * 1000:8.1f} ms (median of {args.repeats})")
    print(f"import slipstream (after torch):    {med['slipstream'] * 1000:8.1f} ms")
    print(f"get_accelerator() (first call):     {med['accelerator'] * 1000:8.1f} ms")
    target = 0.5
    verdict = "OK" if med["slipstream"] < target else "OVER TARGET"
    print(f"slipstream / target ({target * 1000:.0f} ms):       {med['slipstream'] / target:8.3f}x  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
