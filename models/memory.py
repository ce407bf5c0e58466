"""What memory this process has and may get: for sizing the KV cache and checking a load fits."""

from __future__ import annotations

import resource


def available_memory() -> int | None:
    """The memory the OS could give this process now (``MemAvailable`` in /proc/meminfo), in bytes;
    None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
