"""Does other traffic through host memory slow the thread that launches a step's ops?

Usage: python scripts/bench_launch_contention.py [--model 8B] [--steps 10] [--rounds 3] [--copy-gib 1]
       [--host-cores N]

The 8B profile of docs/gpu_results.md ("accumulation with the sums on the device") found its passes
bound by the launching thread, each op costing that thread 2-3 times what the 1B runs allow, while
the engine's copies moved about 50 GB/s each way between pinned host memory and the GPU beside
them. This script times the launching thread's work alone, the narrowed architecture
(``torchtune_offload.models.narrow``: width 64, bf16, activation checkpointing, one sequence of 16
tokens, so the device's arithmetic is negligible), in modes that take turns in one run (``--rounds``
rounds of ``--steps`` steps each, so that the machine's drift reaches every mode alike):

- ``quiet``: nothing else runs;
- ``pcie copies`` (CUDA only): a thread keeps ``--copy-gib`` GiB copies running each way between
  pinned host buffers and the device, on two streams of their own, as the engine's copies run;
- ``host copies``: a process on ``--host-cores`` other cores (default: all but the launching
  thread's) keeps copying a ``--copy-gib`` GiB host buffer, as the host step and the landing thread
  load the memory.

The launching thread runs on one core (its affinity is set), the copies' thread and the host-copy
process on the others. Prints a markdown table naming the CPU and the device: median seconds of a
forward and of a backward (each synchronized) per mode over its rounds, after 2 warm-up steps, their
ratio to ``quiet``, and what the other traffic moved while its mode ran.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import List, Optional

import torch

from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.models.narrow import (NARROW_MODELS, checkpointed_llama, chosen_models, one_sequence,
                                             pass_seconds)

#: The narrowed model's width, the tokens of a step, and the steps left out of the medians.
WIDTH, TOKENS, WARMUP = 64, 16, 2
#: The host-copy process: pins itself to the given cores, reports when its buffers are ready, then
#: copies until it is terminated (stopped with SIGSTOP between its mode's turns) and prints the bytes
#: it moved, read plus written.
HOST_COPIER = """
import os, signal, sys
import torch
cores, nbytes = {int(c) for c in sys.argv[1].split(",")}, int(sys.argv[2])
os.sched_setaffinity(0, cores)
torch.set_num_threads(len(cores))
src = torch.ones(nbytes, dtype=torch.uint8)
dst = torch.empty_like(src)
dst.copy_(src)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
copies = 0
while not stop:
    dst.copy_(src)
    copies += 1
