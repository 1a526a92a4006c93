"""The options of :class:`~torchtune_offload.optim.OffloadOptimizer` that are its own (not the base
optimizer's), checked once, where the optimizer is built, so every error names its config key."""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

#: Where offloaded parameters are updated (see ``OffloadOptions.update_on``).
UPDATE_ON = ("host", "device")
#: The default bound on the device memory that stages streamed states, in MiB.
DEVICE_STAGING_MIB = 256.0

#: Where later micro-batches are added into their host sums (see ``OffloadOptions.grad_sum_on``).
GRAD_SUM_ON = ("host", "device")

#: How backward hands gradients to the engine (see ``OffloadOptions.handoff``).
HANDOFF = ("group", "parameter")

#: The host engine's options that ``update_on="device"`` refuses: each with the value a device update
#: takes, why, and the fixes. Each needs the gradient (or a copy of the weights) on the host, or host
#: workers, which that mode never makes; ``parse`` refuses them, and the host pre-flight resets them
#: where it suggests a device update.
DEVICE_UPDATE_REFUSES = {
    "offload_gradients": (False, "gradients stay on the device for the device's update",
                          "Set optimizer.offload_gradients=False, or optimizer.update_on=host"),
    "master_dtype": (None, "fp32 master weights are a host engine feature",
                     "Remove it (~optimizer.master_dtype), or set optimizer.update_on=host"),
    "grad_sum_dtype": (None, "gradients are summed on the device in their own dtype",
                       "Remove it (~optimizer.grad_sum_dtype), or set optimizer.update_on=host"),
    # update_on=host alone would not do: sums added on the device need offload_gradients too.
    "grad_sum_on": ("host", "gradients are summed on the device, as in plain training",
                    "Remove it (~optimizer.grad_sum_on), or set optimizer.update_on=host with "
                    "optimizer.offload_gradients=True"),
    "device_weights": (None, "FP8 device weights are re-quantized from host masters, and a device update keeps "
                       "no master", "Remove it (~optimizer.device_weights), or set optimizer.update_on=host"),
    "overlap_timeout_s": (None, "the timeout bounds waits for host workers, which this mode does not use",
                          "Remove it (~optimizer.overlap_timeout_s), or set optimizer.update_on=host"),
    "handoff": ("group", "gradients stay on the device and backward hands none over",
                "Remove it (~optimizer.handoff), or set optimizer.update_on=host with optimizer.overlap=True"),
}

#: Accepted ``device_weights`` values besides None (``optim/fp8_weights.py``).
DEVICE_WEIGHTS = ("fp8", "fp8_per_tensor")

#: Spellings accepted for the precision options (torch dtypes are accepted too).
_DTYPES = {"fp32": torch.float32, "float32": torch.float32}


def precision_option(value: Any, *, key: str) -> Optional[torch.dtype]:
    """``None`` (the parameter's own dtype) or fp32, from a config string or a torch dtype."""
    if value is None:
        return None
    dtype = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value).lower())
    if dtype not in _DTYPES.values():
        raise ValueError(f"optimizer.{key}={value!r}: use fp32, or leave it unset (null) for the "
                         "parameter's own dtype.")
    return dtype


def flag_option(value: Any, *, key: str) -> bool:
    """``value`` if it is True or False (a string such as ``"false"`` would be truthy).

    Raises:
        ValueError: naming ``optimizer.<key>``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"optimizer.{key}={value!r} must be True or False.")
    return value


def check_accumulation_steps(value: Any) -> None:
    """Refuses a ``gradient_accumulation_steps`` that is not an integer >= 1.

    Raises:
        ValueError: naming ``gradient_accumulation_steps``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gradient_accumulation_steps={value!r} must be an integer >= 1.")


