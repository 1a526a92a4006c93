"""Python children for the tests, forked from a process that has already imported torch and torchtune.

Most of the CPU suite's time was Python children importing torch, torchao (which imports
``torch._dynamo``), torchtune and datasets: about 4.5 s of CPU each, over 100 children, about half of
the suite's CPU time on 2 cores. A test that starts ``sys.executable -m ...``, ``sys.executable
script.py ...`` or ``sys.executable -c ...`` through :func:`run` or :class:`Popen` gets a child
forked from a zygote process that paid those imports once (one zygote per pytest process, started
on first use). The child is a real process with its own pid, working directory, environment,
standard streams and exit status (a SIGKILL shows as ``-9``, as with ``subprocess``); it runs the
module, script or code as ``__main__`` the way ``python`` would, then exits as Python exits
(non-daemon threads joined, ``atexit`` functions run, streams flushed).

Where a fork cannot stand for a fresh interpreter, the call falls back to ``subprocess``: another
program or interpreter, interpreter options (``-P``, ``-X``, ``-u``...), or an environment that
differs from the zygote's in what Python, torch, OpenMP or the C libraries read when they load
(``PYTHON*``, ``OMP_*``, ``ATEN_CPU_CAPABILITY``, ``LD_*``...), and everywhere on a machine where the
zygote's imports initialized CUDA (a fork could not use it). Tests that measure a process's
memory (its RSS includes the zygote's pages) or that test the start of a program itself keep
``subprocess``. ``TEST_ZYGOTE=0`` turns the zygote off (every call is ``subprocess``).

Fork safety: the zygote only imports; it never runs a parallel torch op, so no OpenMP pool exists to
be lost in the fork (torch's own DataLoader workers fork after far more). Python's ``random`` and
``tempfile`` reseed in a forked child; torch's default generator starts from its fixed seed as in a
fresh process.
"""

import atexit
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tests.recipe_harness import REPO, working_tree_env

#: What the zygote imports before it serves: what nearly every child imports first.
PRELOAD = ("torch", "torchtune", "torchtune._cli.tune", "torchtune_offload", "torchtune_offload.recipe",
           "torchtune_offload.plan", "torchtune_offload.plan.planner", "torchtune_offload.bench",
           "torchtune_offload.assets")
#: Environment variables read when the interpreter or a native library loads: a child whose value
#: differs from the zygote's would not behave as a fresh process, so it gets one.
LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "ATEN_", "TORCH", "CUDA", "ONEDNN_",
                      "DNNL_", "MALLOC_", "GLIBC_", "OPENBLAS_", "NUMEXPR_", "TOKENIZERS_")
_HEADER = struct.Struct("!Q")

# ----------------------------------------------------------------------------- the zygote process

_SERVER = r"""
import importlib, sys
path, modules = sys.argv[1], sys.argv[2].split(",")
for name in modules:
    importlib.import_module(name)
import tests.zygote as zygote
refusal = zygote._unforkable()
if refusal:
    print(refusal, flush=True)
else:
    zygote._serve(path)
"""


def _unforkable() -> str:
    """Why this process's forks cannot stand for fresh interpreters, or ``""`` where they can.

    On a CUDA machine, importing torchtune initializes CUDA (``torchtune.utils._import_guard`` asks
    for the device's capability), and a child forked after that cannot use CUDA at all ("Cannot
    re-initialize CUDA in forked subprocess"). Under ``TORCH_CUDA_SANITIZER`` every op, a CPU one
    too, asks for the current CUDA stream, so such a child fails at its first op: by reading torch's
    and torchtune's code, the likely cause of the recipe GPU tests' ERROR under the sanitizer (their
    assets were built by such a child; not yet confirmed on a GPU).
    """
    if torch.cuda.is_initialized():
        return "CUDA was initialized while the zygote imported its modules: its forks could not use CUDA"
    return ""


