"""How many CPUs this process may really use: the smaller of its CPU affinity and its
container's CPU quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), so thread counts follow
a Kubernetes CPU limit and not the host's core count."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def available_cpus(cgroup: Path = CGROUP) -> int:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    count = affinity or os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return max(1, min(count, math.ceil(quota))) if quota is not None else count


def cgroup_cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None when unlimited/unknown."""
    v2 = _read(cgroup / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else _ratio(quota, period or "100000")
    v1_quota = _read(cgroup / "cpu" / "cpu.cfs_quota_us") or _read(cgroup / "cpu.cfs_quota_us")
    v1_period = _read(cgroup / "cpu" / "cpu.cfs_period_us") or _read(cgroup / "cpu.cfs_period_us")
    if v1_quota is None or v1_period is None or v1_quota.startswith("-"):
        return None
    return _ratio(v1_quota, v1_period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


def available_memory(cgroup: Path = CGROUP, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes this process could still allocate: the smaller of the kernel's MemAvailable and
    what the container's memory limit leaves (cgroup v2); None when neither can be read."""
    found = []
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) * 1024)
    limit, used = _read(cgroup / "memory.max"), _read(cgroup / "memory.current")
    if limit and limit.isdigit() and used and used.isdigit():
        found.append(max(0, int(limit) - int(used)))
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
