"""The optimizer variants, listed once: what the sweep runs, the planner plans, ``compare`` and
``scripts/plan_vs_sweep.py`` name.

A variant is a choice of optimizer (the ``optimizer:`` keys it sets), the training settings that
choice needs (``paged_adamw8bit_in_bwd``, torchtune's own 8B single-device setting, steps inside
backward, so it runs without clipping and without accumulation) and the recipe it runs (the
``fsdp2_`` variants: the distributed one, over several ranks). Applied to a config
(:meth:`Variant.overrides`), it gives the same run wherever its name is used. :meth:`Variant.describe`
is its optimizer as the recipes describe it (``recipe/chosen_optimizer.py``).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from omegaconf import OmegaConf

from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, describe_optimizer

_ADAMW = "torch.optim.AdamW"
#: The recipes a variant runs, as ``recipes/<name>.py``.
SINGLE_DEVICE, DISTRIBUTED = "full_finetune_single_device", "full_finetune_distributed"
_ENGINE = "torchtune_offload.OffloadOptimizer"
#: The ``optimizer:`` keys only an offloader takes: a variant that does not set one removes it from
#: the config (plain optimizers refuse them).
OFFLOAD_ONLY_KEYS = ("optimizer_class", *(f.name for f in dataclasses.fields(OffloadOptions)))


@dataclass(frozen=True)
class Variant:
    """One optimizer variant.

    Attributes:
        name: how the sweep, the planner and ``compare`` name it.
        description: what it is, in a few words.
        optimizer: the ``optimizer:`` keys it sets.
        settings: top-level keys that are part of its choice of optimizer (``optimizer_in_bwd=True``),
            set like its ``optimizer:`` keys (the sweep refuses a shared override of them).
        needs: training settings its optimizer needs (``key=value``), applied after the shared
            overrides, which they replace for this variant alone (the sweep says so).
        recipe: the recipe it runs: the single-device full fine-tune, or the distributed one
            (FSDP2 over ``--nproc-per-node`` ranks, which the planner plans per rank).
    """

    name: str
    description: str
    optimizer: Mapping[str, Any]
    settings: Tuple[str, ...] = field(default=())
    needs: Tuple[str, ...] = field(default=())
    recipe: str = SINGLE_DEVICE

    @property
    def distributed(self) -> bool:
        return self.recipe == DISTRIBUTED

    @property
    def in_backward(self) -> bool:
        return "optimizer_in_bwd=True" in self.settings

    def describe(self) -> ChosenOptimizer:
        """Its optimizer, described as a recipe describes the optimizer it runs (the base optimizer's
        options are the config's, so those here are its defaults)."""
        return describe_optimizer(OmegaConf.create(dict(self.optimizer)), in_backward=self.in_backward,
                                  sharded=self.distributed)

    def choice_overrides(self, config: str) -> List[str]:
        """Command-line overrides that turn ``config``'s optimizer into this variant's: its
        ``optimizer:`` keys and its settings."""
        present = OmegaConf.load(config).optimizer
        # Offload-only keys the variant does not set are deleted (plain optimizers reject them).
        drop = [f"~optimizer.{k}" for k in OFFLOAD_ONLY_KEYS if k in present and k not in self.optimizer]
        return drop + [f"optimizer.{k}={v}" for k, v in self.optimizer.items()] + list(self.settings)

    def overrides(self, config: str) -> List[str]:
        """Command-line overrides that turn ``config``'s run into this variant's: its choice, then
        what it needs, which comes last wherever it runs, so it wins over the user's overrides."""
        return self.choice_overrides(config) + list(self.needs)

    def replaced(self, overrides: Iterable[str]) -> List[str]:
        """Those of ``overrides`` whose keys this variant's needs set otherwise."""
        mine = {s.split("=", 1)[0] for s in self.needs}
        return [o for o in overrides if o.split("=", 1)[0].lstrip("~+") in mine]


def _engine(name: str, description: str, **keys: Any) -> Variant:
    """A variant of this project's ``OffloadOptimizer`` over torch's AdamW."""
    return Variant(name, description, {"_component_": _ENGINE, "optimizer_class": _ADAMW, **keys})


_ALL = (
    Variant("adamw", "torch AdamW, all on the device", {"_component_": _ADAMW}),
    Variant("paged_adamw", "bitsandbytes, 32-bit paged states", {"_component_": "bitsandbytes.optim.PagedAdamW"}),
    Variant("paged_adamw8bit", "bitsandbytes, 8-bit paged states",
            {"_component_": "bitsandbytes.optim.PagedAdamW8bit"}),
    # torchtune refuses clipping and accumulation with optimizer_in_bwd: the variant runs without both.
    Variant("paged_adamw8bit_in_bwd", "torchtune's 8B single-device setting: 8-bit paged, stepping in backward, "
            "no clipping, no accumulation", {"_component_": "bitsandbytes.optim.PagedAdamW8bit"},
            settings=("optimizer_in_bwd=True",), needs=("clip_grad_norm=null", "gradient_accumulation_steps=1")),
    Variant("torchao", "torchao CPUOffloadOptimizer",
            {"_component_": "torchtune_offload.CPUOffloadOptimizer", "optimizer_class": _ADAMW}),
    Variant("torchao_grads", "torchao CPUOffloadOptimizer, offload_gradients",
            {"_component_": "torchtune_offload.CPUOffloadOptimizer", "optimizer_class": _ADAMW,
             "offload_gradients": True}),
    _engine("offload", "this project's OffloadOptimizer"),
    _engine("offload_grads", "OffloadOptimizer, offload_gradients", offload_gradients=True),
    _engine("offload_overlap", "OffloadOptimizer, host step overlapped with GPU work", overlap=True),
    _engine("offload_grads_overlap", "OffloadOptimizer, offload_gradients, host step overlapped with GPU work",
            offload_gradients=True, overlap=True),
    # With accumulation only: without it there is no later micro-batch, and this is offload_grads_overlap.
    _engine("offload_grads_overlap_device_sums", "OffloadOptimizer, offload_gradients, overlap, later micro-batches "
            "added into their host sums on the device", offload_gradients=True, overlap=True, grad_sum_on="device"),
    _engine("offload_master_overlap", "OffloadOptimizer, offload_gradients, overlap, fp32 master weights and states "
            "on the host", offload_gradients=True, overlap=True, master_dtype="fp32"),
    _engine("offload_grads_8bit", "OffloadOptimizer, offload_gradients, 8-bit AdamW states on the host",
            optimizer_class="torchtune_offload.AdamW8bit", offload_gradients=True),
    _engine("offload_grads_8bit_fp8", "OffloadOptimizer, offload_gradients, 8-bit AdamW states on the host, FP8 "
            "layer weights on the device", optimizer_class="torchtune_offload.AdamW8bit", offload_gradients=True,
            device_weights="fp8"),
    _engine("offload_device_update", "OffloadOptimizer, states in host memory, updates on the device",
            update_on="device"),
    _engine("offload_device_update_overlap", "OffloadOptimizer, states in host memory, updates on the device in the "
            "next forward's order", update_on="device", overlap=True),
    # FSDP2 over --nproc-per-node ranks (the distributed recipe).
    Variant("fsdp2_adamw", "FSDP2, torch AdamW on the devices' shards", {"_component_": _ADAMW}, recipe=DISTRIBUTED),
    Variant("fsdp2_cpu_offload", "FSDP2 with its CPUOffloadPolicy: shards, gradients and AdamW on the host",
            {"_component_": _ADAMW}, settings=("fsdp_cpu_offload=True",), recipe=DISTRIBUTED),
    Variant("fsdp2_offload", "FSDP2, OffloadOptimizer on each rank's shards",
            {"_component_": _ENGINE, "optimizer_class": _ADAMW}, recipe=DISTRIBUTED),
    Variant("fsdp2_offload_8bit", "FSDP2, OffloadOptimizer on each rank's shards, 8-bit AdamW states",
            {"_component_": _ENGINE, "optimizer_class": "torchtune_offload.AdamW8bit"}, recipe=DISTRIBUTED),
    Variant("fsdp2_offload_8bit_grads_overlap", "FSDP2, OffloadOptimizer on each rank's shards, 8-bit AdamW states, "
            "offload_gradients, host steps overlapped with the next forward",
            {"_component_": _ENGINE, "optimizer_class": "torchtune_offload.AdamW8bit", "offload_gradients": True,
             "overlap": True}, recipe=DISTRIBUTED),
    Variant("fsdp2_offload_device_update", "FSDP2, OffloadOptimizer on each rank's shards, states in host memory, "
            "updates on the device", {"_component_": _ENGINE, "optimizer_class": _ADAMW, "update_on": "device"},
            recipe=DISTRIBUTED),
)

#: Every variant, by name, in the order tables list them.
VARIANTS: Dict[str, Variant] = {v.name: v for v in _ALL}
#: Those of the single-device recipe: the sweep's and the planner's defaults.
SINGLE_DEVICE_VARIANTS = [name for name, v in VARIANTS.items() if not v.distributed]
#: Those of the distributed recipe (FSDP2): the planner's for a config of that recipe.
DISTRIBUTED_VARIANTS = [name for name, v in VARIANTS.items() if v.distributed]


def legend(names: Iterable[str]) -> str:
    """The block printed under a table whose rows the sweep named: ``name: description`` for each of
    ``names`` that is a variant, so a reader of ``compare`` or ``plan_vs_sweep`` sees what each ran;
    empty where none is."""
    lines = [f"  {name}: {VARIANTS[name].description}" for name in names if name in VARIANTS]
    return "\nVariants (torchtune_offload/bench/variants.py):\n" + "\n".join(lines) if lines else ""
