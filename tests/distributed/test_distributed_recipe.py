"""The distributed recipe, run for real on CPU: two gloo ranks against one process.

The two-rank runs go through ``tune run --nproc_per_node 2`` as a user would; the one-process
references run in this process (without torchrun the recipe makes a one-rank group itself). Every
run sees the same global batch: two ranks read the even and odd samples of what one process reads
at twice the batch size, so the logged losses (the mean over all ranks' tokens) agree to fp32
rounding. The two-rank run also differs in everything that must not change the math: the shard
policy (embedding and output units) and activation checkpointing. Resuming after a kill is
``test_distributed_kill_and_resume.py``.
"""

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests import zygote
from tests.recipe_harness import TUNE, load_recipe_module, tiny_asset_overrides, working_tree_env
from torchtune_offload.optim.host_arena import pinned_allocation_bytes
from torchtune_offload.recipe import check_recipe_config, read_disk_log
from torchtune_offload.recipe.checkpoints.step_checkpoints import complete_checkpoints
from torchtune_offload.recipe.checks import fit

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny" / "full_distributed.yaml"
STEPS = 3  # per epoch; two epochs, so that an intermediate checkpoint is written and resumed
# One process: batch 8, two micro-batches per step. Two ranks: 4 each, the same 16 samples a step.
TRAIN = [f"max_steps_per_epoch={STEPS}", "epochs=2", "gradient_accumulation_steps=2", "clip_grad_norm=1.0"]
TWO_RANKS = ["batch_size=4", "fsdp_shard_policy=[layers,embeddings]", "enable_activation_checkpointing=True"]
ONE_PROCESS = ["batch_size=8", "fsdp_shard_policy=[layers]"]
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(config: Path, overrides: List[str]):
    return OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(overrides))


def _losses(output_dir: Path) -> List[float]:
    return [row["loss"] for row in read_disk_log(output_dir)]


def _run_in_process(overrides: List[str], *, single_device: bool = False):
    if single_device:
        cls = load_recipe_module("full_finetune_single_device").FullFinetuneRecipeSingleDevice
        config = REPO / "configs" / "tiny" / "full.yaml"
    else:
        cls, config = load_recipe_module("full_finetune_distributed").FullFinetuneRecipeDistributed, CONFIG
    cfg = _cfg(config, overrides)
    r = cls(cfg)
    try:
        r.setup(cfg)
        r.train()
    finally:
        r.cleanup()
    assert not dist.is_initialized()
    return r


def _tune_run_two_ranks(*runs: List[str]) -> List[str]:
    """Launches ``tune run --nproc_per_node 2`` once per override list, all at once; returns their outputs."""
    base = [*TUNE, "run", "--nproc_per_node", "2", "recipes/full_finetune_distributed.py", "--config",
            str(CONFIG.relative_to(REPO)), "device=cpu"]
    env = working_tree_env(MASTER_ADDR="127.0.0.1")
    procs = [zygote.Popen(base + overrides, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) for overrides in runs]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-6000:]
    return outputs


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("distributed_runs")
    assets = tiny_asset_overrides(tiny_assets)
    out = {name: root / name for name in ("one", "two")}
    _run_in_process(assets + TRAIN + ONE_PROCESS + [f"output_dir={out['one']}"])
    output = _tune_run_two_ranks(assets + TRAIN + TWO_RANKS + [f"output_dir={out['two']}"])[0]
    (root / "two_ranks_output.txt").write_text(output)
    out["two_ranks_output"] = root / "two_ranks_output.txt"
    return out


def test_the_config_and_the_host_memory_figures_are_printed_once_not_once_per_rank(runs):
    output = runs["two_ranks_output"].read_text()
    assert output.count("Running FullFinetuneRecipeDistributed with resolved config") == 1, output[-6000:]
    # Node-wide figures: once per node (by local rank 0).
    assert output.count("Host memory: the 2 rank(s) on this node (of 2) need about") == 1, output[-6000:]


