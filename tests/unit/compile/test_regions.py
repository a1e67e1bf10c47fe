"""slipstream/compile without a process group: which blocks are compiled, the graph breaks charged to each (a
planted break is seen), compiled autograd's refusals, DeepCompile's refusals and the `compile` section's keys."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from slipstream.compile import autograd, engine_compile
from slipstream.compile.graph_breaks import GraphBreakLedger
from slipstream.compile.regions import choose_regions, compile_region, fit_cache_to_regions, torch_compiler
from slipstream.config.plan import CompilePlan
from slipstream.config.resolve import resolve
from tests.harness.models import TinyMLP, TinyTransformer


class Breaking(nn.Module):
    """A block whose forward breaks dynamo's graph on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear(x))
        torch._dynamo.graph_break()
        return x * 2


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 3))
        self.encoder.blocks = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
        self.head = nn.Linear(3, 2)


def test_the_repeated_blocks_are_the_regions() -> None:
    model = TinyTransformer(layers=3)
    assert [name for name, _ in choose_regions(model, {})] == ["layers.0", "layers.1", "layers.2"]
    assert [name for name, _ in choose_regions(Nested(), {})] == ["encoder.blocks.a", "encoder.blocks.b"]
    plain = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    assert choose_regions(plain, {}) == [("<model>", plain)]
    hooked = {plain: "root", plain[0]: "0"}  # stage 3 without blocks: the units' modules, not the root
    assert choose_regions(plain, hooked) == [("0", plain[0])]


def test_a_block_holding_a_hooked_unit_is_refused_by_name() -> None:
    model = TinyMLP()
    inner = model.layers[1]
    container = nn.Module()
    container.blocks = nn.ModuleList([nn.Sequential(inner)])
    with pytest.raises(NotImplementedError, match=r"'blocks.0' holds ZeRO-3 units of its own \(layers.1\)"):
        choose_regions(container, {inner: "layers.1"})


def _run_region(module: nn.Module, ledger: GraphBreakLedger, name: str) -> torch.Tensor:
    torch._dynamo.reset()
    compile_region(name, module, compiler=torch_compiler("eager", {}), ledger=ledger)
    return module(torch.ones(2, 4))


def test_a_planted_graph_break_is_charged_to_its_block() -> None:
    broken, clean = Breaking(), nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    ledger = GraphBreakLedger(["broken", "clean"], rank=0)
    expected = broken.forward(torch.ones(2, 4))
    torch.testing.assert_close(_run_region(broken, ledger, "broken"), expected)
    _run_region(clean, ledger, "clean")
    assert sum(ledger.breaks["broken"].values()) >= 1 and not ledger.breaks["clean"], ledger.breaks
    assert ledger.reported and "broken: 1 x" in ledger.summary(), ledger.summary()
    clean_only = GraphBreakLedger(["clean"], rank=0)
    _run_region(nn.Sequential(nn.Linear(4, 4)), clean_only, "clean")
    assert clean_only.total() == 0 and clean_only.summary().endswith("1 compiled regions, 0 graph breaks")


def test_restore_gives_the_eager_forward_back() -> None:
    block = nn.Linear(4, 4)
    region = compile_region("b", block, compiler=torch_compiler("eager", {}), ledger=GraphBreakLedger(["b"], rank=0))
    assert "forward" in block.__dict__
    region.restore()
    assert "forward" not in block.__dict__


def test_compiled_autograd_is_refused_where_torch_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    with autograd.compiled_backward(None):  # off: nothing entered
        pass
    monkeypatch.setattr(autograd, "compiled_autograd_entry", lambda: None)
    with pytest.raises(NotImplementedError, match=r"compiled_autograd_enabled=True.*has no compiled autograd"):
        autograd.require_compiled_autograd()


