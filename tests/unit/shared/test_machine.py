"""CPUs a process may use: its affinity, capped by its container's CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

from shared.machine import available_cpus, cgroup_cpu_quota


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_the_quota_caps_the_affinity_and_rounds_up(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == cores  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert available_cpus(tmp_path) == 1  # half a CPU still gets one thread
    (tmp_path / "cpu.max").write_text(f"{(cores + 8) * 100000} 100000\n")
    assert available_cpus(tmp_path) == cores  # a quota above the affinity changes nothing
