"""The engine's DeepSpeed getters, as Transformers and Accelerate call them (reference 1.4 and 1.11).

They read the engine's plan; nothing inside Slipstream calls them.
"""

from __future__ import annotations

from typing import Any


class EngineGetters:
    plan: Any
    lr_scheduler: Any
    basic_optimizer: Any
    loss_scaler: Any
    global_rank: int
    world_size: int
    parallel: Any

    def train_batch_size(self) -> int:
        return self.plan.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (DeepSpeed's rule)."""
        batch = self.plan.batch
        per_step = batch.micro_batch_size * batch.world_size
        if train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size {train_batch_size} is not a multiple of micro batch "
                f"{batch.micro_batch_size} x world size {batch.world_size}"
            )
        self._replace_batch(train_batch_size=train_batch_size, gradient_accumulation_steps=train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        batch = self.plan.batch
        self._replace_batch(
            micro_batch_size=micro_batch_size,
            train_batch_size=micro_batch_size * batch.gradient_accumulation_steps * batch.world_size,
        )

    def _replace_batch(self, **changes: int) -> None:
        import dataclasses

        self.plan = dataclasses.replace(self.plan, batch=dataclasses.replace(self.plan.batch, **changes))

    def get_mom(self) -> list[Any]:
        groups = [] if self.basic_optimizer is None else self.basic_optimizer.param_groups
        return [g.get("betas", g.get("momentum")) for g in groups]

    def get_type(self) -> str:
        return self.plan.precision.param_dtype

    def zero_optimization(self) -> bool:
        return self.plan.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.plan.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.plan.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.plan.zero.stage >= 3

    def zero_offload_optimizer(self) -> bool:
        return self.plan.zero.offload_optimizer.kind != "none"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        stage3 = self.plan.zero.stage3
        return bool(stage3 and stage3.gather_16bit_on_save)

    def fp16_enabled(self) -> bool:
        return self.plan.precision.param_dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.plan.precision.param_dtype == "bf16"

    def gradient_clipping(self) -> float:
        return self.plan.gradient_clipping

    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)

    def steps_per_print(self) -> int | None:
        return self.plan.logging.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.plan.logging.wall_clock_breakdown

    def optimizer_name(self) -> str | None:
        return None if self.plan.optimizer is None else self.plan.optimizer.name

    def scheduler_name(self) -> str | None:
        return None if self.plan.scheduler is None else self.plan.scheduler.name

    def get_data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel replicas (the ranks of one TP or SP group share it)."""
        topology = self.parallel.topology
        return self.global_rank if topology is None else topology.data_index

    def get_data_parallel_world_size(self) -> int:
        """How many data-parallel replicas there are (world size / (TP size x SP size))."""
        topology = self.parallel.topology
        return self.world_size if topology is None else topology.dp
