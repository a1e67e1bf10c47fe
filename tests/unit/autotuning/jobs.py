"""The tuner's `Job` for tests: the script's config at `script[2]` (`SCRIPT --deepspeed_config PATH`), one node."""

from __future__ import annotations

from slipstream.autotuning.tuner import Job
from slipstream.config import resolve


def make_job(
    launcher: list[str],
    script: str,
    user: dict[str, object],
    tuning: dict[str, object],
    *,
    world: int,
    budget: int,
    trials: int,
    timeout_s: float,
    session: bool = True,
) -> Job:
    return Job(
        launcher=launcher,
        script=[script, "--deepspeed_config", "ds.json"],
        config_at=2,
        user_config=user,
        plan=resolve({**user, "autotuning": tuning}, world_size=world).autotuning,
        world=world,
        ranks_per_node=world,
        budget=budget,
        host_budget=None,
        max_trials=trials,
        timeout_s=timeout_s,
        session=session,
    )
