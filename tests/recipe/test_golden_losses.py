"""Refactors change no computation: the recipes' losses and gradient norms, bit for bit.

``golden_losses.json`` holds what nine representative runs logged (full, LoRA and distributed
recipes; plain AdamW, ``OffloadOptimizer`` with and without offloaded gradients, optimizer in
backward, accumulation, clipping, an epoch-boundary checkpoint) on the main branch before the
layout refactor. A change that is meant to alter the numbers must say so and record them anew
(the recording settings are the ones below).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipe_harness import load_recipe_module, tiny_asset_overrides
from torchtune_offload.recipe import read_disk_log

REPO = Path(__file__).resolve().parents[2]
RECORDING = json.loads((Path(__file__).parent / "golden_losses.json").read_text())
GOLDEN = RECORDING["runs"]
OFFLOAD = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW"]
FULL = ["max_steps_per_epoch=5", "batch_size=4", "gradient_accumulation_steps=3", "clip_grad_norm=0.5"]
LORA = ["max_steps_per_epoch=12", "batch_size=4", "gradient_accumulation_steps=2", "clip_grad_norm=0.5"]
RUNS = {
    "full_adamw": ("full", FULL),
    "full_offload": ("full", FULL + OFFLOAD + ["optimizer.minimal_size=1024"]),
    "full_offload_grads": ("full", FULL + OFFLOAD + ["optimizer.minimal_size=1024", "optimizer.offload_gradients=True"]),
    "full_in_bwd": ("full", ["max_steps_per_epoch=5", "batch_size=4", "optimizer_in_bwd=True", "clip_grad_norm=null"]),
    "full_resume_2ep": ("full", ["epochs=2", "max_steps_per_epoch=4", "batch_size=4", "gradient_accumulation_steps=2",
                                 "clip_grad_norm=0.5", *OFFLOAD, "optimizer.minimal_size=1024"]),
    "lora_adamw": ("lora", LORA),
    "lora_offload": ("lora", LORA + OFFLOAD + ["optimizer.minimal_size=256"]),
    "lora_offload_grads": ("lora", LORA + OFFLOAD + ["optimizer.minimal_size=256", "optimizer.offload_gradients=True"]),
    "dist_1proc": ("distributed", ["max_steps_per_epoch=3", "epochs=2", "gradient_accumulation_steps=2",
                                   "clip_grad_norm=1.0", "batch_size=8", "fsdp_shard_policy=[layers,embeddings]",
                                   "enable_activation_checkpointing=True"]),
}
# Overlapped host steps run the same operations at other moments: the serial runs' recordings hold.
OVERLAPPED = {name: RUNS[name] for name in ("full_offload", "full_offload_grads", "full_resume_2ep", "lora_offload_grads")}
RECIPES = {
    "full": ("full_finetune_single_device", "FullFinetuneRecipeSingleDevice", "full.yaml"),
    "lora": ("lora_finetune_single_device", "LoRAFinetuneRecipeSingleDevice", "lora.yaml"),
    "distributed": ("full_finetune_distributed", "FullFinetuneRecipeDistributed", "full_distributed.yaml"),
}


@pytest.fixture(autouse=True)
def _as_recorded(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # reductions may split differently on another thread count
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    yield
    torch.set_num_threads(threads)


def test_every_golden_run_is_replayed():
    assert set(RUNS) == set(GOLDEN)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="recorded with 2 threads")
@pytest.mark.skipif(torch.__version__ != RECORDING["torch"], reason=f"recorded with torch {RECORDING['torch']}")
@pytest.mark.parametrize("name, overlap", [(n, False) for n in sorted(RUNS)] + [(n, True) for n in sorted(OVERLAPPED)])
def test_losses_are_bit_identical_to_the_recording(name, overlap, tiny_assets, tmp_path):
    kind, overrides = RUNS[name]
    overrides = [*overrides, "optimizer.overlap=True"] if overlap else overrides
    module, cls, config = RECIPES[kind]
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO / "configs" / "tiny" / config),
        OmegaConf.from_dotlist([f"output_dir={tmp_path}", *tiny_asset_overrides(tiny_assets), *overrides]),
    )
    recipe = getattr(load_recipe_module(module), cls)(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()
    logged = [{k: row[k] for k in ("loss", "grad_norm") if k in row} for row in read_disk_log(tmp_path)]
    expected = [{k: float(v) for k, v in row.items()} for row in GOLDEN[name]]
    assert logged == expected
