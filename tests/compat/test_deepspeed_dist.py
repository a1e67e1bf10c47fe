"""How tools discover DeepSpeed: the opt-in `deepspeed` compatibility distribution, installed into a throwaway venv.

The venv sees this environment's torch and slipstream through a .pth file (nothing is reinstalled) and
installs the wheel `slipstream compat install` writes, offline. Then: `importlib.metadata.version("deepspeed")`
is >= 0.9.3, `import deepspeed` and DeepSpeed's module paths give Slipstream's modules, DeepSpeed's scripts
exist, `python -m deepspeed.launcher.runner` runs the launcher, `ds_report` says the package is active; a real
DeepSpeed installed over it replaces it with pip naming ours, and the install then refuses, naming DeepSpeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

PROBE = r"""
import importlib.metadata, importlib.util, json, runpy, sys, torch
version = importlib.metadata.version("deepspeed")
assert importlib.util.find_spec("deepspeed") is not None
import deepspeed, slipstream, slipstream.zero.init
import deepspeed.runtime.zero.partition_parameters as pp
from deepspeed.runtime.zero import partition_parameters as pp2
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.ops.adam import DeepSpeedCPUAdam
swap = lambda fn, dtype: fn
pp.zero_wrapper_for_fp_tensor_constructor = swap   # what Transformers does while it builds a model
try:
    runpy.run_module("deepspeed.launcher.runner", run_name="__main__")
    runner = "exit 0"
except SystemExit as exc:
    runner = exc.code
print(json.dumps({
    "version": version, "dunder": deepspeed.__version__, "minor": deepspeed.__version_minor__,
    "same": [pp is slipstream.zero.init, pp2 is pp, DeepSpeedEngine is slipstream.SlipstreamEngine,
             deepspeed.initialize is slipstream.initialize, deepspeed.comm.get_rank is slipstream.comm.get_rank,
             slipstream.zero.init.zero_wrapper_for_fp_tensor_constructor is swap, logger.name == "slipstream"],
    "lr": VALID_LR_SCHEDULES, "runner": runner, "file": deepspeed.__file__,
}))
"""


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)  # type: ignore[call-overload]


def fake_real_deepspeed(directory: Path) -> Path:
    """A wheel that stands for a real DeepSpeed 0.19.8 (its metadata and import name, nothing else)."""
    path = directory / "deepspeed-0.19.8-py3-none-any.whl"
    info = "deepspeed-0.19.8.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("deepspeed/__init__.py", "REAL = True\n__version__ = '0.19.8'\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_compat_distribution_in_a_throwaway_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)])
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    if run([python, "-m", "pip", "--version"]).returncode != 0:
        pytest.skip("the base interpreter has no pip to install into a venv with")
    if run([python, "-c", "import importlib.metadata as m; m.version('deepspeed')"]).returncode == 0:
        pytest.skip("the base interpreter has a deepspeed installed")
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "slipstream-test-env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}

    installed = run([python, "-m", "slipstream.cli.main", "compat", "install"], env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    probe = run([python, "-c", PROBE], env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    major, minor, patch = (int(x) for x in got["version"].split("+")[0].split("."))
    assert (major, minor, patch) >= (0, 9, 3) and "+slipstream" in got["version"]
    assert got["dunder"] == got["version"] and got["minor"] == minor
    assert all(got["same"]), got["same"]
    assert got["lr"][:2] == ["LRRangeTest", "OneCycle"] and got["runner"] == 2
    assert got["file"].startswith(site)
    scripts = {p.name for p in (venv / "bin").iterdir()}
    expected = {
        "deepspeed",
        "deepspeed.pt",
        "ds",
        "ds_report",
        "dsr",
        "ds_ssh",
        "ds_bench",
        "ds_elastic",
        "ds_io",
        "ds_nvme_tune",
    }
    assert expected <= scripts, expected - scripts
    launcher = run([str(venv / "bin" / "deepspeed"), "--help"], env=env)
    assert launcher.returncode == 0 and "--num_gpus" in launcher.stdout and "user_script" in launcher.stdout
    report = run([str(venv / "bin" / "ds_report"), "--hide_operator_status"], env=env)
    assert report.returncode == 0 and "import deepspeed" in report.stdout and "active" in report.stdout, report.stdout

    # A real DeepSpeed installed over it: pip names ours as it replaces it; then install refuses, naming DeepSpeed.
    real = run([python, "-m", "pip", "install", "--no-deps", "--no-index", str(fake_real_deepspeed(tmp_path))], env=env)
    assert real.returncode == 0 and "deepspeed 0.19.8+slipstream" in real.stdout, real.stdout + real.stderr
    refused = run([python, "-m", "slipstream.cli.main", "compat", "install"], env=env)
    assert refused.returncode == 1 and "DeepSpeed 0.19.8 is installed" in refused.stderr, refused.stderr
    kept = run([python, "-c", "import deepspeed; print(deepspeed.REAL)"], env=env, cwd=tmp_path)
    assert kept.stdout.strip() == "True", kept.stderr


def test_install_needs_slipstream_in_the_target(tmp_path: Path) -> None:
    """A target interpreter without Slipstream is refused before anything is installed there."""
    venv = tmp_path / "bare"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    from slipstream.compat import deepspeed_dist

    assert deepspeed_dist.install(str(venv / "bin" / "python")) == 1
    assert not list(venv.glob("lib/python*/site-packages/deepspeed*"))


def test_two_deepspeed_distributions_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours and a real DeepSpeed both visible (e.g. one in the user site): activating ours warns, naming it."""
    from slipstream.compat import deepspeed_dist

    class Dist:
        def __init__(self, version: str) -> None:
            self.version = version

        def locate_file(self, name: str) -> str:
            return f"/site/{self.version}"

    monkeypatch.setattr(
        deepspeed_dist, "_deepspeed_distributions", lambda: [Dist("0.19.8+slipstream.0.1.0"), Dist("0.18.0")]
    )
    with pytest.warns(UserWarning, match=r"real DeepSpeed \(deepspeed 0.18.0 at /site/0.18.0\)"):
        deepspeed_dist._warn_if_shadowed()