def minimal_size_option(value: Any) -> int:
    """``value`` if it is a non-negative integer: the fewest elements an offloaded parameter has.

    Raises:
        ValueError: naming ``optimizer.minimal_size``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"optimizer.minimal_size={value!r} must be a non-negative integer "
            "(parameters with fewer elements step on the device; 4096 is the default)."
        )
    return value


@dataclass(frozen=True)
class OffloadOptions:
    """The options of ``OffloadOptimizer`` that are its own, validated.

    Attributes:
        offload_gradients: copy each gradient to the host once backward has produced its hand-off
            group (a transformer layer or a bucket; see ``handoff``) and free the device copies, so
            gradients take no device memory between micro-batches. Gradient accumulation still
            works: micro-batches are summed in host buffers.
        minimal_size: parameters with fewer elements stay on the device and step there.
        master_dtype: ``None`` (default): the base optimizer steps on a copy in the parameter's
            dtype, plain-optimizer math. fp32: it steps on fp32 master weights (fp32 state
            too), on the host for offloaded parameters and on the device for the others, and the
            parameter becomes the master rounded to its dtype after each step; pure-bf16 training
            loses small updates to rounding, this does not. The masters are checkpointed. When the
            gradient buffer has the parameter's dtype, the rounded weights are written over the
            consumed gradient (no extra host buffer), so with ``offload_gradients`` a step leaves
            no host gradient behind: the next backward starts a fresh sum, as after ``zero_grad()``.
        grad_sum_dtype: the dtype of host gradient buffers, in which ``offload_gradients`` sums
            micro-batches. ``None`` (default): the parameter's dtype, as plain training sums;
            fp32: fp32 sums. Needs ``offload_gradients`` (without it the device sums them).
        fused_master_step: with fp32 masters, bf16 parameters and an Adam/AdamW base, step each
            offloaded master in one pass over all host cores that also writes the rounded copy (a C
            loop built at first use, ``optim/fused_step.py``); False, or no C compiler, takes the
            unfused path (widen the gradient, the base step, round).
        overlap: run host steps on worker threads beside GPU work, with the same results. Takes
            effect for windows announced with ``expect_final_backward``; a caller that announces
            nothing gets the serial step-after-backward behaviour. With ``register_forward_waits``
            ``step()`` returns at once and the next forward waits module by module; without it
            ``step()`` waits for the host work before returning.
        overlap_timeout_s: with ``overlap``, the longest wait for one piece of host work before a
            RuntimeError says what was stuck; ``None`` (default) waits without a limit.
        update_on: ``"host"`` (default): offloaded parameters are updated on the host, on host
            copies. ``"device"``: parameters and gradients stay on the device and only the
            optimizer states of offloaded parameters live in (pinned) host memory; at ``step()``
            they are brought to the device slice by slice, the base optimizer updates there, and
            they go back (``optim/state_streamer.py``). Plain training's results, with no host
            arithmetic and host memory for the states alone; it needs the gradients on the
            device, so ``offload_gradients``, ``master_dtype`` and ``grad_sum_dtype`` do not apply.
        device_staging_mib: with ``update_on="device"``, the bound on the device memory that
            stages states on their way (two buffers of half of it each), in MiB; ``None``
            (default): 256. Refused with ``update_on="host"``.
        device_weights: ``None`` (default): device weights in the model's dtype. ``"fp8"``: the
            offloaded 2-D weights of the transformer layers live on the device as
            ``float8_e4m3fn`` with a power-of-two scale per output row (``"fp8_per_tensor"``: one
            per tensor), widened right before use; the host master is stepped exactly as without
            it and re-quantized after each step (``optim/fp8_weights.py``, docs/fp8_weights.md).
            Host updates only (refused with ``update_on="device"``).
        grad_sum_on: with ``offload_gradients`` and gradient accumulation, where a later
            micro-batch's gradient is added into its host sum (the sum lives on the host either
            way). ``"host"`` (default): copied down into a small pinned ring and added by the
            host's cores (``optim/staging.py``, ``StagingRing``). ``"device"``: the sum's chunk is
            copied up, added on the device and copied back (``DeviceSumRing``): no host core work,
            half the host memory traffic with bf16 sums, the sum both ways over PCIe, at most 128 MiB
            of device memory, and the device measures each sum's norm (no host pass over the sums
            for clipping). The same sums either way; on a GPU a clipped run's norms, and so its
            weights, agree to rounding (the device reduces in another order). On an H100 it ran
            llama3_1 8B at batch 1 with 4 micro-batches 18% faster, before the norms moved to the
            device (docs/accumulation.md). Refused without ``offload_gradients`` (the device
            accumulates as plain training does).
        handoff: with ``offload_gradients`` or ``overlap``, how backward hands gradients to the
            engine (``optim/handoff.py``). ``"group"`` (default): once per transformer layer or
            bucket of other parameters, when the group's last gradient is complete, with batched
            norms and copies. ``"parameter"``: each gradient as autograd completes it, which with
            ``offload_gradients`` frees each gradient sooner (a layer's gradients are never on the
            device together) at the cost of the engine's Python per parameter on the thread that
            launches the kernels (with overlap and no clipping, a thread job per gradient too).
            The same results to the bit either way. Refused on FSDP2's shards, whose units'
            gradients arrive together.
    """

    offload_gradients: bool
    minimal_size: int
    master_dtype: Optional[torch.dtype]
    grad_sum_dtype: Optional[torch.dtype]
    fused_master_step: bool
    overlap: bool
    overlap_timeout_s: Optional[float]
    update_on: str = "host"
    device_staging_mib: float = DEVICE_STAGING_MIB
    device_weights: Optional[str] = None
    grad_sum_on: str = "host"
    handoff: str = "group"

    @property
    def device_staging_bytes(self) -> int:
        return device_staging_bytes(self.device_staging_mib)

    @property
    def hands_off_in_backward(self) -> bool:
        """Whether backward hands gradients to the engine (``OffloadOptimizer.on_gradient`` counts them,
        ``handoff`` groups them): with ``offload_gradients`` or ``overlap``, where the host steps."""
        return self.update_on == "host" and (self.offload_gradients or self.overlap)

    def summary(self) -> str:
        """The options that set how the engine trains, as a run's first lines name them: those set
        away from their defaults (``offload_gradients, overlap, master_dtype=fp32``); empty if none is."""
        said = [key for key in ("offload_gradients", "overlap") if getattr(self, key)]
        said += [f"{key}=fp32" for key in ("master_dtype", "grad_sum_dtype") if getattr(self, key) is not None]
        said += [f"{key}={getattr(self, key)}" for key in ("update_on", "grad_sum_on") if getattr(self, key) != "host"]
        said += [f"handoff={self.handoff}"] if self.handoff != "group" else []
        said += [f"device_weights={self.device_weights}"] if self.device_weights is not None else []
        return ", ".join(said)

    @classmethod
    def parse(
        cls,
        *,
        offload_gradients: Any = False,
        minimal_size: Any = 4096,
        master_dtype: Any = None,
        grad_sum_dtype: Any = None,
        fused_master_step: Any = True,
        overlap: Any = False,
        overlap_timeout_s: Any = None,
        update_on: Any = "host",
        device_staging_mib: Any = None,
        device_weights: Any = None,
        grad_sum_on: Any = "host",
        handoff: Any = "group",
    ) -> "OffloadOptions":
        """Checks config values (YAML strings included) and returns them typed; an option not given
        takes ``OffloadOptimizer``'s default (torchao's wrapper gives only its two).

        Raises:
            ValueError: naming the ``optimizer.<key>`` at fault and the accepted values.
        """
        master = precision_option(master_dtype, key="master_dtype")
        grad_sum = precision_option(grad_sum_dtype, key="grad_sum_dtype")
        fused = flag_option(fused_master_step, key="fused_master_step")
        overlapped = flag_option(overlap, key="overlap")
        offload = flag_option(offload_gradients, key="offload_gradients")
        minimal_size_option(minimal_size)
        if overlap_timeout_s is not None and (
            isinstance(overlap_timeout_s, bool) or not isinstance(overlap_timeout_s, (int, float))
            or not 0 < overlap_timeout_s < math.inf
        ):
            raise ValueError(
                f"optimizer.overlap_timeout_s={overlap_timeout_s!r} must be a positive number of seconds, "
                "or null to wait for host work without a limit."
            )
        if overlap_timeout_s is not None and not overlapped and update_on != "device":
            # Only the overlapped windows wait for host workers; a timeout without them bounds nothing.
            raise ValueError(f"optimizer.overlap_timeout_s={overlap_timeout_s} without optimizer.overlap=True: it "
                             "bounds the overlapped step's waits for host work. Set optimizer.overlap=True, or "
                             "remove it (~optimizer.overlap_timeout_s).")
        _check_values(update_on, device_staging_mib, device_weights, grad_sum_on, handoff)
        if update_on == "device":
            _check_device_update(offload_gradients=offload, master_dtype=master_dtype, grad_sum_dtype=grad_sum_dtype,
                                 grad_sum_on=grad_sum_on, device_weights=device_weights,
                                 overlap_timeout_s=overlap_timeout_s, handoff=handoff)
        elif device_staging_mib is not None:
            raise ValueError(f"optimizer.device_staging_mib={device_staging_mib} with optimizer.update_on=host: the "
                             "bound applies to states staged on the device. Set optimizer.update_on=device, or "
                             "remove it (~optimizer.device_staging_mib).")
        if handoff != "group" and not (offload or overlapped):
            raise ValueError(f"optimizer.handoff={handoff} without optimizer.offload_gradients=True or "
                             "optimizer.overlap=True: gradients then stay on the device until step() and backward "
                             "hands none over. Set one of them, or remove it (~optimizer.handoff).")
        if grad_sum_on == "device" and not offload:
            raise ValueError("optimizer.grad_sum_on=device without optimizer.offload_gradients=True: gradients "
                             "then accumulate on the device, as in plain training, and no host sum is added into. "
                             "Set optimizer.offload_gradients=True, or remove it (~optimizer.grad_sum_on).")
        if grad_sum is not None and not offload:
            # Without offload_gradients the device sums the micro-batches in the parameters' dtype and
            # clipping scales them there; a wider host buffer would only hold a widened copy (and an
            # overlapped step would scale it in the wider dtype, unlike the serial one).
            raise ValueError(f"optimizer.grad_sum_dtype={grad_sum_dtype} without optimizer.offload_gradients=True: "
                             "gradients are then summed on the device in the parameters' dtype, so it would "
                             "change nothing but the host memory. Set optimizer.offload_gradients=True, or "
                             "remove it (~optimizer.grad_sum_dtype).")
        return cls(
            offload_gradients=offload, minimal_size=minimal_size, master_dtype=master,
            grad_sum_dtype=grad_sum, fused_master_step=fused, overlap=overlapped,
            overlap_timeout_s=None if overlap_timeout_s is None else float(overlap_timeout_s),
            update_on=update_on,
            device_staging_mib=DEVICE_STAGING_MIB if device_staging_mib is None else float(device_staging_mib),
            device_weights=device_weights, grad_sum_on=grad_sum_on, handoff=handoff,
        )


def device_staging_bytes(device_staging_mib: Optional[float]) -> int:
    """The ``device_staging_mib`` bound in bytes; ``None`` is the default, 256 MiB."""
    return int((DEVICE_STAGING_MIB if device_staging_mib is None else device_staging_mib) * 2**20)


def _check_values(update_on: Any, device_staging_mib: Any, device_weights: Any, grad_sum_on: Any,
                  handoff: Any) -> None:
    """Refuses a value of ``update_on``, ``device_staging_mib``, ``device_weights``, ``grad_sum_on`` or
    ``handoff`` that no combination takes."""
    if update_on not in UPDATE_ON:
        raise ValueError(f"optimizer.update_on={update_on!r}: use 'host' (updates on host copies, the "
                         "default) or 'device' (states in host memory, updates on the device).")
    if device_staging_mib is not None and (isinstance(device_staging_mib, bool)
                                           or not isinstance(device_staging_mib, (int, float))
                                           or not 0 < device_staging_mib < math.inf):
        raise ValueError(f"optimizer.device_staging_mib={device_staging_mib!r} must be a positive number of "
                         f"MiB (the default is {DEVICE_STAGING_MIB:g}).")
    if device_weights is not None and device_weights not in DEVICE_WEIGHTS:
        raise ValueError(f"optimizer.device_weights={device_weights!r}: use fp8 (FP8 layer weights on the device "
                         "with per-row scales), fp8_per_tensor (one scale per weight), or leave it unset (null) for "
                         "weights in the model's dtype.")
    if grad_sum_on not in GRAD_SUM_ON:
        raise ValueError(f"optimizer.grad_sum_on={grad_sum_on!r}: use 'host' (later micro-batches added into the "
                         "host sums by the host's cores, the default) or 'device' (added on the device).")
    if handoff not in HANDOFF:
        raise ValueError(f"optimizer.handoff={handoff!r}: use 'group' (gradients handed to the engine once per "
                         "transformer layer or bucket, the default) or 'parameter' (each as it is complete).")


def _check_device_update(**given: Any) -> None:
    """Refuses, with ``update_on="device"``, each option of :data:`DEVICE_UPDATE_REFUSES` set away
    from the value a device update takes."""
    for key, (default, why, fix) in DEVICE_UPDATE_REFUSES.items():
        if given[key] != default:
            raise ValueError(f"optimizer.update_on=device with optimizer.{key}={given[key]}: {why}. {fix}.")
