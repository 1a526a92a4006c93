"""``python -m torchtune_offload.plan.fsdp_check --config <yaml> [key=value ...] [--nproc-per-node N]``:
one rank's planned device figure against torch's own tracker of FSDP2.

torch's ``FSDPMemTracker`` follows one rank of a real ``fully_shard`` (the recipe's units, its
``fsdp_reshard_after_forward``) on a fake process group (one process, no communication) and fake
tensors (no memory): two micro-batches' forward and backward of the configured model at the per-rank
batch, as the distributed recipe runs them (its activation checkpointing, its loss). Printed, in GiB:
the planner's parts for the config (``plan/fsdp.py``; the optimizer's device state left out, as
the tracker runs no optimizer), FSDP2's own memory at its peak by both (gathered parameters,
all-gather and reduce-scatter buffers, whole gradients), and the tracker's peak by kind; with
``--json``, the same in bytes on the last line. Seconds for the tiny model, about 40 s for llama3_1
8B on two cores.
"""

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtune import modules, training

from torchtune_offload.distributed.policies import shard_model, shard_policy_of
from torchtune_offload.plan.planner import GIB, load_config, plan_variant
from torchtune_offload.plan.step_traces import sequence_length
from torchtune_offload.plan.trace import token_vocab_size
from torchtune_offload.recipe import build_loss, check_recipe_config, loss_of_logits
from torchtune_offload.recipe.checks.fit import meta_model

#: The tracker's kinds that are FSDP2's own memory beside the shards.
FSDP_KINDS = ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER")


class _Tracker(FSDPMemTracker):
    """``FSDPMemTracker`` that also keeps the most of :data:`FSDP_KINDS` alive at once."""

    fsdp_most = 0

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        for snapshot in self._curr_mem_snap.values():
            alive = sum(v for k, v in snapshot.items() if str(k).split(".")[-1] in FSDP_KINDS)
            self.fsdp_most = max(self.fsdp_most, alive)


def tracked(config: str, overrides: List[str], *, ranks: int) -> Dict[str, Any]:
    """One rank's step under torch's tracker (the module docstring): its peak by kind and the most
    of FSDP2's own memory at once, in bytes. Initializes a fake process group in this process."""
    cfg = load_config(config, overrides)
    settings = replace(check_recipe_config(cfg, recipe="distributed", device_present=False),
                       device=torch.device("cpu"), compile=False)
    dist.init_process_group(backend="fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        model = meta_model(cfg.model, settings)
        if settings.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        shard_model(model, policy=shard_policy_of(cfg),
                    reshard_after_forward=settings.fsdp_reshard_after_forward)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model.to_empty(device="cpu")
        with training.set_default_dtype(settings.dtype):  # the RoPE caches read values: made for real
            for module in model.modules():
                if callable(getattr(module, "rope_init", None)):
                    module.rope_init()
        loss_fn = build_loss(cfg.loss, model, settings, verbose=False)
        tracker = _Tracker(model)
        with mode, tracker:
            for _ in range(2):  # the second beside the first's gradient shards, as in accumulation
                tokens = torch.randint(0, token_vocab_size(cfg, model), (settings.batch_size, sequence_length(cfg, None)))
                loss_of_logits(loss_fn, model(tokens), tokens).backward()
                tracker.reset_mod_stats()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        return {"peak": {str(k).split(".")[-1]: int(v) for k, v in peak.items()}, "fsdp_most": tracker.fsdp_most}
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtune_offload.plan.fsdp_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a config of the distributed recipe (YAML)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--json", action="store_true", help="also print the figures in bytes as JSON, last")
    args = p.parse_intermixed_args(argv)
    plan = plan_variant(args.config, args.overrides, "config", recipe="distributed", seq_len=None, baseline=0,
                        nproc_per_node=args.nproc_per_node)
    if plan.problem is not None:
        p.error(f"{args.config}: {plan.problem}")
    planned = {k: v for k, v in plan.device_parts.items() if not k.startswith(("optimizer", "state staging"))}
    fsdp = next(v for k, v in planned.items() if k.startswith("FSDP2's"))
    got = tracked(args.config, args.overrides, ranks=args.nproc_per_node)
    print(f"one rank of {args.nproc_per_node}, {args.config} {' '.join(args.overrides)}")
    print(f"planned (the optimizer's device state left out): {sum(planned.values()) / GIB:.2f} GiB: "
          + ", ".join(f"{k} {v / GIB:.2f}" for k, v in planned.items()))
    print(f"FSDPMemTracker's peak: {got['peak']['Total'] / GIB:.2f} GiB: "
          + ", ".join(f"{k} {v / GIB:.2f}" for k, v in got["peak"].items() if v and k != "Total"))
    print(f"FSDP2's own memory at its peak: planned {fsdp / GIB:.3f} GiB, tracked {got['fsdp_most'] / GIB:.3f} GiB")
    if args.json:
        print(json.dumps({"planned": sum(planned.values()), "planned_fsdp": fsdp, "tracked": got["peak"]["Total"],
                          "tracked_fsdp": got["fsdp_most"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
