"""Several ``tune run`` command lines in one Python process, through torchtune's own CLI entry point.

Usage: python -m tests.recipe.tune_run_batch COMMANDS_JSON RESULTS_JSONL

COMMANDS_JSON holds a list of argument lists (what follows ``tune`` on a command line). For each, in
order, one line of RESULTS_JSONL receives ``{"returncode": int, "output": str}`` as soon as it ends:
the exit status ``tune`` would have given (1 for an uncaught exception, as Python's) and what it
printed, its traceback and its log lines included. A caller that finds fewer lines than commands
knows the batch died in the first command without one.

A single-device ``tune run`` executes the recipe in the CLI's own process (``runpy``), so one
command after another here is what separate ``tune run`` processes do, with the imports of torch
and torchtune paid once (most of a refused run's time). What a process does only once differs:
a warning shown once is shown for the first command only, and a module's import-time work (a
logging handler made at import, say) happens once; the handlers that write to the process's
stdout or stderr are pointed at each command's output while it runs.
"""

import contextlib
import io
import json
import logging
import sys
import traceback
from typing import Dict, Iterator, List, Union

from torchtune._cli.tune import main as tune_main


@contextlib.contextmanager
def _logging_into(stream: io.StringIO) -> Iterator[None]:
    """Logging handlers that write to the real stdout or stderr write to ``stream`` meanwhile."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
    moved = [(h, h.stream) for lg in loggers for h in lg.handlers
             if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stdout__, sys.__stderr__)]
    for handler, _ in moved:
        handler.setStream(stream)
    try:
        yield
    finally:
        for handler, original in moved:
            handler.setStream(original)


def run(argv: List[str]) -> Dict[str, Union[int, str]]:
    """``tune *argv`` in this process: its exit status and its output."""
    output = io.StringIO()
    saved_argv = sys.argv
    sys.argv = ["tune", *argv]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), _logging_into(output):
            try:
                tune_main()
                code = 0
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = (exit_.code or 0) & 0xFF  # what a process's exit status keeps
                else:  # sys.exit("message"): printed, status 1, as the interpreter does
                    print(exit_.code, file=sys.stderr)
                    code = 1
            except KeyboardInterrupt:
                raise
            except BaseException:  # what the interpreter prints for an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
    return {"returncode": code, "output": output.getvalue()}


def main() -> None:
    commands_path, results_path = sys.argv[1:3]
    with open(commands_path) as f:
        commands = json.load(f)
    with open(results_path, "w") as results:
        for argv in commands:
            results.write(json.dumps(run(argv)) + "\n")
            results.flush()


if __name__ == "__main__":
    main()
