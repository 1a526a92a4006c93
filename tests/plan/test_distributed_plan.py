"""The planner's per-rank figures for the distributed recipe (FSDP2 over --nproc-per-node ranks).

FSDP2's own memory is replayed unit by unit (``plan/fsdp.py``): checked by hand on a small decoder
and against torch's ``FSDPMemTracker`` on a fake process group; a rank's device figure adds up its
parts; the host figure is the pre-flight's node-wide one; and llama3_1 8B plans onto two 24 GiB
devices with the shipped config, on meta tensors.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.models.llama3 import llama3

from tests import zygote
from tests.recipe_harness import working_tree_env
from torchtune_offload.bench.variants import VARIANTS
from torchtune_offload.optim.host_memory import optimizer_state_bytes, plan_device_staging
from torchtune_offload.plan.__main__ import main as plan_main
from torchtune_offload.plan.fastest import fastest_fitting
from torchtune_offload.plan.fsdp import ROOT, fsdp_peak, fsdp_units
from torchtune_offload.plan.planner import GIB, load_config, plan_speed, plan_variant, process_baseline
from torchtune_offload.plan.speed import load_machine
from torchtune_offload.plan import trace
from torchtune_offload.plan.step_traces import step_request
from torchtune_offload.plan.trace import trace_training_step
from torchtune_offload.recipe import check_recipe_config
from torchtune_offload.recipe.checks.fit import meta_model, sharded_host_memory_need

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/tiny/full_distributed.yaml"
CONFIG_8B = "configs/llama3_1/8B_full_distributed_offload.yaml"
#: A desktop with 64 GB of RAM, as docs/planner.md plans the 8B configs.
DESKTOP_HOST_GIB = 59.6


def _padded(rows: int, cols: int, world_size: int) -> int:
    """Elements of a weight gathered whole: dim 0 padded to a multiple of the ranks."""
    return math.ceil(rows / world_size) * world_size * cols


def test_units_and_fsdp2s_peak_by_hand():
    # vocab 250 and the 32-row k/v projections do not divide by 3 ranks: every shard is padded.
    with torch.device("meta"):
        model = llama3(vocab_size=250, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                       intermediate_dim=128, max_seq_len=64)
    n = 3
    layer = 4 * sum(_padded(r, c, n) for r, c in [(64, 64), (32, 64), (32, 64), (64, 64),  # q, k, v, output_proj
                                                  (128, 64), (64, 128), (128, 64),  # w1, w2, w3
                                                  (64, 1), (64, 1)])  # the two norms' scales
    early = 4 * (_padded(64, 1, n) + _padded(250, 64, n))  # the final norm and the output: first in backward
    root = 4 * _padded(250, 64, n) + early
    units = fsdp_units(model, OmegaConf.create({"fsdp_shard_policy": ["layers"]}), world_size=n)
    assert [(u.name, u.param_bytes, u.grad_bytes) for u in units] == [
        (ROOT, root, root), ("layers.0", layer, layer), ("layers.1", layer, layer)]
    assert units[0].early_grad_bytes == early
    # The peak: layers.1's backward, its gradients made beside its gathered parameters, layers.0's
    # prefetched all-gather, the root's parameters and the output's and norm's whole gradients.
    peak = fsdp_peak(units, world_size=n, reshard_after_forward=True)
    assert (peak.bytes, peak.where) == (root + early + 3 * layer, "backward of layers.1: its gradients")
    # Without resharding after forward the layers stay gathered: at layers.1's copy-out both layers'
    # parameters, its all-gather buffer and layers.0's (kept until that copy-out ends), and the root.
    kept = fsdp_peak(units, world_size=n, reshard_after_forward=False)
    assert (kept.bytes, kept.where) == (root + 4 * layer, "forward of layers.1: its copy-out")


#: The tiny config at a width where FSDP2's units are most of a rank's memory (3 layers, vocab 8000).
_WIDER = ["device=cuda", "model.vocab_size=8000", "model.embed_dim=256", "model.num_layers=3",
          "model.intermediate_dim=512"]


@pytest.mark.parametrize("ranks, overrides", [
    (2, ["fsdp_shard_policy=[layers]"]), (2, ["fsdp_shard_policy=[layers,embeddings]"]),
    (3, ["fsdp_shard_policy=[layers,embeddings]", "enable_activation_checkpointing=True"]),
    (2, ["fsdp_shard_policy=[layers]", "fsdp_reshard_after_forward=False"])])
def test_the_replay_is_what_fsdp2_holds_in_torchs_own_tracker(ranks, overrides):
    # torch's FSDPMemTracker follows a real fully_shard on a fake process group and fake tensors
    # (plan/fsdp_check.py): the most it sees gathered, all-gathered, reduce-scattered or whole at once
    # is the replay's, to the byte; the rank's whole peak lies under the plan's sum of largest parts.
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan.fsdp_check", "--config", TINY, *_WIDER,
                       *overrides, "--nproc-per-node", str(ranks), "--json"], cwd=REPO, env=working_tree_env(),
                      capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["planned_fsdp"] == got["tracked_fsdp"] > 0
    assert got["tracked"] <= got["planned"] <= 1.3 * got["tracked"]


@pytest.mark.parametrize("overrides", [["dtype=bf16", "enable_activation_checkpointing=True"],
                                       ["fsdp_shard_policy=[layers,embeddings]"]], ids=["checkpointed", "output-unit"])
def test_the_working_peak_of_a_deep_decoder_is_extrapolated_byte_for_byte(monkeypatch, overrides):
    # The activations a rank adds come from the one-device trace, extrapolated from 4 and 5 layers as
    # its peak is; with the output as a unit of its own, under the recipe's loss (projected once).
    cfg = load_config(TINY, ["device=cuda", "model.num_layers=10", *overrides])
    settings = check_recipe_config(cfg, recipe="distributed", device_present=False)
    request = step_request(cfg, settings, recipe="distributed", seq_len=16)
    reduced = request.trace()
    monkeypatch.setattr(trace, "REDUCED_LAYERS", (1000, 1001))  # more layers than the model has: traced whole
    whole = request.trace()
    assert reduced.traced_layers and not whole.traced_layers
    assert reduced.working_bytes == whole.working_bytes > 0


def test_one_ranks_device_figure_adds_up_and_the_host_is_the_preflights():
    overrides = ["device=cuda", "model.vocab_size=501"]  # 501 rows: padded on 2 ranks
    name, ranks = "fsdp2_offload_device_update", 2
    plan = plan_variant(TINY, overrides, name, recipe="distributed", seq_len=None, baseline=GIB, nproc_per_node=ranks)
    assert plan.problem is None and plan.ranks == ranks
    cfg = load_config(TINY, [*overrides, *VARIANTS[name].overrides(TINY)])
    settings = check_recipe_config(cfg, recipe="distributed", device_present=False)
    model = meta_model(cfg.model, settings)
    # One rank's shards, by hand: dim 0 cut in two, the odd row padded.
    shards = {n: torch.empty((math.ceil(p.shape[0] / ranks), *p.shape[1:]), device="meta")
              for n, p in model.named_parameters()}
    shard_bytes = sum(t.numel() * 4 for t in shards.values())
    assert shard_bytes > sum(p.numel() * 4 for p in model.parameters()) / ranks  # the padding
    fsdp = fsdp_peak(fsdp_units(model, cfg, world_size=ranks), world_size=ranks, reshard_after_forward=True)
    working = trace_training_step(cfg, settings, seq_len=cfg.tokenizer.max_seq_len).working_bytes
    small = [t for t in shards.values() if t.numel() < settings.optimizer.offload.minimal_size]
    parts = {"parameter shards (1/2 of each, dim 0 padded)": shard_bytes, "gradient shards": shard_bytes,
             "buffers (not sharded)": plan.device_parts["buffers (not sharded)"],
             f"FSDP2's gathered units and whole gradients at their peak ({fsdp.where})": fsdp.bytes,
             "activations and temporaries at their peak (one device's trace at the per-rank batch)": working,
             "optimizer state (parameters below minimal_size)": optimizer_state_bytes(
                 torch.optim.AdamW, small, settings.optimizer.base_options)[0],
             "state staging (update_on=device)": plan_device_staging(
                 list(shards.items()), base_class=torch.optim.AdamW, options=settings.optimizer.base_options,
                 minimal_size=settings.optimizer.offload.minimal_size, staging_bytes=256 * 2**20)}
    assert plan.device_parts == parts and plan.device_bytes == sum(parts.values())
    # The host: every rank's process, and each rank's engine over its shards as the pre-flight counts it:
    # AdamW's two fp32 states of every offloaded shard (at least 8 bytes an element; the blocks' alignment).
    need = sharded_host_memory_need(cfg, settings, world_size=ranks, local_world_size=ranks)
    assert plan.host_bytes == ranks * GIB + need.peak
    offloaded = sum(t.numel() for t in shards.values() if t.numel() >= settings.optimizer.offload.minimal_size)
    assert ranks * 8 * offloaded <= need.peak <= ranks * 8 * offloaded * 1.01
    assert plan.rank_host_bytes == GIB + need.peak // ranks


@pytest.fixture(scope="module")
def plans_8b():
    """llama3_1 8B on 2 ranks with the shipped config, the fsdp2_ variants beside it (meta tensors:
    seconds; the variants share one trace)."""
    cfg = load_config(CONFIG_8B, [])
    baseline, _ = process_baseline(cfg, device=torch.device("cuda"))
    traces = {}
    return {name: plan_variant(CONFIG_8B, [], name, recipe="distributed", seq_len=None, baseline=baseline,
                               traces=traces, nproc_per_node=2)
            for name in ("config", "fsdp2_adamw", "fsdp2_offload", "fsdp2_offload_8bit", "fsdp2_offload_device_update")}


def test_llama3_1_8b_fits_two_24_gib_devices_with_the_states_in_host_memory(plans_8b):
    device, host = 24 * GIB, int(DESKTOP_HOST_GIB * GIB)
    update_on_device, eight_bit = plans_8b["fsdp2_offload_device_update"], plans_8b["fsdp2_offload_8bit"]
    # update_on=device, bf16 states: each device fits, the host holds under 36 GiB in all.
    assert update_on_device.device_bytes <= device and update_on_device.host_bytes < 36 * GIB
    # The host step with 8-bit states: each device fits, under 52 GiB of host memory in all.
    assert eight_bit.device_bytes <= device and eight_bit.host_bytes < 52 * GIB
    # Plain AdamW's states do not fit the devices; bf16 states with the host step need more than 64 GB of RAM.
    assert plans_8b["fsdp2_adamw"].device_bytes > device
    assert plans_8b["fsdp2_offload"].device_bytes <= device and plans_8b["fsdp2_offload"].host_bytes > host


def test_the_8b_config_runs_the_variant_the_planner_finds_fastest_among_those_that_fit(plans_8b):
    cfg = OmegaConf.load(CONFIG_8B)
    assert cfg.compile is False and cfg.fsdp_shard_policy == ["layers", "embeddings"]
    chosen = check_recipe_config(cfg, recipe="distributed", device_present=False).optimizer
    variant = VARIANTS["fsdp2_offload_device_update"].describe()
    assert (chosen.kind, chosen.base_class, chosen.offload.update_on) == (
        variant.kind, variant.base_class, variant.offload.update_on)
    config = plans_8b["config"]
    assert config.fits(device_budget=24 * GIB, host_budget=int(DESKTOP_HOST_GIB * GIB))
    assert (config.device_bytes, config.host_bytes) == (plans_8b["fsdp2_offload_device_update"].device_bytes,
                                                        plans_8b["fsdp2_offload_device_update"].host_bytes)
    plans = [p for name, p in plans_8b.items() if name != "config"]
    budgets = dict(device_budget=24 * GIB, host_budget=int(DESKTOP_HOST_GIB * GIB))
    changes = {"fsdp2_offload_8bit": "8-bit optimizer states"}
    for machine, overall in (("rtx4090_ddr4", "fsdp2_offload_device_update"), ("rtx4090_ddr5", "fsdp2_offload_8bit")):
        speeds = {p.name: plan_speed(p, load_machine(machine), device_budget=budgets["device_budget"]) for p in plans}
        best = fastest_fitting(plans, speeds, math_changes=changes, **budgets)
        assert (best.overall, best.exact) == (overall, "fsdp2_offload_device_update"), machine
    # On DDR5 the 8-bit host step and the device update are a tie (the config's header says so).
    ddr5 = {p.name: plan_speed(p, load_machine("rtx4090_ddr5"), device_budget=24 * GIB) for p in plans}
    ratio = ddr5["fsdp2_offload_8bit"].step_seconds / ddr5["fsdp2_offload_device_update"].step_seconds
    assert 0.999 < ratio < 1


def test_the_cli_plans_a_distributed_config_per_rank(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--config", TINY, "device=cuda", "--nproc-per-node", "2", "--device-gib", "1", "--host-gib",
                      "64", "--machine", "rtx4090_ddr4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "The distributed recipe over 2 rank(s) on one machine" in text
    assert "without FSDP2's all-gathers and reduce-scatters" in text
    data = OmegaConf.to_container(OmegaConf.load(out))
    assert data["nproc_per_node"] == 2
    assert [p["name"] for p in data["plans"]] == ["config", *(n for n, v in VARIANTS.items() if v.distributed)]
    assert all(p["ranks"] == 2 and p["problem"] is None for p in data["plans"])


@pytest.mark.parametrize("args, message", [
    (["--config", "tiny/full", "--nproc-per-node", "2"], "plans the distributed recipe per rank"),
    (["--config", TINY, "--variants", "config,adamw"], "adamw run the single-device recipe"),
    (["--config", TINY, "--nproc-per-node", "0"], "--nproc-per-node 0: must be at least 1"),
])
def test_what_the_distributed_plan_refuses(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
