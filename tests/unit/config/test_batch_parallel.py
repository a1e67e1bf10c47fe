"""The batch triple under tensor and sequence parallelism (config/batch.py `batch_world`): DeepSpeed's config
counts the world over `sequence_parallel_size` only, so TP ranks count as data-parallel ones there. The same
cases go through DeepSpeed 0.19's own `DeepSpeedConfig` in the peer environment (.bench-venv; skipped when
absent), its world size set to the case's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slipstream.config import ConfigError, resolve

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
ROOT = Path(__file__).resolve().parents[3]


def _tp(size: int, **rest: object) -> dict:
    return {"tensor_parallel": {"autotp_size": size}, **rest}


# (config, world size, (train_batch_size, micro, accumulation) or None where refused)
CASES = [
    ({TBS: 8, MICRO: 4, GAS: 1, **_tp(2)}, 2, (8, 4, 1)),  # Transformers' Trainer's fill: micro 4 x world 2
    ({TBS: 8, **_tp(2)}, 2, (8, 4, 1)),
    ({MICRO: 2, **_tp(2)}, 4, (8, 2, 1)),
    ({TBS: 8, MICRO: 2, **_tp(2, sequence_parallel_size=2)}, 4, (8, 2, 2)),  # SP divides, TP does not
    ({TBS: 8, MICRO: 4, **_tp(1, sequence_parallel_size=2)}, 4, (8, 4, 1)),
    ({TBS: 8, MICRO: 4, GAS: 2, **_tp(2)}, 2, None),
    ({TBS: 4, MICRO: 4, GAS: 1, **_tp(2)}, 2, None),  # micro x accumulation x (world / tp): refused
]


def _triple(config: dict, world: int) -> tuple[int, int, int] | None:
    try:
        batch = resolve(config, world_size=world).batch
    except ConfigError:
        return None
    return batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps


@pytest.mark.parametrize("config, world, expected", CASES)
def test_tensor_parallel_ranks_count_in_the_batch_triple(config: dict, world: int, expected: tuple | None) -> None:
    assert _triple(config, world) == expected


def test_the_refusal_names_the_world_the_triple_counts() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size: 4 != .* \* world_size 2 = 8"):
        resolve({TBS: 4, MICRO: 4, GAS: 1, **_tp(2)}, world_size=2)


_PEER = """
import json, sys
from deepspeed.runtime import config as C
out = []
for cfg, world in json.loads(sys.argv[1]):
    C.dist.get_world_size = lambda group=None, world=world: world  # the config reads only these two
    C.dist.get_rank = lambda group=None: 0
    try:
        c = C.DeepSpeedConfig(cfg)
    except AssertionError:
        out.append(None)
        continue
    out.append([int(c.train_batch_size), int(c.train_micro_batch_size_per_gpu), int(c.gradient_accumulation_steps)])
print(json.dumps(out))
"""


def test_deepspeed_takes_the_same_triples() -> None:
    peer = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(ROOT / ".bench-venv/bin/python")
    if not Path(peer).is_file():
        pytest.skip("DeepSpeed peer environment absent (.bench-venv); bash bench/make_peer_venv.sh builds it")
    cases = [[config, world] for config, world, _ in CASES]
    done = subprocess.run(
        [peer, "-c", _PEER, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [None if t is None else tuple(t) for t in json.loads(done.stdout.strip().splitlines()[-1])]
    assert theirs == [expected for _, _, expected in CASES]
    assert theirs == [_triple(config, world) for config, world, _ in CASES]