print(2 * nbytes * copies, flush=True)
"""


class BackgroundCopies:
    """A thread that keeps copies of ``nbytes`` running each way between host and ``device`` from
    :meth:`start` to :meth:`stop` (again and again, on the same buffers): on CUDA from pinned host
    buffers, each direction on a stream of its own; elsewhere plain host copies (for this class's own
    test). The thread runs on ``cores`` (Linux affinity), away from the thread whose launches are
    timed; CUDA's waits may spin.

    Args:
        device: where the device buffers live.
        nbytes: the bytes of each copy.
        cores: the cores the copying thread may run on; None for the process's own.
    """

    def __init__(self, *, device: torch.device, nbytes: int, cores: Optional[List[int]] = None) -> None:
        cuda = device.type == "cuda"
        self._host_up = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._dev_up = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._dev_down = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
        if cuda:
            torch.cuda.synchronize(device)  # the buffers are filled before the side streams read them
        self._cores = cores
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: Bytes moved, both ways together, and the seconds the thread copied, over every start and stop.
        self.copied_bytes = 0
        self.seconds = 0.0

    def _run(self) -> None:
        try:
            if self._cores is not None:
                os.sched_setaffinity(0, self._cores)  # 0: this thread, not the process
            start = time.perf_counter()
            while not self._stop.is_set():
                if self._streams is None:
                    self._dev_up.copy_(self._host_up)
                    self._host_down.copy_(self._dev_down)
                else:
                    up, down = self._streams
                    with torch.cuda.stream(up):
                        self._dev_up.copy_(self._host_up, non_blocking=True)
                    with torch.cuda.stream(down):
                        self._host_down.copy_(self._dev_down, non_blocking=True)
                    up.synchronize()
                    down.synchronize()
                self.copied_bytes += 2 * self._host_up.numel()
            self.seconds += time.perf_counter() - start
        except BaseException as err:  # noqa: BLE001 - handed to the caller of stop()
            self._error = err

    def start(self) -> "BackgroundCopies":
        """Starts the copies; returns ``self``."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="background-copies", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the copies after the pair in flight.

        Raises:
            RuntimeError: the copying thread failed (its error is the cause).
        """
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the background copies failed") from self._error

    def gbs(self) -> float:
        """GB/s moved while copying, both ways together."""
        return self.copied_bytes / self.seconds / 1e9 if self.seconds else 0.0


def host_copier(cores: List[int], nbytes: int) -> subprocess.Popen:
    """Starts the host-copy process on ``cores``, waits until its buffers are ready and stops it
    (SIGSTOP) until its mode's first turn."""
    proc = subprocess.Popen([sys.executable, "-c", HOST_COPIER, ",".join(map(str, cores)), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the host-copy process ended before its buffers were ready")
    proc.send_signal(signal.SIGSTOP)
    return proc


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8B", help="one of " + ", ".join(NARROW_MODELS) + " (default 8B)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of a mode's turn (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each mode, taken in rotation (default 3)")
    parser.add_argument("--copy-gib", type=float, default=1.0, help="GiB of each background copy (default 1)")
    parser.add_argument("--host-cores", type=int, default=None,
                        help="cores of the host-copy process (default: all this process may use but one)")
    args = parser.parse_args(argv)
    try:
        chosen_models(args.model)
    except ValueError as err:
        parser.error(str(err).replace("--models", "--model"))
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if args.copy_gib <= 0:
        parser.error("--copy-gib must be positive")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        parser.error("the host-copy mode needs a second core; this process may use one")
    if args.host_cores is not None and not 1 <= args.host_cores <= len(cores) - 1:
        parser.error(f"--host-cores must be between 1 and {len(cores) - 1} (the cores but the launching one)")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    launcher, others = cores[0], cores[1:1 + (args.host_cores or len(cores) - 1)]
    os.sched_setaffinity(0, {launcher})
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = checkpointed_llama(args.model, width=WIDTH, max_seq_len=TOKENS).to(device)
    tokens = one_sequence(TOKENS).to(device)
    nbytes = int(args.copy_gib * 2**30)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    print(f"{cpu_name()}; {gpu}; torch {torch.__version__}; {NARROW_MODELS[args.model][0]} narrowed to width "
          f"{WIDTH}, bf16, activation checkpointing, 1 x {TOKENS} tokens; launching thread on core {launcher}, "
          f"copies on {len(others)} other cores; {args.copy_gib:g} GiB copies; {args.rounds} rounds of "
          f"{args.steps} steps a mode\n")
    pass_seconds(model, tokens, steps=WARMUP, sync=sync)
    copies = BackgroundCopies(device=device, nbytes=nbytes, cores=others) if device.type == "cuda" else None
    proc = host_copier(others, nbytes)
    modes = ["quiet", *(["pcie copies"] if copies else []), "host copies"]
    passes = {mode: ([], []) for mode in modes}
    host_seconds = 0.0
    try:
        for _ in range(args.rounds):
            for mode in modes:
                if mode == "pcie copies":
                    copies.start()
                elif mode == "host copies":
                    proc.send_signal(signal.SIGCONT)
                start = time.perf_counter()
                try:
                    forward, backward = pass_seconds(model, tokens, steps=args.steps, sync=sync)
                finally:
                    if mode == "pcie copies":
                        copies.stop()
                    elif mode == "host copies":
                        proc.send_signal(signal.SIGSTOP)
                        host_seconds += time.perf_counter() - start
                passes[mode][0].extend(forward)
                passes[mode][1].extend(backward)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    out, _ = proc.communicate(timeout=60)
    traffic = {"quiet": "", "host copies": f"{float(out.strip()) / host_seconds / 1e9:.1f} GB/s read and written"}
    if copies:
        traffic["pcie copies"] = f"{copies.gbs():.1f} GB/s both ways"
    print("| mode | forward, s | backward, s | forward / quiet | backward / quiet | other traffic |")
    print("|---|---:|---:|---:|---:|---|")
    quiet = [statistics.median(p) for p in passes["quiet"]]
    for mode in modes:
        forward, backward = (statistics.median(p) for p in passes[mode])
        print(f"| {mode} | {forward:.4f} | {backward:.4f} | {forward / quiet[0]:.2f} | {backward / quiet[1]:.2f} | "
              f"{traffic[mode]} |")
    if copies is None:
        print("\npcie copies: not run, no CUDA device here")


if __name__ == "__main__":
    main()