def _serve(path: str) -> None:
    """The zygote's loop: one request per connection, answered by a fork (see :func:`_child`)."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    # The waiters (below) exit on their own; ignoring SIGCHLD reaps them without a thread here.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([server], [], [], 2.0)
        if os.getppid() != parent:  # the test process is gone: so is the zygote
            return
        if not ready:
            continue
        conn, _ = server.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):  # a client that went away mid-request (JSONDecodeError is a ValueError)
            conn.close()
            continue
        # A waiter forks the child and reports its pid and exit status over the connection: the
        # zygote itself stays single-threaded and never waits.
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            child = os.fork()
            if child == 0:
                conn.close()
                _child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {child}\n".encode())
                _, status = os.waitpid(child, 0)
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> Tuple[dict, List[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    if len(head) != _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError("short request")
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("short request")
        body += chunk
    return json.loads(body), list(fds)


def _child(request: dict, fds: List[int]) -> None:
    """In the forked child: become the requested ``python ...`` and exit as it would."""
    code = 0
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        mode, target, argv = request["mode"], request["target"], request["argv"]
        if mode == "module":  # python -m: the working directory first on sys.path
            sys.path[0] = os.getcwd()
            sys.argv = ["-m", *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif mode == "script":  # python script.py: the script's folder first
            script = os.path.abspath(target)
            sys.path[0] = os.path.dirname(script)
            sys.argv = [target, *argv]
            runpy.run_path(script, run_name="__main__")
        else:  # python -c
            sys.path[0] = ""
            sys.argv = ["-c", *argv]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - as the interpreter does: print it, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # non-daemon threads end first, as at interpreter exit
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                    pass
            os._exit(code & 0xFF)


# ----------------------------------------------------------------------------- the test side

class _Zygote:
    """The zygote of this pytest process: started on first use, stopped at exit."""

    def __init__(self, *, preload: Sequence[str] = PRELOAD) -> None:
        self._preload = tuple(preload)
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._dir = ""
        self.env: Dict[str, str] = {}
        #: Why the zygote does not serve (its answer instead of "ready"), once :meth:`ensure` knows.
        self.refusal = ""

    @property
    def path(self) -> str:
        return os.path.join(self._dir, "zygote.sock")

    def ensure(self) -> bool:
        """Starts the zygote if needed; False where it cannot serve (then callers use subprocess)."""
        with self._lock:
            if self._proc is not None:
                return not self.refusal and self._proc.poll() is None
            self._dir = tempfile.mkdtemp(prefix="zygote-")
            self.env = working_tree_env(TIKTOKEN_CACHE_DIR="")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, self.path, ",".join(self._preload)], cwd=REPO, env=self.env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            answer = self._proc.stdout.readline().strip()
            ready = answer == "ready"
            if not ready:
                self.refusal = answer or "the zygote ended before it was ready"
                self._proc.kill()
                self._proc.wait()
            atexit.register(self.stop)
            return ready

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_ZYGOTE = _Zygote()


def _split(cmd: Sequence[str]) -> Optional[Tuple[str, str, List[str]]]:
    """(mode, target, argv) for ``sys.executable -m mod ...``, ``... script.py ...``, ``... -c code ...``."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] == "-m" and len(cmd) > 2:
        return "module", cmd[2], cmd[3:]
    if cmd[1] == "-c" and len(cmd) > 2:
        return "code", cmd[2], cmd[3:]
    if not cmd[1].startswith("-"):
        return "script", cmd[1], cmd[2:]
    return None


def _servable(cmd: Sequence[str], env: Dict[str, str]) -> Optional[Tuple[str, str, List[str]]]:
    if os.environ.get("TEST_ZYGOTE", "1") == "0" or sys.platform != "linux":
        return None
    split = _split(cmd)
    if split is None or not _ZYGOTE.ensure():
        return None
    keys = {k for k in (*env, *_ZYGOTE.env) if k.startswith(LOAD_TIME_PREFIXES)}
    if any(env.get(k) != _ZYGOTE.env.get(k) for k in keys):
        return None
    return split


