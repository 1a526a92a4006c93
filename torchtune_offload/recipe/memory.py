"""Memory figures for training logs: allocator, NVML, host, and the offload optimizer's own.

bitsandbytes' paged optimizers keep their state in CUDA unified memory, which PyTorch's caching
allocator never sees. NVML reports what the driver has handed out on the device, so PagedAdamW and
an offload optimizer can be compared on one figure. NVML only reports the present, so a background
thread samples it to catch the peak between two log lines.
"""

import os
import resource
import threading
from typing import Dict, Mapping, Optional

import psutil
import torch
from omegaconf import DictConfig
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtune_offload.recipe.config import ConfigError, RecipeSettings
from torchtune_offload.recipe.host_preflight import meta_model

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


def check_weights_fit_device(weights: Mapping[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype,
                             device_weights: Optional[str] = None) -> None:
    """Refuses a single-device CUDA run whose weights cannot fit the device's free memory, before
    the model is built there: the recipe puts every weight on the device in ``dtype`` before the
    optimizer exists (with ``optimizer.device_weights`` too, before its FP8 images replace them),
    so such a run would fail with an out-of-memory error part-way through building or loading.

    Args:
        weights: the checkpoint's model tensors (their sizes are the model's).

    Raises:
        ConfigError: naming the weights' size, the device's free memory, and what to do.
    """
    if device.type != "cuda":
        return
    need = sum(t.numel() for t in weights.values()) * dtype.itemsize
    free, total = torch.cuda.mem_get_info(device)
    if need <= free:
        return
    fp8 = (f" (with optimizer.device_weights={device_weights} too: the FP8 images are made from them once the "
           "optimizer exists)") if device_weights else ""
    raise ConfigError(
        f"device={device}: the model's weights are {need / GIB:.2f} GiB in {dtype}, and the recipe loads all of "
        f"them onto the device before the optimizer is built{fp8}, but it has {_free_of(free, total)}, or "
        "fine-tune less of the model (LoRA or QLoRA: configs/<model>/*_lora_offload.yaml, *_qlora_offload.yaml). "
        f"{_PLANNER}")


def check_lora_model_fits_device(cfg_model: DictConfig, settings: RecipeSettings) -> None:
    """Refuses a single-device CUDA run of the LoRA recipe whose model cannot fit the device's free
    memory, before it is built there: the recipe builds the whole model on the device (the base
    weights, in NF4 for QLoRA, and the adapters) and then loads the base weights into it, so such a
    run would fail with an out-of-memory error part-way through the build.

    The checkpoint's size would overstate a QLoRA model by about four times, so the model is the
    configured builder's on the meta device (:func:`meta_model`), NF4 weights counted by the
    tensors they hold. A buffer a builder makes only off the meta device is not counted: llama3.1's
    RoPE cache, 64 MiB.

    Args:
        cfg_model: the config's ``model`` node.
        settings: the checked config's settings (the device and dtype).

    Raises:
        ConfigError: naming the model's size, the device's free memory, and what to do.
    """
    if settings.device.type != "cuda":
        return
    model = meta_model(cfg_model, settings)
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(_nbytes(t) for t in tensors)
    quantized = any(is_traceable_wrapper_subclass(t) for t in tensors)
    free, total = torch.cuda.mem_get_info(settings.device)
    if need <= free:
        return
    what, advice = (("its base weights in NF4", "a smaller model") if quantized else
                    (f"in {settings.dtype}", "with QLoRA, which keeps the base layers' weights in NF4, about a quarter "
                     "of their bf16 size (configs/<model>/*_qlora_offload.yaml: the model's qlora_ builder)"))
    raise ConfigError(
        f"device={settings.device}: the model is {need / GIB:.2f} GiB ({what}, adapters included), and the recipe "
        f"builds all of it on the device before the base weights load, but it has {_free_of(free, total)}, or "
        f"fine-tune {advice}. {_PLANNER}")


_PLANNER = "The planner (tune-offload plan --config <name or path> --device-gib <free GiB>) says what fits."


def _free_of(free: int, total: int) -> str:
    return (f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB. Free the device (another process, or a display, "
            f"holds {(total - free) / GIB:.2f} GiB)")


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` takes on its device: for a wrapper subclass (torchao's NF4), its inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


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
