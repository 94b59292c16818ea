"""Where a data-parallel server's engines run: addresses by rank, one GPU each, CPU shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.placement import PlacementError, plan, split_cpus, visible_gpus


def test_one_engine_is_left_as_it_is() -> None:
    (only,) = plan(1, "ipc:///tmp/e.sock", "auto", env={}, cpus=[0, 1])
    assert only.address == "ipc:///tmp/e.sock" and only.cpus == () and only.cuda_device is None


def test_ranks_take_the_next_ports_and_a_share_of_the_cores(tmp_path: Path) -> None:
    places = plan(2, "tcp://0.0.0.0:5570", "cpu", env={}, cpus=[0, 1, 2, 3, 4],
                  driver=tmp_path / "none")
    assert [p.address for p in places] == ["tcp://0.0.0.0:5570", "tcp://0.0.0.0:5571"]
    assert [p.cpus for p in places] == [(0, 1), (2, 3, 4)]
    assert all(p.cuda_device is None for p in places)


def test_fewer_cores_than_engines_share_round_the_list() -> None:
    assert split_cpus([3, 5], 3) == [(3,), (5,), (3,)]
    assert split_cpus([0, 1], 2) == [(0,), (1,)]


def test_each_engine_sees_its_own_gpu(tmp_path: Path) -> None:
    places = plan(2, "ipc:///e", "auto", env={"CUDA_VISIBLE_DEVICES": "4,6,7"}, cpus=[0, 1])
    assert [p.cuda_device for p in places] == ["4", "6"]
    assert [p.address for p in places] == ["ipc:///e", "ipc:///e_dp1"]
    driver = tmp_path / "gpus"
    for i in range(3):
        (driver / f"0000:0{i}:00.0").mkdir(parents=True)
    assert visible_gpus({}, driver) == ["0", "1", "2"]


def test_more_engines_than_gpus_is_a_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="needs 4 GPUs"):
        plan(4, "ipc:///e", "cuda", env={"CUDA_VISIBLE_DEVICES": "0,1"}, cpus=[0])
    with pytest.raises(PlacementError, match="--device cpu"):
        plan(4, "ipc:///e", "auto", env={"CUDA_VISIBLE_DEVICES": "0"}, cpus=[0])
    no_gpu = plan(2, "ipc:///e", "auto", env={}, cpus=[0, 1], driver=tmp_path / "none")
    assert [p.cuda_device for p in no_gpu] == [None, None]


def test_event_ports_two_ranks_would_share_are_a_usage_error(capsys) -> None:
    from frontend.cli import main

    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
              '"replay_endpoint": "tcp://*:5558"}')
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--data-parallel-size", "2", "--device", "cpu",
              "--kv-events-config", config])
    assert exc.value.code == 2
    assert "rank 1's endpoint tcp://*:5558 is also rank 0's replay_endpoint" in (
        capsys.readouterr().err)


def test_tensor_parallel_engines_see_adjacent_gpus() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}
    places = plan(2, "ipc:///e", "cuda", env=env, cpus=[0, 1], tensor_parallel=2)
    assert [p.cuda_device for p in places] == ["0,1", "2,3"]
    (only,) = plan(1, "ipc:///e", "cuda", env=env, tensor_parallel=4)
    assert only.cuda_device is None  # one engine keeps the GPUs it sees
    with pytest.raises(PlacementError, match="--data-parallel-size 2 x --tensor-parallel-size 3"
                                             " needs 6 GPUs; 5 visible"):
        plan(2, "ipc:///e", "cuda", env=env, tensor_parallel=3)
    with pytest.raises(PlacementError, match="needs 8 GPUs"):
        plan(1, "ipc:///e", "auto", env=env, tensor_parallel=8)
    assert plan(2, "ipc:///e", "cpu", env=env, cpus=[0, 1], tensor_parallel=2)[1].cuda_device \
        is None
