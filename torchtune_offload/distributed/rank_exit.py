"""How a rank's process ends after a finished run: without the interpreter's finalization.

``dist.destroy_process_group`` does not end a gloo group's threads while anything still holds the
group, and after FSDP2 something always does (the device mesh, reached from torch's DTensor caches;
measured on torch 2.13: after ``destroy_process_group``, ``gc.collect`` and clearing DTensor's
sharding caches, a rank of the distributed recipe still runs ``gloo_tcp_loop`` and two
``pt_gloo_runloop`` threads). Those threads are then alive while Python finalizes. A gloo thread
that releases a finished collective's tensors at that moment must take the GIL, and a thread that
asks for the GIL during finalization is ended inside a C++ destructor: ``std::terminate``,
"terminate called without an active exception", SIGABRT. CI saw a rank abort so twice after a
finished, saved run (torch 2.13, two gloo ranks), and the launcher then reported the run as failed.

So after a finished run, with every file written and closed, a rank flushes what it printed and
leaves with :func:`os._exit`: no finalization, no thread asks for the GIL, and the exit status is
the run's. A run that fails still raises as before.
"""

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
    os._exit(code)
