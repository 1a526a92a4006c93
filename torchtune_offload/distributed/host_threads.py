"""How many CPU threads each rank of a node gets."""

import os

import torch


def host_threads_per_rank() -> int:
    """CPU cores this process may use, split evenly among the ranks of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_ranks))


def set_host_threads() -> int:
    """Sets torch's intra-op threads to :func:`host_threads_per_rank`; returns the number."""
    n = host_threads_per_rank()
    torch.set_num_threads(n)
    return n
