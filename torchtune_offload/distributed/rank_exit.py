"""How a rank's process ends after a finished run: without the interpreter's finalization.

``dist.destroy_process_group`` does not end a gloo group's threads while anything still holds the
group, and after FSDP2 something does. Measured on torch 2.13: in a two-layer FSDP2 toy, DTensor's
sharding caches hold the device mesh, which holds the group; in the distributed recipe, after
``destroy_process_group``, ``gc.collect`` and clearing those caches, each rank still runs
``gloo_tcp_loop`` and two ``pt_gloo_runloop`` threads (what else holds the group was not found).
Those threads are then alive while Python finalizes. CI saw a rank abort twice right after a
finished, saved run ("terminate called without an active exception", SIGABRT; two gloo ranks), and
the launcher then reported the run as failed. The likely way, which PyTorch's abandoned pull
request 179291 describes for gloo: a gloo thread that releases a finished collective's tensors
must take the GIL, and a thread that asks for the GIL while Python finalizes is ended inside a C++
destructor. Not reproduced here (30 runs under load, none aborted).

So after a finished run, with every file written and closed, a rank flushes what it printed and
leaves with :func:`os._exit`: no finalization, no thread asks for the GIL, and the exit status is
the run's. A run that fails still raises as before. Where ``tune run`` runs the recipe in its own
process (no ``--nproc_per_node``), that process is the one that leaves: the launcher has nothing
left to do after the recipe either.
"""

import ctypes
import logging
import os
import sys


def exit_without_finalizing(code: int = 0) -> None:
    """Flushes logging and the standard streams, then ends the process at once with ``code``.

    Call it only after the run's own clean-up (checkpoints written, loggers closed, process group
    destroyed): ``atexit`` handlers and the interpreter's finalization do not run.

    Args:
        code: the process's exit status.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader is gone: nothing to keep
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # what C and C++ libraries printed through stdio
    except (OSError, AttributeError):  # no C library to load here: nothing buffered by it either
        pass
    os._exit(code)