def test_two_ranks_log_the_losses_of_one_process_over_the_same_global_batch(runs):
    one, two = _losses(runs["one"]), _losses(runs["two"])
    assert len(one) == len(two) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), **LOSS_TOL)


def test_loss_falls(runs):
    losses = _losses(runs["two"])
    assert losses[-1] < losses[0] - 0.5, losses


def test_two_ranks_save_the_full_model_and_optimizer_state_of_one_process(runs):
    for epoch in (0, 1):
        two = load_file(runs["two"] / f"epoch_{epoch}" / "model-00001-of-00001.safetensors")
        one = load_file(runs["one"] / f"epoch_{epoch}" / "model-00001-of-00001.safetensors")
        assert two.keys() == one.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=key)
    # The checkpoint to resume from at epoch 1's start (global step 3), written on each rank count.
    two = torch.load(runs["two"] / "checkpoints" / f"step_{STEPS:08d}" / "training_state.pt", weights_only=False)
    one = torch.load(runs["one"] / "checkpoints" / f"step_{STEPS:08d}" / "training_state.pt", weights_only=False)
    assert two["progress"]["epochs_run"] == one["progress"]["epochs_run"] == 1
    assert len(two["ranks"]) == 2 and len(one["ranks"]) == 1
    states_two, states_one = two["optimizer"]["state"], one["optimizer"]["state"]
    assert states_two.keys() == states_one.keys() and "tok_embeddings.weight" in states_one
    for name in states_one:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(states_two[name][key], states_one[name][key], rtol=1e-3, atol=1e-7)


def test_another_rank_count_is_refused_before_any_weight_is_read(runs, tiny_assets, monkeypatch, tmp_path):
    # The one-process run's checkpoint, resumed by a run that would have two ranks. Without its final
    # weights, as if it had stopped before them: a finished run is refused as finished.
    stopped = tmp_path / "stopped"
    shutil.copytree(runs["one"], stopped, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    module = load_recipe_module("full_finetune_distributed")
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets) + TRAIN + TWO_RANKS + [
        f"output_dir={stopped}", "resume_from_checkpoint=True"])
    with pytest.raises(ValueError) as err:
        module.FullFinetuneRecipeDistributed(cfg)
    message = str(err.value)
    assert f"step_{STEPS:08d} was written on 1 ranks and this run has 2" in message
    assert "resume with tune run --nproc_per_node 1" in message
    assert not dist.is_initialized()


def test_a_resumed_one_process_run_ends_like_the_straight_one(runs, tiny_assets, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs["one"], resumed, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _run_in_process(tiny_asset_overrides(tiny_assets) + TRAIN + ONE_PROCESS + [
        f"output_dir={resumed}", "resume_from_checkpoint=True"])
    assert _losses(resumed) == _losses(runs["one"])[STEPS:]
    a = load_file(resumed / "epoch_1" / "model-00001-of-00001.safetensors")
    b = load_file(runs["one"] / "epoch_1" / "model-00001-of-00001.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


# ------------------------------------------------------------- one process, in this process


def test_sharded_one_process_run_matches_the_single_device_recipe(tiny_assets, tmp_path):
    train = tiny_asset_overrides(tiny_assets) + ["max_steps_per_epoch=4", "batch_size=8", "clip_grad_norm=1.0"]
    _run_in_process(train + [f"output_dir={tmp_path / 'fsdp'}"])
    _run_in_process(train + [f"output_dir={tmp_path / 'single'}"], single_device=True)
    sharded, single = _losses(tmp_path / "fsdp"), _losses(tmp_path / "single")
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), **LOSS_TOL)


