"""Several ``tune run`` command lines in one Python process, through torchtune's own CLI entry point.

Usage: python -m tests.recipe.tune_run_batch COMMANDS_JSON RESULTS_JSON

COMMANDS_JSON holds a list of argument lists (what follows ``tune`` on a command line); RESULTS_JSON
receives, for each, ``{"returncode": int, "output": str}``: the exit code ``tune`` would have given
(1 for an uncaught exception, as Python's) and what it printed, with the traceback. A single-device
``tune run`` executes the recipe in the CLI's own process (``runpy``), so running the commands one
after another here differs from separate processes only in paying the imports of torch and
torchtune once, which is most of a refused run's time.
"""

import contextlib
import io
import json
import sys
import traceback
from typing import Dict, List, Union

from torchtune._cli.tune import main as tune_main


def run(argv: List[str]) -> Dict[str, Union[int, str]]:
    """``tune *argv`` in this process: its exit code and its output."""
    output = io.StringIO()
    saved_argv = sys.argv
    sys.argv = ["tune", *argv]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                tune_main()
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if exit_.code is not None and not isinstance(exit_.code, int):
                    print(exit_.code, file=sys.stderr)
            except BaseException:  # what the interpreter would print for an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
    return {"returncode": code, "output": output.getvalue()}


def main() -> None:
    commands_path, results_path = sys.argv[1:3]
    with open(commands_path) as f:
        commands = json.load(f)
    results = [run(argv) for argv in commands]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
