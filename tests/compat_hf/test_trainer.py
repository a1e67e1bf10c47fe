"""The Transformers `Trainer` on Slipstream, unchanged: 2 gloo ranks on CPU, a tiny GPT-2 built from a
config (no downloads). Each run is checked against the same Trainer run without DeepSpeed in one process (same
global batches, the Trainer's AdamW and linear schedule): the trained weights agree, a resume from a mid-run
checkpoint ends bit-equal to the uninterrupted run, and `from_pretrained` of `save_model`'s output holds the
trained weights. Skips, naming the install command, when transformers or accelerate is absent."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(
    bool(H.missing_packages("transformers", "accelerate")),
    reason=H.missing_packages("transformers", "accelerate") or "",
)

STEPS, SAVE_AT = 4, 2


def _trainer(args: Any, model: Any) -> Any:
    from transformers import Trainer

    return Trainer(model=model, args=args, train_dataset=H.TokenDataset())


def _model(zero3: bool) -> Any:
    """A GPT-2 from its config; at ZeRO-3 through `from_config`, which builds it under zero.Init."""
    if not zero3:
        return H.tiny_gpt2()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(H.tiny_gpt2_config())


def trainer_run(rank: int, world: int, *, out: str, ds: dict, zero3: bool, **extra: Any) -> dict[str, Any]:
    """Train STEPS with a checkpoint at SAVE_AT; resume a new Trainer from it; save_model; reload."""
    H.rank_env(rank, world)
    H.use_slipstream_as_deepspeed()
    H.cpu_partial_state()
    if extra.get("bf16"):
        H.allow_cpu_bf16()
    result: dict[str, Any] = {}
    args = H.training_args(out, world=world, ds=ds, steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, **extra)
    model = _model(zero3)
    if zero3:  # built under zero.Init: this rank holds shards only
        result["sharded_at_build"] = all(getattr(p, "ds_numel", None) is not None for p in model.parameters())
    result["initial"] = H.full_state(model)  # under zero.Init, Transformers initialises in another order
    trainer = _trainer(args, model)
    with _recording_micro_batches(model) as result["micro_batches"]:
        trained = trainer.train()
    result["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e] if trained else []
    engine = trainer.model_wrapped
    result["batch"] = engine.get_batch_info()
    result["trained"] = H.full_state(trainer.model)
    trainer.save_model(os.path.join(out, "final"))

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)  # a second Trainer in this process (a new job would)
    resumed = _trainer(H.training_args(out, world=world, ds=ds, steps=STEPS, **extra), _model(zero3))
    resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}"))
    result["resumed"] = H.full_state(resumed.model)
    return result


@contextlib.contextmanager
def _recording_micro_batches(model: Any) -> Iterator[list[tuple[dict[str, Any], float]]]:
    """Each micro-batch this rank trains on, in order: the model's keyword arguments, and the factor between the
    model's loss and the loss the Trainer hands to the engine's backward (for `bf16_reference`)."""
    import slipstream

    records: list[tuple[dict[str, Any], float]] = []
    last: dict[str, Any] = {}

    def inputs(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        last["kwargs"] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def outputs(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        last["loss"] = float(output.loss.detach())

    backward = slipstream.SlipstreamEngine.backward

    def recording_backward(engine: Any, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        records.append((last["kwargs"], float(loss.detach()) / last["loss"]))
        return backward(engine, loss, *args, **kwargs)

    handles = [model.register_forward_pre_hook(inputs, with_kwargs=True),
               model.register_forward_hook(outputs, with_kwargs=True)]
    slipstream.SlipstreamEngine.backward = recording_backward  # type: ignore[method-assign]
    try:
        yield records
    finally:
        slipstream.SlipstreamEngine.backward = backward  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def bf16_reference(results: list[dict[str, Any]], *, steps: int = STEPS, lr: float = 1e-2,
                   clip: float = 1.0) -> dict[str, torch.Tensor]:
    """The engine's bf16 arithmetic in one process, on the micro-batches each rank recorded: bf16 parameters cast
    from fp32 masters, each rank's micro-batch backwarded on its own (bf16 rounds each one's gradients), their
    fp32 sum averaged over the ranks, clipped by its global norm, torch's AdamW on the masters with the Trainer's
    linear schedule (no warm-up, no weight decay). Returns the bf16 parameters as fp32."""
    model = H.tiny_gpt2()
    model.load_state_dict(results[0]["initial"], strict=False)  # lm_head is tied to wte
    named = list(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in named}
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(list(masters.values()), lr=lr, weight_decay=0.0)
    per_step = len(results[0]["micro_batches"]) // STEPS
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * (STEPS - step) / STEPS
        sums = {n: torch.zeros_like(m) for n, m in masters.items()}
        for result in results:
            for kwargs, factor in result["micro_batches"][step * per_step:(step + 1) * per_step]:
                (model(**kwargs).loss * factor).backward()
                for name, param in named:
                    sums[name] += param.grad.float()
                    param.grad = None
        for name, master in masters.items():
            master.grad = sums[name] / len(results)
        torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        optimizer.step()
        with torch.no_grad():
            for name, param in named:
                param.copy_(masters[name])
    return {n: p.detach().float().clone() for n, p in named}


def reference_run(out: str, initial: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The same training in this process, without DeepSpeed (from `initial` weights when given)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED"):
        os.environ.pop(name, None)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = H.tiny_gpt2()
    if initial is not None:
        model.load_state_dict(initial, strict=False)  # lm_head is tied to wte
    trainer = _trainer(H.training_args(out, world=1, ds=None, steps=STEPS), model)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def reference_in_parent(out: Path, initial: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    H.use_slipstream_as_deepspeed()
    saved = dict(os.environ)
    try:
        return reference_run(str(out), initial)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check(
    results: list[dict[str, Any]],
    reference: dict[str, torch.Tensor],
    out: Path,
    *,
    atol: float | None,
    update_rtol: float | None = None,
) -> None:
    """Trained weights against the reference: elementwise to `atol`, or (bf16) the whole update to `update_rtol`
    of its norm (Adam turns bf16 noise in a near-zero gradient into a full-size step of either sign, so a few
    elements differ by up to the learning rate while the update as a whole agrees)."""
    from transformers import AutoModelForCausalLM

    first = results[0]
    assert first["batch"] == (8, 2, 2), "the engine's (train_batch, micro, accumulation) is not the Trainer's"
    if update_rtol is not None:
        diff = torch.cat([(first["trained"][n] - r).flatten() for n, r in reference.items()]).norm()
        update = torch.cat([(r - first["initial"][n]).flatten() for n, r in reference.items()]).norm()
        assert diff <= update_rtol * update, f"trained weights differ by {diff:.4g}, the update is {update:.4g}"
    for name, ref in reference.items():
        if atol is not None:
            torch.testing.assert_close(first["trained"][name], ref, atol=atol, rtol=0, msg=f"trained {name}")
        assert torch.equal(first["resumed"][name], first["trained"][name]), f"resume is not bit-equal: {name}"
        assert torch.equal(results[1]["trained"][name], first["trained"][name]), f"ranks disagree: {name}"
    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(
            param.detach().float(), first["trained"][name], atol=0, rtol=0, msg=f"from_pretrained {name}"
        )


def test_trainer_zero2_offload_grad_accumulation(tmp_path: Path) -> None:
    """ZeRO-2 + optimizer offload (DeepSpeedCPUAdam, as Accelerate maps AdamW), gradient accumulation 2."""
    results = run_distributed(
        trainer_run, world_size=2, timeout_s=300, out=str(tmp_path), ds=H.ds_config(2, offload=True), zero3=False
    )
    reference = reference_in_parent(tmp_path / "reference")
    _check(results, reference, tmp_path, atol=2e-5)


def test_trainer_zero3_bf16_zero_init(tmp_path: Path) -> None:
    """ZeRO-3 with bf16 parameters, the model built under zero.Init by `from_config`; against a reference that
    rounds as the engine does (`bf16_reference`, on the micro-batches the ranks recorded): the update as a whole
    to 3% of its norm (measured: 0.8%; a run with its last step skipped is off by 7.4%), and no more than 5% of
    the elements off by more than 2**-6 of their size, two to four bf16 steps (measured: 1.6%; with the last step
    skipped: 84%)."""
    results = run_distributed(
        trainer_run, world_size=2, timeout_s=300, out=str(tmp_path), ds=H.ds_config(3, bf16=True), zero3=True, bf16=True
    )
    assert results[0]["sharded_at_build"], "from_config did not build the model under zero.Init"
    reference = bf16_reference(results)
    _check(results, reference, tmp_path, atol=None, update_rtol=0.03)
    trained = results[0]["trained"]
    steps = torch.cat([(2 * torch.finfo(torch.bfloat16).eps * r.abs()).flatten() for r in reference.values()])
    diff = torch.cat([(trained[n] - r).abs().flatten() for n, r in reference.items()])
    share = float((diff > steps).float().mean())
    assert share <= 0.05, f"{share:.1%} of the trained elements differ from the reference by more than 2**-6 of it"