def _nbytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard; AdamW's step is a plain tensor)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def test_host_preflight_sizes_the_shards_the_run_holds(tiny_assets, tmp_path):
    recipe = _run_in_process(tiny_asset_overrides(tiny_assets) + [
        "max_steps_per_epoch=2", "batch_size=8", f"output_dir={tmp_path}"])
    need = recipe.host_memory
    train = need.phases["training"]
    shards = list(recipe._model.parameters())
    assert train["parameter shards"] == train["gradient shards"] == _nbytes(shards)
    assert train["optimizer state"] == _nbytes(t for st in recipe._optimizer.optimizer.state.values()
                                               for t in st.values() if isinstance(t, torch.Tensor))
    ckpt = Path(tiny_assets) / "model" / "model.safetensors"
    assert need.phases["loading the checkpoint"] == {"checkpoint files (rank 0)": ckpt.stat().st_size,
                                                      "parameter shards": _nbytes(shards)}


def test_host_preflight_counts_every_rank_on_the_node_and_fsdp_offloads_pinned_rounding(tiny_assets):
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets))
    settings = check_recipe_config(cfg, recipe="distributed")
    one = fit.sharded_host_memory_need(cfg, settings, world_size=1, local_world_size=1)
    two = fit.sharded_host_memory_need(cfg, settings, world_size=2, local_world_size=2)
    other_node = fit.sharded_host_memory_need(cfg, settings, world_size=2, local_world_size=1)
    for part in ("parameter shards", "gradient shards", "optimizer state"):
        # Two ranks hold halves (rounded up per tensor: FSDP2 pads shards to equal rows).
        assert one.phases["training"][part] <= two.phases["training"][part] < one.phases["training"][part] * 1.01
        assert other_node.phases["training"][part] * 2 == two.phases["training"][part]
    gpu = replace(settings, device=torch.device("cuda"))
    assert "training" not in {k for k, v in fit.sharded_host_memory_need(
        cfg, gpu, world_size=2, local_world_size=2).phases.items() if v}  # all on the GPUs
    pinned = fit.sharded_host_memory_need(cfg, replace(gpu, fsdp_cpu_offload=True), world_size=2,
                                                     local_world_size=2).phases["training"]
    model = fit.meta_model(cfg.model, settings)
    rounded = 2 * sum(pinned_allocation_bytes(-(-p.shape[0] // 2) * p[0].numel() * p.element_size())
                      for p in model.parameters())
    assert pinned["parameter shards"] == pinned["gradient shards"] == rounded


def test_host_preflight_counts_the_optimizer_state_rank_0_loads_on_resume(runs, tiny_assets):
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets) + [f"output_dir={runs['one']}", "resume_from_checkpoint=True"])
    settings = check_recipe_config(cfg, recipe="distributed")
    need = fit.sharded_host_memory_need(cfg, settings, world_size=2, local_world_size=2)
    state = runs["one"] / "checkpoints" / f"step_{STEPS:08d}" / "training_state.pt"
    load = need.phases["loading the checkpoint"]
    assert load["optimizer state being loaded (rank 0)"] == state.stat().st_size
    # The configured weights are read on rank 0; the trained ones replace them tensor by tensor.
    assert load["checkpoint files (rank 0)"] == (Path(tiny_assets) / "model" / "model.safetensors").stat().st_size


def test_a_distributed_run_that_does_not_fit_fails_before_the_process_group_starts(tiny_assets, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(fit, "available_host_memory", lambda: 1024)
    module = load_recipe_module("full_finetune_distributed")
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets) + [f"output_dir={tmp_path}"])
    with pytest.raises(ValueError) as err:
        module.FullFinetuneRecipeDistributed(cfg)
    message = str(err.value)
    for text in ("host_memory_check: the run does not fit", "rank(s) on this node", "parameter shards",
                 "host_memory_check=False"):
        assert text in message
    assert not dist.is_initialized()
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets) + [f"output_dir={tmp_path}", "host_memory_check=False"])
    recipe = module.FullFinetuneRecipeDistributed(cfg)
    recipe.cleanup()
    assert recipe.host_memory is None