def test_deepcompile_schedule_and_stage3_compiled_autograd_are_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="compile.deepcompile is true"):
        engine_compile._refuse_deepcompile(CompilePlan(deepcompile=True), None)
    with pytest.raises(NotImplementedError, match="schedule="):
        engine_compile._refuse_deepcompile(CompilePlan(deepcompile=False), [(0, "z3")])
    engine_compile._refuse_deepcompile(CompilePlan(deepcompile=False), None)
    with pytest.raises(NotImplementedError, match="ZeRO stage 3"):
        engine_compile._refuse_compiled_autograd_at_stage3(object())
    with pytest.warns(UserWarning, match="'backend' in compile_kwargs is ignored"):
        assert engine_compile._torch_options({"backend": "eager", "mode": "default"}) == {"mode": "default"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine_compile._torch_options({"dynamic": False}) == {"dynamic": False}


def test_the_compile_section_reports_each_deepcompile_key() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    plan = resolve(
        {
            **base,
            "compile": {
                "deepcompile": True,
                "free_activation": True,
                "passes": ["z3"],
                "sync_before_reduce": True,
                "double_buffer": False,
            },
        },
        world_size=1,
    )
    assert plan.compile == CompilePlan(deepcompile=True)
    for key in ("deepcompile", "free_activation", "passes", "sync_before_reduce", "double_buffer"):
        assert f"compile.{key}" in plan.unimplemented, (key, plan.unimplemented)
    quiet = resolve({**base, "compile": {"double_buffer": True}}, world_size=1)
    assert quiet.compile == CompilePlan(deepcompile=False) and not any("compile" in k for k in quiet.unimplemented)


@pytest.mark.filterwarnings("ignore:torch._dynamo.config.inline_inbuilt_nn_modules is deprecated")
def test_without_module_inlining_the_cache_holds_every_block() -> None:
    config = torch._dynamo.config
    limits = {"cache_size_limit": 8, "accumulated_cache_size_limit": config.accumulated_cache_size_limit}
    with config.patch(**limits, inline_inbuilt_nn_modules=True):
        assert fit_cache_to_regions(40) is None and config.cache_size_limit == 8  # blocks share one graph
    with config.patch(**limits, inline_inbuilt_nn_modules=False):  # torch 2.4's default
        assert fit_cache_to_regions(40) == 48 and config.cache_size_limit == 48
        assert fit_cache_to_regions(2) == 48  # never lowered


@pytest.mark.parametrize("which", ["slipstream", "torch"])
def test_a_compiled_block_inside_a_checkpoint_trains_or_fails_naming_the_checkpoint(which: str) -> None:
    """A block compiled by engine.compile and called inside a non-reentrant checkpoint (the model's forward
    checkpointing whole blocks): the input gradient equals the eager block's where torch compiles it (2.13), and
    where it cannot (torch 2.4) the error names the block and the checkpoint instead of dynamo's internals."""
    from slipstream import checkpointing

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    block(x).sum().backward()
    expected, x.grad = x.grad.clone(), None
    compile_region(
        "layers.0", block, compiler=torch_compiler("aot_eager", {}), ledger=GraphBreakLedger(["layers.0"], rank=0)
    )
    run = {
        "slipstream": lambda: checkpointing.checkpoint(block, x),
        "torch": lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False),
    }[which]
    try:
        run().sum().backward()
    except RuntimeError as error:
        assert "compiled block layers.0 was called inside an activation checkpoint" in str(error), str(error)[-800:]
        assert torch.__version__ < "2.5", f"torch {torch.__version__} failed to compile a checkpointed block"
        return
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-6)


def test_a_checkpoint_inside_a_compiled_block_traces_on_every_supported_torch() -> None:
    """Slipstream's checkpoint called inside a compiled block: dynamo guards the settings it reads (torch 2.4's
    dynamo failed on the slotted plan: "cannot create weak reference"); the input gradient equals eager's."""
    from slipstream import checkpointing

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + checkpointing.checkpoint(self.mlp, x)

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8, requires_grad=True)
    block(x).sum().backward()
    expected, x.grad = x.grad.clone(), None
    compile_region(
        "layers.0", block, compiler=torch_compiler("aot_eager", {}), ledger=GraphBreakLedger(["layers.0"], rank=0)
    )
    block(x).sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-6)
