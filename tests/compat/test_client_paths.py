"""Every DeepSpeed path and name of tests/compat/client_paths.py imports through `import deepspeed` (the
compat distribution's file, from tests/compat_hf/shim) and either works or raises NotBuiltError naming the
missing feature; the names built for them here behave as DeepSpeed's do. With the DeepSpeed peer
(.bench-venv), every listed path is checked to be a module of DeepSpeed 0.19 and the constants to be its."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compat.client_paths import CLIENT_PATHS, NOT_BUILT

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "compat_hf" / "shim"

_CHECK = r"""
import importlib, json, sys
import deepspeed
from tests.compat.client_paths import CLIENT_PATHS, NOT_BUILT
from slipstream.compat.unbuilt import NotBuiltError

assert getattr(deepspeed, "__slipstream__", False), deepspeed.__file__
problems = []
for path, names in CLIENT_PATHS.items():
    try:
        module = importlib.import_module(path)
    except Exception as exc:
        problems.append(f"import {path}: {type(exc).__name__}: {exc}")
        continue
    for name in names:
        where = f"{path}.{name}"
        try:
            obj = getattr(module, name)
        except AttributeError as exc:
            problems.append(f"{where}: missing ({exc})")
            continue
        placeholder = getattr(obj, "__module__", "") == "slipstream.compat.unbuilt"
        if where not in NOT_BUILT:
            if placeholder:
                problems.append(f"{where}: a NotBuiltError placeholder, listed as working")
            continue
        try:
            obj()
        except NotBuiltError as exc:
            if not isinstance(exc, NotImplementedError) or "not built in Slipstream" not in str(exc):
                problems.append(f"{where}: unexpected message {exc}")
        except Exception as exc:
            problems.append(f"{where}: raised {type(exc).__name__}: {exc}, not NotBuiltError")
        else:
            problems.append(f"{where}: listed as not built, but calling it worked")
print(json.dumps(problems))
"""


def _run_as_deepspeed(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_every_client_path_imports_and_each_name_works_or_is_named_not_built() -> None:
    done = _run_as_deepspeed(_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    problems = json.loads(done.stdout.strip().splitlines()[-1])
    assert problems == [], "\n".join(problems)


def test_the_list_covers_what_clients_import() -> None:
    """Removing a path from the list must be deliberate: these are the ones real clients were seen to use."""
    for path in (
        "deepspeed.utils.logging",  # Lightning sets logger's level
        "deepspeed.utils.timer",  # Megatron-DeepSpeed: SynchronizedWallClockTimer
        "deepspeed.runtime.constants",
        "deepspeed.utils.z3_leaf_module",  # Transformers' MoE models
        "deepspeed.launcher.runner",  # accelerate launch
        "deepspeed.runtime.sequence_parallel.ulysses_sp",  # Transformers / Accelerate ALST
    ):
        assert path in CLIENT_PATHS, path
    assert len(CLIENT_PATHS) >= 75 and all(name.rpartition(".")[0] in CLIENT_PATHS for name in NOT_BUILT)


def test_autotuning_from_the_bare_runner_points_to_slipstream_run() -> None:
    from slipstream.launcher import runner

    with pytest.raises(ValueError, match=r"--autotuning run: .*`slipstream run --autotuning run"):
        runner.main(["--autotuning", "run", "train.py"])
    assert runner.run(runner.parse_args(["--autotuning", "tune", "train.py"])) == 2


def test_names_built_for_clients_behave_as_deepspeeds() -> None:
    from slipstream.runtime.constants import GRADIENT_CLIPPING, TRAIN_BATCH_SIZE
    from slipstream.runtime.zero.linear import zero3_linear_wrap
    from slipstream.utils.init_on_device import OnDevice
    from slipstream.utils.timer import NoopTimer, SynchronizedWallClockTimer
    from slipstream.utils.z3_leaf_module import set_z3_leaf_modules, z3_leaf_module

    from slipstream.compat.runtime_utils import logger
    from slipstream.utils.logging import logger as ds_logger

    assert ds_logger is logger and (TRAIN_BATCH_SIZE, GRADIENT_CLIPPING) == ("train_batch_size", "gradient_clipping")
    x, w, b = (torch.randn(3, 4, 5, requires_grad=True), torch.randn(6, 5, requires_grad=True), torch.randn(6))
    b.requires_grad_()
    zero3_linear_wrap(x, w, b).square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    torch.nn.functional.linear(x, w, b).square().sum().backward()
    for got, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(got, t.grad)
    with OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    set_z3_leaf_modules(model, [torch.nn.Linear])
    assert z3_leaf_module(model[0]) and not z3_leaf_module(model[1])
    import slipstream.utils  # the submodule import set the module on the package: it answers as the function

    assert slipstream.utils.z3_leaf_module(model[0]) and not slipstream.utils.z3_leaf_module(model[1])
    timers = SynchronizedWallClockTimer()
    timers("fwd").start()
    timers("fwd").stop()
    assert timers("fwd").elapsed(reset=False) > 0 and timers.get_mean(["fwd"])["fwd"] > 0
    assert timers("fwd").elapsed() == 0.0  # get_mean reset it
    with pytest.raises(RuntimeError, match="'fwd' is not running"):
        timers("fwd").stop()
    NoopTimer()("x").start()


def _peer_python() -> str | None:
    candidate = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(ROOT / ".bench-venv/bin/python")
    return candidate if Path(candidate).is_file() else None


def test_paths_and_constants_are_deepspeeds() -> None:
    """Peer: each listed path is a module of DeepSpeed 0.19 and runtime.constants match DeepSpeed's values."""
    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer (.bench-venv) absent; bench/make_peer_venv.sh builds it")
    code = (
        "import importlib.util, json, sys\n"
        "paths = json.loads(sys.argv[1])\n"
        "missing = [p for p in paths if importlib.util.find_spec(p) is None]\n"
        "import deepspeed.runtime.constants as c\n"
        "print(json.dumps([missing, {k: v for k, v in vars(c).items() if k.isupper() and k[0] != '_'}], default=repr))"
    )
    done = subprocess.run(
        [peer, "-c", code, json.dumps(list(CLIENT_PATHS))], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    missing, theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert missing == []
    import slipstream.compat.runtime_constants as ours

    mine = {k: v for k, v in vars(ours).items() if k.isupper()}
    assert mine and all(theirs.get(k, "<absent>") == v for k, v in mine.items()), {
        k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v
    }