class Popen:
    """The part of ``subprocess.Popen`` the tests use, for a child forked by the zygote.

    Output goes to temporary files (``stdout``/``stderr``: ``None`` inherits, ``subprocess.PIPE``
    captures, ``subprocess.STDOUT`` for stderr joins stdout), read by :meth:`communicate`.
    """

    def __init__(self, cmd: Sequence[str], *, cwd=None, env=None, stdout=None, stderr=None, text=False) -> None:
        env = dict(os.environ if env is None else env)
        split = _servable(cmd, env)
        self._fallback: Optional[subprocess.Popen] = None
        if split is None:
            self._fallback = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
            self.pid = self._fallback.pid
            return
        self._text = text
        self._returncode: Optional[int] = None
        self._files: List[Optional[tempfile.TemporaryFile]] = [None, None]
        self._opened: List[int] = []
        out_fd = self._stream(0, stdout, sys.__stdout__)
        err_fd = out_fd if stderr == subprocess.STDOUT else self._stream(1, stderr, sys.__stderr__)
        null = os.open(os.devnull, os.O_RDONLY)
        self._opened.append(null)
        mode, target, argv = split
        body = json.dumps({"mode": mode, "target": target, "argv": argv, "env": env,
                           "cwd": str(cwd if cwd is not None else os.getcwd())}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_ZYGOTE.path)
            socket.send_fds(self._conn, [_HEADER.pack(len(body))], [null, out_fd, err_fd])
            self._conn.sendall(body)
        finally:
            for fd in self._opened:
                os.close(fd)
        self._lines = b""
        self.pid = int(self._message("pid"))

    def _stream(self, index: int, how, inherited) -> int:
        if how is None:
            return inherited.fileno()
        if how == subprocess.PIPE:
            self._files[index] = tempfile.TemporaryFile()
            return self._files[index].fileno()
        if how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
            self._opened.append(fd)  # closed once sent: the child gets its own copy
            return fd
        return how.fileno() if hasattr(how, "fileno") else how

    def _message(self, kind: str, timeout: Optional[float] = None) -> Optional[str]:
        while b"\n" not in self._lines:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError("the zygote's waiter ended without reporting the child's status")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        found, value = line.decode().split(" ", 1)
        assert found == kind, (found, kind)
        return value

    def poll(self) -> Optional[int]:
        if self._fallback is not None:
            return self._fallback.poll()
        if self._returncode is None:
            value = self._message("exit", timeout=0)
            if value is not None:
                self._returncode = int(value)
                self._conn.close()
        return self._returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self._fallback is not None:
            return self._fallback.wait(timeout)
        if self._returncode is None:
            value = self._message("exit", timeout=timeout)
            if value is None:
                raise subprocess.TimeoutExpired(["zygote child", str(self.pid)], timeout)
            self._returncode = int(value)
            self._conn.close()
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self._fallback is not None:
            self._fallback.send_signal(sig)
        elif self._returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, index: int):
        file = self._files[index]  # a temporary file where the stream was subprocess.PIPE
        if file is None:
            return None
        file.seek(0)
        data = file.read()
        file.close()
        return data.decode(errors="replace") if self._text else data

    def communicate(self, timeout: Optional[float] = None):
        if self._fallback is not None:
            return self._fallback.communicate(timeout=timeout)
        self.wait(timeout)
        return self._read(0), self._read(1)

    @property
    def returncode(self) -> Optional[int]:
        """The exit status once :meth:`poll`, :meth:`wait` or :meth:`communicate` has seen it."""
        return self._fallback.returncode if self._fallback is not None else self._returncode


def run(cmd: Sequence[str], *, cwd=None, env=None, capture_output: bool = False, text: bool = False,
        timeout: Optional[float] = None, check: bool = False, stdout=None, stderr=None) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a Python child forked by the zygote (or started by ``subprocess``)."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    result = subprocess.CompletedProcess(list(cmd), proc.poll(), out, err)
    if check:
        result.check_returncode()
    return result


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python scripts/<script> <args>`` from the repository root, the working tree's package
    first (:func:`~tests.recipe_harness.working_tree_env`), its output captured as text (:func:`run`)."""
    return run([sys.executable, f"scripts/{script}", *args], cwd=REPO, env=working_tree_env(), capture_output=True,
               text=True, timeout=timeout)
