"""DeepSpeed's ZeRO and checkpoint helper names that its own unit tests import, at their DeepSpeed paths
(through compat/aliases.py): checkpoint file names, zero_to_fp32's file listing, the partition helpers of
`runtime.utils`, the expert-group rank lists, `MultipleAllGatherHandles` and `partitioned_param_data_shape`,
the leaf-module config module, and `param.all_gather_coalesced` at world size 1. One process."""

from __future__ import annotations

import os

import pytest
import torch


def test_checkpoint_file_names_are_deepspeeds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from slipstream.checkpoint.utils import (
        get_layer_ckpt_name_for_rank,
        get_model_ckpt_name_for_rank,
        get_zero_ckpt_name_for_rank,
    )

    assert get_model_ckpt_name_for_rank("ckpt/global_step3", "00") == os.path.join(
        "ckpt/global_step3", "mp_rank_00_model_states.pt"
    )
    assert get_zero_ckpt_name_for_rank("d", 3, 1) == os.path.join("d", "zero_pp_rank_3_mp_rank_01_optim_states.pt")
    assert get_layer_ckpt_name_for_rank("d", "layer_05", 2) == os.path.join("d", "layer_05-model_02_model_states.pt")


def test_optim_files_are_listed_in_rank_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from slipstream.utils.zero_to_fp32 import get_model_state_files, get_optim_files

    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (10, 2, 1, 0)]
    for name in [*names, "mp_rank_00_model_states.pt", "notes.txt"]:
        (tmp_path / name).write_text("x")
    expected = [str(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1, 2, 10)]
    assert get_optim_files(tmp_path) == expected  # 10 after 2: numbers compare as numbers
    assert get_model_state_files(str(tmp_path)) == [str(tmp_path / "mp_rank_00_model_states.pt")]
    (tmp_path / "native").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*_optim_states.pt file .* manifest.json"):
        get_optim_files(tmp_path / "native")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        get_optim_files(tmp_path / "missing")


def test_partition_helpers_of_runtime_utils() -> None:
    from slipstream.runtime.utils import PartitionedTensor, partition_balanced, partition_uniform, prefix_sum_inc

    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]  # every part weighs 3
    assert partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    # the heaviest part is as light as possible (2), and then the lightest as heavy as possible (1, not 0)
    assert partition_balanced([1, 1, 1, 1, 0, 1], 4) == [0, 2, 3, 5, 6]
    assert partition_balanced([1, 1, 8, 1, 1], 2) == [0, 3, 5]  # ties keep the earlier parts full
    with pytest.raises(NotImplementedError, match="PartitionedTensor"):
        PartitionedTensor(torch.zeros(4), None)


def test_expert_parallel_rank_lists_with_tensor_and_pipeline_parallelism() -> None:
    from slipstream.utils.groups import _get_expert_parallel_ranks

    # 16 ranks, tensor parallel 2: data-parallel groups are the even and the odd ranks
    ep, edp = _get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    # no tensor parallelism: the layout of slipstream/moe/groups.py [Note: expert groups]
    assert _get_expert_parallel_ranks(8, 1, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    # two pipeline stages of 4 ranks: groups never cross a stage
    assert _get_expert_parallel_ranks(8, 1, 2, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    with pytest.raises(ValueError, match="expert parallel size 3 does not divide the data-parallel size 8"):
        _get_expert_parallel_ranks(8, 1, 3)
    # data before expert: every (data / ep)-th rank shares an expert-parallel group
    assert _get_expert_parallel_ranks(8, 1, 2, use_data_before_expert_parallel_=True) == (
        [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_multiple_all_gather_handles_pass_the_dependency_by_keyword() -> None:
    from slipstream.runtime.zero.partition_parameters import MultipleAllGatherHandles, partitioned_param_data_shape

    class KeywordOnly:
        seen: object = None

        def wait(self, *, handle_dependency: bool = True) -> None:
            self.seen = handle_dependency

    handles = [KeywordOnly(), KeywordOnly()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [False, False]
    MultipleAllGatherHandles(handles).wait()
    assert [h.seen for h in handles] == [True, True]
    assert partitioned_param_data_shape == [0]


def test_leaf_module_config_module() -> None:
    from slipstream.runtime.zero.config import DeepSpeedZeroConfig
    from slipstream.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES, DeepSpeedZeroLeafModuleConfig

    assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    assert any(c.endswith("MixtralSparseMoeBlock") for c in DEFAULT_LEAF_MODULE_CLASSES)
    assert DeepSpeedZeroLeafModuleConfig(names="layers.0").names == ["layers.0"]


def test_all_gather_coalesced_gathers_until_partition() -> None:
    import slipstream
    from slipstream.zero import GatheredParameters, ZeroParamStatus

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 5)
    with slipstream.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 5)
    params = [model.weight, model.bias]
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    model.weight.all_gather_coalesced(params).wait()
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
    assert torch.equal(model.weight.data, reference.weight) and torch.equal(model.bias.data, reference.bias)
    for param in params:
        param.partition()
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    with GatheredParameters(params):  # still the same values after the round trip
        assert torch.equal(model.weight, reference.weight)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)
        self.head.weight = self.embed.weight  # tied: one parameter, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_state_dict_gives_a_tied_parameter_every_name(tmp_path, stage: int) -> None:  # type: ignore[no-untyped-def]
    from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import slipstream
    from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = slipstream.initialize(model=Tied(), config=config)
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="t")
    assert set(state) == {"embed.weight", "embed.bias", "head.weight", "head.bias"}
    assert state["head.weight"] is state["embed.weight"]  # one tensor under both names, as DeepSpeed gives it
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    with CheckpointReader(resolve_checkpoint_dir(tmp_path, "t")) as reader:  # stored once
        assert "module/head.weight" not in reader.manifest.tensors
        assert reader.manifest.scalars["shared_params"] == {"head.weight": "embed.weight"}
    full = engine.zero_model.full_state() if stage == 3 else dict(engine.module.named_parameters())
    torch.testing.assert_close(state["embed.weight"], full["embed.weight"].detach().float())
    engine.destroy()
