"""What machine a benchmark ran on, for the tables that must name it."""

import platform


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
