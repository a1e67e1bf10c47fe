"""Hostfile and --include/--exclude parsing: the world they give and every error path, messages checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.launcher.hostfile import (
    HostfileError,
    decode_world,
    encode_world,
    filter_world,
    limit_world,
    parse_hostfile_text,
    parse_node_spec,
    read_hostfile,
    select_world,
    world_of,
)

HOSTFILE = """
# two workers
worker-0 slots=4   # trailing comment

worker-1 slots=2
"""


def test_hostfile_parses_in_order_with_comments_and_blanks() -> None:
    assert parse_hostfile_text(HOSTFILE, source="hf") == {"worker-0": 4, "worker-1": 2}
    assert list(parse_hostfile_text("b slots=1\na slots=1", source="hf")) == ["b", "a"]


def test_missing_hostfile_means_local(tmp_path: Path) -> None:
    assert read_hostfile(tmp_path / "absent") is None
    path = tmp_path / "hostfile"
    path.write_text("node slots=8\n")
    assert read_hostfile(path) == {"node": 8}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "worker-0 slots=four\n",
            "hf, line 1: bad slots='four' for host 'worker-0'; slots must be a positive integer",
        ),
        ("worker-0 slots=0\n", "hf, line 1: bad slots='0' for host 'worker-0'"),
        ("worker-0 slots=\n", "hf, line 1: bad slots='' for host 'worker-0'"),
        ("# c\nworker-0\n", "hf, line 2: cannot read 'worker-0'; each line must be `HOSTNAME slots=N`"),
        ("worker-0 gpus=4\n", "hf, line 1: cannot read 'worker-0 gpus=4'"),
        ("a slots=1\n\nb slots=1\na slots=2\n", "hf, line 4: duplicate host 'a' (first listed on line 1)"),
        ("# only comments\n\n", "hf: no hosts found"),
    ],
)
def test_hostfile_errors_name_file_line_and_problem(text: str, expected: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text(text, source="hf")
    assert expected in str(info.value)


def test_read_hostfile_error_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("w slots=1\nw slots=1\n")
    with pytest.raises(HostfileError, match=rf"hostfile {path}, line 2: duplicate host 'w'"):
        read_hostfile(path)


def test_node_spec_syntax() -> None:
    assert parse_node_spec("worker-0@worker-1:0,2", flag="-i") == {"worker-0": [], "worker-1": [0, 2]}
    assert parse_node_spec("w:3", flag="-i") == {"w": [3]}
    # a host named twice gets the union of its slots (DeepSpeed merges); a bare name already means all of them
    assert parse_node_spec("w:1@w:0,1@v:2", flag="-i") == {"w": [0, 1], "v": [2]}
    assert parse_node_spec("w@w:1", flag="-i") == {"w": []}
    assert parse_node_spec("w:3@w", flag="-i") == {"w": []}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("@w", "empty host name in ''"),
        (":0", "empty host name in ':0'"),
        ("w:a", "bad slot 'a' for host 'w'"),
        ("w:", "bad slot '' for host 'w'"),
        ("w:0,,1", "bad slot '' for host 'w'"),
    ],
)
def test_node_spec_errors(spec: str, expected: str) -> None:
    with pytest.raises(HostfileError, match="-i") as info:
        parse_node_spec(spec, flag="-i")
    assert expected in str(info.value)


WORLD = world_of({"worker-0": 4, "worker-1": 2, "worker-2": 2})


def test_include_keeps_named_hosts_and_slots_in_hostfile_order() -> None:
    assert filter_world(WORLD, include="worker-1:1@worker-0") == {"worker-0": [0, 1, 2, 3], "worker-1": [1]}


def test_exclude_drops_slots_and_whole_hosts() -> None:
    assert filter_world(WORLD, exclude="worker-0:0,3@worker-2") == {"worker-0": [1, 2], "worker-1": [0, 1]}
    assert filter_world(WORLD, exclude="worker-1:0,1") == {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}


def test_no_filter_is_the_whole_world() -> None:
    assert filter_world(WORLD) == WORLD


def test_select_world_may_be_empty_where_filter_world_refuses() -> None:
    assert select_world(WORLD, exclude="worker-0@worker-1@worker-2") == {}
    assert select_world(WORLD, exclude="worker-1:0,1@worker-2:0") == {"worker-0": [0, 1, 2, 3], "worker-2": [1]}
    assert select_world(WORLD, include="worker-2:1,1@worker-0:3") == {"worker-0": [3], "worker-2": [1]}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"include": "worker-9"},
            "--include 'worker-9': unknown host 'worker-9'; hf lists ['worker-0', 'worker-1', 'worker-2']",
        ),
        ({"exclude": "nope:0"}, "--exclude 'nope:0': unknown host 'nope'"),
        (
            {"include": "worker-1:2"},
            "--include 'worker-1:2': no slot 2 on host 'worker-1'; hf gives it slots [0, 1]",
        ),
        ({"exclude": "worker-0:7"}, "no slot 7 on host 'worker-0'"),
        ({"include": "worker-0", "exclude": "worker-1"}, "were both given; use one of them"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "no slots left after"),
    ],
)
def test_filter_errors(kwargs: dict[str, str], expected: str) -> None:
    with pytest.raises(HostfileError) as info:
        filter_world(WORLD, source="hf", **kwargs)
    assert expected in str(info.value)


def test_limit_world_and_its_errors() -> None:
    assert limit_world(WORLD, num_nodes=2) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}
    assert limit_world(WORLD, num_slots=1) == {"worker-0": [0], "worker-1": [0], "worker-2": [0]}
    with pytest.raises(HostfileError, match=r"--num_nodes 4 asks for more hosts than the 3 available"):
        limit_world(WORLD, num_nodes=4)
    with pytest.raises(HostfileError, match=r"--num_gpus 3 asks for more slots than these hosts have: \{'worker-1': 2"):
        limit_world(WORLD, num_slots=3)


def test_world_round_trips_through_base64() -> None:
    token = encode_world(WORLD)
    assert token.replace("=", "").replace("-", "").replace("_", "").isalnum()
    assert decode_world(token) == WORLD
