"""Build metadata: version, git hash, ops built ahead of time, accelerator and torch the wheel was built with.

`setup.py` writes `git_version_info_installed.py` at build time. A source or editable checkout without
that file still imports: it reports the version from `version.txt`, no installed ops (every op is then
compiled just in time or falls back), and `mode == "jit"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from slipstream.git_version_info_installed import (  # type: ignore[import-not-found]
        accelerator_name,
        git_branch,
        git_hash,
        installed_ops,
        torch_info,
        version,
    )

    mode = "installed"
except ImportError:
    _version_file = Path(__file__).resolve().parent.parent / "version.txt"
    version = _version_file.read_text().strip() if _version_file.is_file() else "0.0.0"
    git_hash = "unknown"
    git_branch = "unknown"
    installed_ops: dict[str, bool] = {}  # type: ignore[no-redef]
    accelerator_name = "unknown"
    torch_info: dict[str, Any] = {  # type: ignore[no-redef]
        "version": "0.0",
        "bf16_support": False,
        "cuda_version": "0.0",
        "nccl_version": "0.0",
        "hip_version": "0.0",
    }
    mode = "jit"

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info", "mode"]
