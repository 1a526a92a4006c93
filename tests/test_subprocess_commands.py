"""Every program the project starts runs on the interpreter it runs under.

With the project in a virtual environment that is not activated (``PYTHON=<venv>/bin/python bash
scripts/test.sh``), a ``tune``, ``tune-offload``, ``python`` or ``pytest`` looked up on PATH is
missing, or belongs to another Python. So Python code starts them as ``sys.executable -m ...`` (for
``tune``: ``tests.recipe_harness.TUNE``), and bash scripts as ``${PYTHON:-python3}``. These tests
read the sources for a program started by a bare name (``tests/plan/test_accuracy.py`` also runs its
script with no ``tune`` on PATH).
"""

import ast
import re
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
#: Programs that must not be started by name.
BARE = ("tune-offload", "tune", "python3", "python", "pytest", "torchrun")
#: (module, function) calls whose first argument is the program (or a shell line) to start or look up.
STARTERS = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output")} | {
    ("os", name) for name in ("system", "popen", "execvp", "execvpe", "execlp", "execlpe", "spawnvp", "spawnlp")
} | {("shutil", "which"), ("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell")} | {
    ("zygote", "run"), ("zygote", "Popen")}  # tests/zygote.py: children forked from a pre-imported process
PYTHON_FOLDERS = ("scripts", "tests", "torchtune_offload", "recipes")
_NAME = "|".join(re.escape(b) for b in BARE)
# A bare name where bash expects a command: at the line's start, after ; & | ( { $( or a keyword
# that runs what follows, after any VAR=value assignments.
_SHELL_COMMAND = re.compile(
    rf"(?:^|[;&|({{]|\$\(|\b(?:then|do|else|exec|time|xargs|nohup|env)\s)\s*(?:[A-Za-z_]\w*=\S*\s+)*({_NAME})(?=\s|;|\)|$)"
)


def _program(node: ast.AST) -> str:
    """The program a starter's first argument names, where the source spells it out; else ''."""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        node = node.elts[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = node.value.split()
        return words[0] if words else ""
    return ""


def python_offenders(source: str, where: str = "<source>") -> List[str]:
    """Calls in ``source`` that start (or look up on PATH) a program of ``BARE`` by its bare name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in STARTERS):
            continue
        first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg in ("args", "cmd")), None)
        if first is not None and _program(first) in BARE:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def shell_offenders(source: str, where: str = "<script>") -> List[str]:
    """Lines of a bash script that run a program of ``BARE`` by its bare name."""
    found = []
    for number, line in enumerate(source.replace("\\\n", " ").splitlines(), start=1):
        code = line.split(" #")[0].strip()
        if code.startswith("#"):
            continue
        code = re.sub(r"'[^']*'", "''", re.sub(r'"[^"]*"', '""', code))  # what is quoted is not run
        if _SHELL_COMMAND.search(code):
            found.append(f"{where}: {line.strip()[:120]}")
    return found


def test_the_scanners_find_bare_names_and_pass_the_interpreter():
    assert python_offenders('import subprocess\nsubprocess.run(["tune", "run", "x.py"], check=True)')
    assert python_offenders('import subprocess\nsubprocess.Popen(args=("python3", "-c", "pass"))')
    assert python_offenders('import shutil\nshutil.which("tune-offload")')
    assert python_offenders('import os\nos.system("pytest -q tests")')
    assert not python_offenders('import subprocess, sys\nsubprocess.run([sys.executable, "-m", "pytest"])')
    assert not python_offenders('import shutil\nshutil.which("cc")')
    assert shell_offenders("set -e\nATEN_CPU_CAPABILITY=avx2 python -m pytest -q\n")
    assert shell_offenders("if true; then tune-offload run x; fi\n")
    assert shell_offenders("out=$(python3 -c 'print(1)')\n")
    assert shell_offenders("echo start && tune run \\\n  recipes/x.py\n")
    assert not shell_offenders('PY=${PYTHON:-python3}\n$PY -m pytest -q\necho "installs pytest, pytest-xdist"\n')
    assert not shell_offenders("# python scripts/x.py, in a comment\n")


def test_no_script_test_or_module_starts_a_program_by_a_bare_name():
    offenders = []
    for folder in PYTHON_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            offenders += python_offenders(path.read_text(), str(path.relative_to(REPO)))
    for path in [*sorted((REPO / "scripts").glob("*.sh")), REPO / ".ci" / "run"]:
        offenders += shell_offenders(path.read_text(), str(path.relative_to(REPO)))
    assert not offenders, "start these with sys.executable (Python) or ${PYTHON:-python3} (bash):\n" + "\n".join(
        offenders)