def test_optimizer_in_backward_steps_shards_like_the_optimizer(tiny_assets, tmp_path):
    train = tiny_asset_overrides(tiny_assets) + ["max_steps_per_epoch=4", "batch_size=8", "clip_grad_norm=null"]
    _run_in_process(train + [f"output_dir={tmp_path / 'after'}"])
    _run_in_process(train + [f"output_dir={tmp_path / 'inside'}", "optimizer_in_bwd=True"])
    after, inside = _losses(tmp_path / "after"), _losses(tmp_path / "inside")
    torch.testing.assert_close(torch.tensor(inside), torch.tensor(after), **LOSS_TOL)
    assert after[-1] < after[0]


@pytest.mark.gpu
def test_fsdp_cpu_offload_trains_like_shards_on_the_device(tiny_assets, tmp_path):
    # FSDP2's CPUOffloadPolicy: shards, gradients and AdamW state on the host, the step there, and
    # the clip norm of host shards all-reduced over gloo beside NCCL.
    train = tiny_asset_overrides(tiny_assets) + ["device=cuda", "max_steps_per_epoch=4", "batch_size=8",
                                                  "gradient_accumulation_steps=2", "clip_grad_norm=1.0"]
    _run_in_process(train + [f"output_dir={tmp_path / 'device'}"])
    _run_in_process(train + [f"output_dir={tmp_path / 'host'}", "fsdp_cpu_offload=True"])
    device, host = _losses(tmp_path / "device"), _losses(tmp_path / "host")
    torch.testing.assert_close(torch.tensor(host), torch.tensor(device), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------- divergence


@pytest.mark.parametrize("optimizer, name", [
    ([], "AdamW"),
    # The engine on the shards with the gradients on the host: the norm it stops on is its own,
    # reduced over both ranks.
    (["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
      "optimizer.minimal_size=0", "optimizer.offload_gradients=True", "optimizer.overlap=True"],
     "ShardedOffloadOptimizer"),
], ids=["adamw", "engine-offload-overlap"])
def test_two_ranks_stop_together_at_the_step_that_diverged(tiny_assets, tmp_path, optimizer, name):
    # lr=1e37: step 1 moves every weight by about 1e37, step 2 overflows. Its loss is the mean over
    # both ranks and its norm the total over both ranks' shards, so both ranks raise at step 2; a rank
    # that went on would hang in the next collective until the timeout.
    cmd = [*TUNE, "run", "--nproc_per_node", "2", "recipes/full_finetune_distributed.py", "--config",
           str(CONFIG.relative_to(REPO)), "device=cpu", *tiny_asset_overrides(tiny_assets),
           "max_steps_per_epoch=4", "batch_size=4", "save_every_n_steps=1", "optimizer.lr=1e37",
           "lr_scheduler.num_warmup_steps=0", f"output_dir={tmp_path}", *optimizer]
    result = zygote.run(cmd, cwd=REPO, env=working_tree_env(MASTER_ADDR="127.0.0.1"), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=400)
    assert result.returncode != 0, result.stdout[-6000:]
    stops = result.stdout.count("TrainingDivergedError: Training diverged at step 2 (epoch 1, step 2 of 4) "
                                f"with optimizer {name}")
    assert stops == 2, result.stdout[-6000:]  # one per rank
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000001"]
    weights = load_file(tmp_path / "checkpoints" / "step_00000001" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


_CHECK_WEIGHTS_ON_RANK = """
import sys, torch, torch.distributed as dist
from torchtune_offload.recipe import Progress, TrainingDivergedError
from torchtune_offload.recipe.divergence import DivergenceGuard
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
model = torch.nn.Linear(2, 2)
if rank == 1:
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
progress = Progress(seed=0, epochs_run=0, total_epochs=1, max_steps_per_epoch=None, steps_run_in_epoch=3,
                    windows_per_epoch=4)
try:
    DivergenceGuard(optimizer_name="AdamW", progress=progress, output_dir=".").check_weights(model)
    print("saved")
except TrainingDivergedError as err:
    print(err)
dist.destroy_process_group()
"""


def test_nonfinite_weights_on_one_rank_stop_every_rank_before_the_save(tmp_path):
    procs = [zygote.Popen([sys.executable, "-c", _CHECK_WEIGHTS_ON_RANK, str(rank), str(tmp_path / "store")],
                          cwd=REPO, env=working_tree_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) for rank in (0, 1)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), out
    assert "1 trainable parameter(s) hold nan or inf (on other ranks)" in out[0], out[0]
    assert "1 trainable parameter(s) hold nan or inf (weight)" in out[1], out[1]


# ------------------------------------------------------------------------------ bad configs


OFFLOAD = ["optimizer.optimizer_class=torch.optim.AdamW", "clip_grad_norm=null"]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        pytest.param(
            ["optimizer._component_=torchtune_offload.OffloadOptimizer", *OFFLOAD, "optimizer.device_weights=fp8"],
            ["optimizer.device_weights=fp8 with this recipe"],
            id="offload-optimizer-fp8"),
        pytest.param(
            ["optimizer._component_=torchtune_offload.CPUOffloadOptimizer", *OFFLOAD],
            ["optimizer._component_=torchtune_offload.CPUOffloadOptimizer", "fsdp_cpu_offload=True"],
            id="torchao"),
        pytest.param(
            ["optimizer._component_=bitsandbytes.optim.PagedAdamW"],
            ["optimizer._component_=bitsandbytes.optim.PagedAdamW", "DTensor"], id="bitsandbytes"),
        pytest.param(["fsdp_cpu_offload=True"], ["fsdp_cpu_offload=True with device=cpu"], id="cpu-offload-on-cpu"),
        pytest.param(["fsdp_shard_policy=[layer]"], ["fsdp_shard_policy[0]='layer'"], id="unknown-builtin"),
        pytest.param(
            ["fsdp_shard_policy=[{module_class: torch.nn.Conv2d}]"],
            ["fsdp_shard_policy: {module_class: torch.nn.modules.conv.Conv2d} selects no module"],
            id="class-matches-nothing"),
        pytest.param(
            ["custom_sharded_layers=[tok_embedings]"],
            ["fsdp_shard_policy: {name_pattern: 'tok_embedings'} selects no module"],
            id="custom-name-matches-nothing"),
        pytest.param(
            ["fsdp_shard_polcy=[layers]"],
            ["fsdp_shard_polcy: unknown config key", "Did you mean 'fsdp_shard_policy'"], id="typo"),
        pytest.param(
            ["optimizer_in_bwd=True", "gradient_accumulation_steps=2", "clip_grad_norm=null"],
            ["gradient_accumulation_steps"], id="in-bwd-accumulation"),
    ],
)
def test_invalid_configs_fail_before_the_process_group_starts(overrides, expected, tmp_path):
    module = load_recipe_module("full_finetune_distributed")
    cfg = _cfg(CONFIG, overrides + [f"output_dir={tmp_path}"])
    with pytest.raises(ValueError) as err:
        module.FullFinetuneRecipeDistributed(cfg)
    for text in expected:
        assert text in str(err.value)
    assert not dist.is_initialized()


def test_the_process_group_backend_serves_host_collectives_beside_the_accelerators():
    """With fsdp_cpu_offload the gradient norm of host shards is all-reduced on the host, so an
    accelerator's group also carries gloo for CPU tensors; a CPU run is gloo alone."""
    backend = load_recipe_module("full_finetune_distributed")._backend
    assert backend(torch.device("cpu")) == "gloo"
    assert backend(torch.device("cuda")) == "cuda:nccl,cpu:gloo"
    assert backend(torch.device("xpu")) == f"xpu:{dist.Backend.default_device_backend_map['xpu']},cpu:gloo"
