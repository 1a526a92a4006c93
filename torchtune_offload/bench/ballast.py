"""Make a large GPU look like a smaller one by holding the rest of its memory in another process.

``torch.cuda.set_per_process_memory_fraction`` caps only PyTorch's allocator in one process; CUDA
unified memory (bitsandbytes' paged optimizers) ignores it. Memory another process holds is gone
for everyone, as on a smaller card. Run as ``python -m torchtune_offload.bench.ballast --leave-gib
24``: the process takes all free device memory but that much, prints one ``ready`` line, and holds
it until its standard input closes.
"""

import argparse
import subprocess
import sys
from typing import Optional

import torch

GIB = 1024**3
READY = "ballast ready"


def hold(*, leave_gib: float, device: int = 0) -> None:
    """Allocate all free memory of ``device`` but ``leave_gib`` GiB, report, and hold it until stdin closes."""
    torch.cuda.set_device(device)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    take = free - int(leave_gib * GIB)
    if take < 0:
        raise ValueError(f"--leave-gib {leave_gib}: only {free / GIB:.2f} GiB of the "
                         f"{total / GIB:.2f} GiB device is free. Ask for at most that.")
    # Plain device allocations (cudaMalloc underneath): unified memory cannot borrow them.
    block = torch.empty(take, dtype=torch.uint8, device=device) if take else None
    free_after, _ = torch.cuda.mem_get_info()
    print(f"{READY}: holding {take / GIB:.2f} GiB of {total / GIB:.2f} GiB; "
          f"{free_after / GIB:.2f} GiB free for other processes", flush=True)
    sys.stdin.read()  # returns when the parent closes the pipe (or dies)
    del block


class GpuBallast:
    """Context manager: a ballast process leaving ``leave_gib`` GiB of the device free while open.

    Args:
        leave_gib: Device memory left free for other processes, in GiB.
    """

    def __init__(self, *, leave_gib: float) -> None:
        if leave_gib <= 0:
            raise ValueError(f"--gpu-memory-gib {leave_gib}: must be positive.")
        self.leave_gib = leave_gib
        self.report: Optional[str] = None
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "GpuBallast":
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--leave-gib", str(self.leave_gib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        # Imports may print warnings first; the ready line, or the end of output, ends the wait.
        seen = []
        for line in self._proc.stdout:
            if line.startswith(READY):
                self.report = line.strip()
                return self
            seen.append(line)
        self._proc.wait()
        raise RuntimeError("the GPU ballast did not start:\n" + "".join(seen[-20:]))

    def __exit__(self, *exc) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchtune_offload.bench.ballast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leave-gib", type=float, required=True, help="device memory to leave free, GiB")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = parser.parse_args(argv)
    hold(leave_gib=args.leave_gib, device=args.device)


if __name__ == "__main__":
    main()
