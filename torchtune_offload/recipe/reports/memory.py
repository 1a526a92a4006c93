"""Memory figures for training logs: allocator, NVML, host, and the offload optimizer's own.

bitsandbytes' paged optimizers keep their state in CUDA unified memory, which PyTorch's caching
allocator never sees. NVML reports what the driver has handed out on the device, so PagedAdamW and
an offload optimizer can be compared on one figure. NVML only reports the present, so a background
thread samples it to catch the peak between two log lines.
"""

import os
import resource
import threading
from typing import Dict, Optional

import psutil
import torch


GIB = 1024**3


#: Logged key -> the caching allocator's cumulative counter, logged as its growth since the last
#: log line. Each is a stall the step's timings do not name: a retry frees the cache after a failed
#: allocation (synchronizing the device), a device allocation or free calls the driver, and a
#: synchronization of all streams waits for every queued copy and kernel.
ALLOCATOR_EVENTS = {
    "alloc_retries": "num_alloc_retries",
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "sync_all_streams": "num_sync_all_streams",
}


#: The allocator setting offload runs get unless the user set ``PYTORCH_CUDA_ALLOC_CONF``.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(device: torch.device, *, offloads: bool) -> Optional[str]:
    """Turns on the caching allocator's expandable segments for an offload run on CUDA, unless
    the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``), before anything is allocated.

    An offload run frees and re-allocates layer-sized blocks all the time (gradients leaving,
    weights widened per use); with fixed segments their holes fragment a card that is nearly full,
    and the reserved peak runs past the allocated one. Expandable segments map pages into one
    growing range instead.

    Returns:
        What was done, for the log; None where nothing was.
    """
    if device.type != "cuda" or not offloads or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return None
    torch.cuda.memory._set_allocator_settings(EXPANDABLE_SEGMENTS)
    return (f"device memory: {EXPANDABLE_SEGMENTS} for this offload run (set PYTORCH_CUDA_ALLOC_CONF to choose "
            "the allocator's settings yourself)")


class _NvmlPeakSampler:
    """Polls NVML's used-memory figure for one device and keeps the peak since the last read."""

    def __init__(self, device: torch.device, *, interval_s: float = 0.01) -> None:
        import pynvml  # optional dependency (the `gpu` extra)

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, name="nvml-peak", daemon=True)
        self._thread.start()

    def used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            used = self.used()
            with self._lock:
                self._peak = max(self._peak, used)

    def read_peak(self, *, reset: bool) -> int:
        used = self.used()
        with self._lock:
            peak = max(self._peak, used)
            if reset:
                self._peak = used
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


class MemoryMonitor:
    """Collects the memory figures a recipe logs each step.

    Args:
        device: the training device.
        optimizer: the run's optimizer (a ``RunOptimizer``, or an offload optimizer); where its
            ``memory_report()`` gives a report, its host figures are added.
    """

    def __init__(self, device: torch.device, *, optimizer: Optional[object] = None) -> None:
        self.device = device
        self.optimizer = optimizer
        # The allocator's event counters at the last reset (see ALLOCATOR_EVENTS).
        self._events_seen: Dict[str, int] = {}
        self._process = psutil.Process()
        self._nvml: Optional[_NvmlPeakSampler] = None
        if device.type == "cuda":
            try:
                self._nvml = _NvmlPeakSampler(device)
            except Exception as err:  # no pynvml or no driver access: log what we can
                print(f"[torchtune_offload] NVML device memory unavailable ({err}); logging allocator figures only.")

    def stats(self, *, reset: bool = True) -> Dict[str, float]:
        """Peak figures since the last call with ``reset``, in GiB, and the allocator's event
        counts since then (:data:`ALLOCATOR_EVENTS`; the first call's since the process began)."""
        out: Dict[str, float] = {}
        if self.device.type != "cpu" and torch.accelerator.is_available():
            mem = torch.accelerator.memory_stats(self.device)
            out["peak_memory_active"] = mem.get("active_bytes.all.peak", 0) / GIB
            out["peak_memory_alloc"] = torch.accelerator.max_memory_allocated(self.device) / GIB
            out["peak_memory_reserved"] = torch.accelerator.max_memory_reserved(self.device) / GIB
            for key, stat in ALLOCATOR_EVENTS.items():
                if stat in mem:
                    out[key] = float(mem[stat] - self._events_seen.get(stat, 0))
            if reset:
                torch.accelerator.reset_peak_memory_stats(self.device)
                self._events_seen = {stat: mem[stat] for stat in ALLOCATOR_EVENTS.values() if stat in mem}
        if self._nvml is not None:
            out["nvml_device_used_peak"] = self._nvml.read_peak(reset=reset) / GIB
        rss = self._process.memory_info().rss
        out["host_rss"] = rss / GIB
        # ru_maxrss is in KiB on Linux, a peak over the process's life, sampled by the kernel.
        out["host_rss_peak"] = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / GIB
        r = self.optimizer.memory_report() if self.optimizer is not None else None
        if r is not None:
            out["optimizer_host"] = r.host_bytes / GIB
            out["optimizer_pinned"] = r.pinned_bytes / GIB
            out["optimizer_device_saved"] = r.device_bytes_saved / GIB
            if r.device_staging_bytes:
                out["optimizer_device_staging"] = r.device_staging_bytes / GIB
        return out

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
