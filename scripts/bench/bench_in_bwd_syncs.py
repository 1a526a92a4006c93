"""bitsandbytes' device synchronizations per step, stepping in backward (torchtune's
``optimizer_in_bwd``) and after it, and the host's time per in-backward step outside its update.

Usage: python scripts/bench/bench_in_bwd_syncs.py [--models 1B,3B,8B] [--steps 20]

bitsandbytes' 8-bit optimizers synchronize the device after each parameter's update, and a paged
one once more at the end of ``step()`` (``bitsandbytes.optim.optimizer.Optimizer8bit.step``:
``sync_gpu``, which calls ``torch.cuda.synchronize()`` for a CUDA tensor). With ``optimizer_in_bwd``
torchtune gives every parameter an optimizer of its own and steps it from the parameter's gradient
hook, so those synchronizations happen inside backward: each empties the GPU's queue, and the GPU
then waits for the launching thread. This script counts them on the CPU, where ``sync_gpu`` is a
no-op that is called all the same: each model's architecture (its layers and parameter tensors as
torchtune builds them, narrowed to a width of 256 so that it runs in seconds) takes one forward and
backward with a ``PagedAdamW8bit`` per parameter stepping in backward, and one with a single
``PagedAdamW8bit`` stepped after backward. It also times the host's work of one in-backward step
outside the update's own call (``bitsandbytes.functional.optimizer_update_8bit_blockwise``, one
kernel launch on a GPU, the update itself on this CPU): what the GPU waits for after each
synchronization. The norms' weights (under bitsandbytes' 4096 elements for 8-bit states) step in
32 bits and are timed whole, their update included; the median is over every parameter's steps.
Prints a markdown table naming the CPU.
"""

import statistics
import time
import warnings
from typing import Dict, List

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import bitsandbytes.optim.optimizer as bnb_optimizer
import torch
from torchtune import training

from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.models.narrow import NARROW_MODELS, models_and_steps, narrow_llama, one_sequence

#: The narrowed models' width, and the tokens of a step.
WIDTH, TOKENS = 256, 64


class Counted:
    """Counts bitsandbytes' device synchronizations and times its update calls while installed."""

    def __init__(self) -> None:
        self.syncs = 0
        self.update_seconds = 0.0
        self._sync, self._update = bnb_optimizer.sync_gpu, bnb_functional.optimizer_update_8bit_blockwise

    def __enter__(self) -> "Counted":
        def sync(t: torch.Tensor) -> None:
            self.syncs += 1
            self._sync(t)

        def update(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._update(*args, **kwargs)
            finally:
                self.update_seconds += time.perf_counter() - start

        bnb_optimizer.sync_gpu = sync
        bnb_functional.optimizer_update_8bit_blockwise = update
        return self

    def __exit__(self, *exc) -> None:
        bnb_optimizer.sync_gpu = self._sync
        bnb_functional.optimizer_update_8bit_blockwise = self._update


def _loss(model: torch.nn.Module) -> torch.Tensor:
    tokens = one_sequence(TOKENS)
    return model(tokens).float().mean()


def measure(name: str, *, steps: int) -> Dict[str, float]:
    """Tensors, synchronizations per step each way, and the median host microseconds of one
    in-backward step (``step()`` and ``zero_grad()``) outside its update call."""
    torch.manual_seed(0)
    model = narrow_llama(name, width=WIDTH, max_seq_len=TOKENS)
    params = list(model.parameters())
    single = bnb.optim.PagedAdamW8bit(params, lr=1e-5)
    with Counted() as counted:
        _loss(model).backward()
        single.step()
    after = counted.syncs
    single.zero_grad(set_to_none=True)

    per_param = {p: bnb.optim.PagedAdamW8bit([p], lr=1e-5) for p in params}
    host: List[float] = []
    for optimizer in per_param.values():  # each in-backward step timed from torchtune's hook
        step, zero = optimizer.step, optimizer.zero_grad

        def timed_step(step=step) -> None:
            start, before = time.perf_counter(), counted.update_seconds
            step()
            host.append(time.perf_counter() - start - (counted.update_seconds - before))

        def timed_zero(zero=zero, set_to_none: bool = True) -> None:
            start = time.perf_counter()
            zero(set_to_none=set_to_none)
            host[-1] += time.perf_counter() - start

        optimizer.step, optimizer.zero_grad = timed_step, timed_zero
    training.register_optim_in_bwd_hooks(model=model, optim_dict=per_param)
    with Counted() as counted:
        _loss(model).backward()
        in_backward = counted.syncs
        host.clear()  # the first step allocates the states: not timed
        for _ in range(steps):
            _loss(model).backward()
    return {"tensors": len(params), "in_backward": in_backward, "after": after,
            "host_us": statistics.median(host) * 1e6}


def main() -> None:
    models, steps = models_and_steps(__doc__, models="1B,3B,8B", steps=20,
                                     steps_help="timed in-backward steps of every parameter")
    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    print(f"{cpu_name()}, torch {torch.__version__}, bitsandbytes {bnb.__version__}; PagedAdamW8bit; host time: "
          f"median of {steps} in-backward steps of every parameter\n")
    print("| model | parameter tensors | synchronizations a step, optimizer_in_bwd (inside backward) "
          "| synchronizations a step, one optimizer (after backward) | host us an in-backward step, outside its update |")
    print("|---|---:|---:|---:|---:|")
    for name in models:
        m = measure(name, steps=steps)
        print(f"| {NARROW_MODELS[name][0]} | {m['tensors']} | {m['in_backward']} | {m['after']} | {m['host_us']:.0f} |")


if __name__ == "__main__":
    main()
