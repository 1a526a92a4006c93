"""OffloadOptimizer on FSDP2's shards (``distributed/sharded_offload.py``): two ranks on gloo train a
tiny Llama with FSDP2 and torch's AdamW and, side by side, with the engine stepping each rank's
shards; the losses and the final shards are equal, bit for bit, with and without clipping and
accumulation, with host and device updates, with parameters below ``minimal_size`` on the device."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests import zygote
from tests.distributed.test_distributed_recipe import (CONFIG, STEPS, TRAIN, TWO_RANKS, _losses, _run_in_process,
                                                         _tune_run_two_ranks)
from tests.recipe.test_config_check import _cfg as _tiny_cfg
from tests.recipe_harness import tiny_asset_overrides, working_tree_env
from torchtune_offload.distributed.sharded_offload import ShardedOffloadOptimizer
from torchtune_offload.optim.host_arena import NONE, buffer_bytes
from torchtune_offload.recipe import OptimizerKind, check_recipe_config
from torchtune_offload.recipe.checks import fit

REPO = Path(__file__).resolve().parents[2]

#: One rank of the side-by-side run: argv is rank, world size, the rendezvous file and the case.
_RANK = """
import json, sys, time
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torchtune_offload.distributed.sharded_offload import ShardedOffloadOptimizer
from torchtune_offload.optim.host_arena import NONE, buffer_bytes
from torchtune_offload.models import tiny_llama
import torchtune_offload.optim.slot_step as slot_step

rank, world, store, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
if case.get("checked"):  # the whole run on the stream checker's virtual streams
    from torchtune_offload.optim.stream_check import checked_streams
    checked = checked_streams(drop_waits=[tuple(case["drop_wait"])] if case.get("drop_wait") else ())
    checked.__enter__()


def sharded_model():
    torch.manual_seed(0)
    model = tiny_llama()
    for layer in model.layers:
        fully_shard(layer)
    model = fully_shard(model)
    if case.get("prefetch"):  # each unit all-gathers the next one in its pre-forward
        units = [model, *model.layers]
        for unit, following in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([following])
    return model


plain, ours = sharded_model(), sharded_model()
optimizers = {"plain": (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1))}
engine = ShardedOffloadOptimizer(ours.named_parameters(), "torch.optim.AdamW", lr=1e-2, weight_decay=0.1,
                                 **case["options"])
optimizers["ours"] = (ours, engine)
if case.get("delay_s"):
    # Host steps slowed down on purpose, a unit a step job: a forward that does not wait for a
    # unit's own step reads stale shards (joined, the first unit's wait would cover them all).
    slot_step.STEP_JOB_BYTES = 0
    host_step = engine.engine._stepper.host_step
    def slow_host_step(*args, **kwargs):
        time.sleep(case["delay_s"])
        return host_step(*args, **kwargs)
    engine.engine._stepper.host_step = slow_host_step
if case.get("prefetch_unseen"):
    # The control: waits blind to what a unit prefetches (FSDP2's list emptied while they are made).
    states = [m._get_fsdp_state() for m in ours.modules() if hasattr(m, "_get_fsdp_state")]
    kept = [s._states_to_forward_prefetch for s in states]
    for s in states:
        s._states_to_forward_prefetch = []
    engine.register_forward_waits(ours)
    for s, k in zip(states, kept):
        s._states_to_forward_prefetch = k
elif case.get("waits_after_fsdp"):
    # The control: the same waits behind FSDP2's pre-forward hook, after it has all-gathered.
    register = torch.nn.Module.register_forward_pre_hook
    torch.nn.Module.register_forward_pre_hook = lambda self, hook, prepend=False, **kw: register(self, hook, **kw)
    engine.register_forward_waits(ours)
    torch.nn.Module.register_forward_pre_hook = register
else:
    engine.register_forward_waits(ours)
data = torch.Generator().manual_seed(100 + rank)
losses = {name: [] for name in optimizers}
norms = {name: [] for name in optimizers}
for step in range(case["steps"]):
    batches = [torch.randint(0, 128, (2, 16), generator=data) for _ in range(case["accumulation"])]
    for name, (model, optimizer) in optimizers.items():
        total = torch.zeros(())
        for i, tokens in enumerate(batches):
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     tokens[:, 1:].reshape(-1)) / case["accumulation"]
            if name == "ours" and i == len(batches) - 1:
                optimizer.expect_final_backward(clipping=case["clip"] is not None)
            loss.backward()
            total += loss.detach()
        norm_type = case.get("norm_type", 2.0)
        if name == "ours":
            norm = optimizer.grad_norm(norm_type) if case["clip"] is None else optimizer.clip_grad_norm_(case["clip"])
        else:
            # As the distributed recipe clips FSDP2's gradients: the global norm, DTensor's order.
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
            if case["clip"] is not None:
                torch.nn.utils.clip_grads_with_norm_(params, case["clip"], norm)
            norm = norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[name].append(total.item())
        norms[name].append(norm.item())
engine.synchronize()
shards = {name: [p.to_local().clone() for p in model.parameters()] for name, (model, _) in optimizers.items()}
print(json.dumps({
    "losses_equal": losses["plain"] == losses["ours"],
    "norms_equal": norms["plain"] == norms["ours"],
    "shards_equal": all(torch.equal(a, b) for a, b in zip(shards["plain"], shards["ours"])),
    "trained": losses["ours"][0] != losses["ours"][-1],
    "offloaded": engine.engine.memory_report().num_offloaded,
    "handoffs": engine.handoff_count(),
}))
engine.close()
if case.get("checked"):
    checked.__exit__(None, None, None)
dist.destroy_process_group()
"""


def _run_ranks(tmp_path: Path, case: dict, world: int = 2, *, failing: bool = False) -> list:
    """Each rank's result, or with ``failing`` each rank's output (every rank must then fail)."""
    procs = [zygote.Popen([sys.executable, "-c", _RANK, str(rank), str(world), str(tmp_path / "store"), json.dumps(case)],
                          cwd=REPO, env=working_tree_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all((p.returncode != 0) == failing for p in procs), "\n".join(o[-3000:] for o in outs)
    return outs if failing else [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.parametrize("case", [
    dict(accumulation=1, clip=None, options=dict(minimal_size=0)),
    dict(accumulation=3, clip=1.0, options=dict(minimal_size=0)),
    dict(accumulation=3, clip=0.5, options=dict(minimal_size=0, update_on="device")),
    # Gradient shards to the host as FSDP2 reduce-scatters them; host steps beside the next forward.
    dict(accumulation=3, clip=1.0, options=dict(minimal_size=0, offload_gradients=True)),
    dict(accumulation=1, clip=None, options=dict(minimal_size=0, overlap=True)),
    # The default minimal_size: small shards step on the device, in the window too.
    dict(accumulation=2, clip=0.5, options=dict(offload_gradients=True, overlap=True)),
    # Later micro-batches' shards added on the device.
    dict(accumulation=3, clip=1.0, options=dict(minimal_size=0, offload_gradients=True, overlap=True,
                                                grad_sum_on="device")),
], ids=["plain", "clip-accumulate", "device-update", "offload-gradients", "overlap", "overlap-offload-minimal-size",
        "device-sums"])
def test_two_ranks_train_as_fsdp2_with_plain_adamw_bit_for_bit(tmp_path, case):
    results = _run_ranks(tmp_path, dict(case, steps=3))
    for rank, result in enumerate(results):
        assert result["losses_equal"] and result["norms_equal"] and result["shards_equal"], (rank, result)
        assert result["trained"] and result["offloaded"] > 0, (rank, result)
    if case["options"].get("offload_gradients") or case["options"].get("overlap"):
        # One hand-off an FSDP2 unit (the root and two layers) a micro-batch.
        assert results[0]["handoffs"] == 3 * case["accumulation"] * 3, results[0]


@pytest.mark.parametrize("control", [None, "waits_after_fsdp", "prefetch_unseen"])
def test_each_unit_waits_for_its_host_steps_before_fsdp2_all_gathers_it(tmp_path, control):
    """Host steps slowed down on purpose (overlap, explicit forward prefetch): the engine's waits come
    before FSDP2's all-gather of a unit and of the unit it prefetches, so the run is AdamW's bit for
    bit. The controls show that the test sees a stale gather: the same waits behind FSDP2's
    pre-forward hook, or blind to the prefetched unit, train on stale shards."""
    case = dict(accumulation=2, clip=1.0, steps=3, delay_s=0.05, prefetch=True,
                options=dict(minimal_size=0, offload_gradients=True, overlap=True))
    results = _run_ranks(tmp_path, dict(case, **({control: True} if control else {})))
    stale = [not (r["losses_equal"] and r["shards_equal"]) for r in results]
    assert stale == [control is not None] * 2, results


@pytest.mark.parametrize("options", [dict(minimal_size=0, offload_gradients=True, overlap=True),
                                     dict(minimal_size=0, overlap=True, update_on="device")],
                         ids=["host-ring-overlap", "device-update-overlap"])
def test_the_engines_accesses_on_fsdp2s_shards_are_ordered_under_the_stream_checker(tmp_path, options):
    """The whole two-rank run inside ``checked_streams()``: the engine's copies of the gradient shards
    FSDP2 hands over, its host steps and uploads are ordered by its streams (FSDP2's own work runs on
    the current stream there, as it does once FSDP2 has joined its streams into it on a GPU)."""
    results = _run_ranks(tmp_path, dict(accumulation=2, clip=1.0, steps=2, checked=True, options=options))
    assert all(r["losses_equal"] and r["shards_equal"] for r in results), results


def test_the_checker_sees_a_gradient_shard_copied_before_fsdp2_wrote_it(tmp_path):
    """The calibration of the test above: without the copy stream's wait for the current stream,
    where FSDP2's reduce-scatter wrote the shard, the checked run stops on an unordered access."""
    dropped = ["transfer.py", "self.order.wait_stream(self.stream, self.order.current())"]
    outputs = _run_ranks(tmp_path, dict(accumulation=2, clip=1.0, steps=2, checked=True, drop_wait=dropped,
                                        options=dict(minimal_size=0, offload_gradients=True, overlap=True)),
                         failing=True)  # each rank stops at the same access: no collective is left waiting
    assert all("StreamOrderError: unordered accesses" in out and "_take_gradient" in out for out in outputs), outputs


def test_the_total_norm_is_fsdp2s_global_one_for_every_norm_type(tmp_path):
    """``grad_norm`` and clipping with the gradients on the host reduce over the ranks as DTensor
    does, for the 2-norm and for inf (the serial window; an overlapped one takes the 2-norm only)."""
    for norm_type in (2.0, "inf"):
        (tmp_path / str(norm_type)).mkdir()
        results = _run_ranks(tmp_path / str(norm_type), dict(accumulation=2, clip=None, steps=2, norm_type=norm_type,
                                                              options=dict(minimal_size=0, offload_gradients=True)))
        assert all(r["norms_equal"] and r["losses_equal"] for r in results), results


@pytest.mark.parametrize("option, value", [("device_weights", "fp8"), ("handoff", "parameter")])
def test_what_the_engine_cannot_do_on_fsdp2s_shards_is_refused_by_its_key(option, value):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=rf"optimizer\.{option}={value} on FSDP2's shards: .* Remove it"):
        ShardedOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-3, offload_gradients=True,
                                **{option: value})


def test_a_shard_moved_after_the_optimizer_was_built_is_said_not_stepped_stale():
    model = torch.nn.Linear(4, 4)
    optimizer = ShardedOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-3, minimal_size=0)
    model.weight.data = model.weight.data.clone()  # as a re-created shard storage would be
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="moved a parameter shard to new storage"):
        optimizer.step()
    optimizer.close()


def test_an_lr_scheduler_on_it_sets_the_rate_the_engine_steps_with():
    torch.manual_seed(0)
    plain_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ours_model = copy.deepcopy(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    ours = ShardedOffloadOptimizer(ours_model.named_parameters(), "torch.optim.AdamW", lr=1e-2, minimal_size=0)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)) for o in (plain, ours)]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer, scheduler in zip((plain_model, ours_model), (plain, ours), schedulers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    assert ours.engine.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 1e-2 / 4
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), ours_model.parameters()))
    ours.close()


def test_a_state_is_loaded_only_by_the_rank_that_wrote_it():
    model = torch.nn.Linear(4, 4)
    optimizer = ShardedOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-3, minimal_size=0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert (state["rank"], state["world_size"]) == (0, 1)
    optimizer.load_state_dict(state)
    with pytest.raises(ValueError, match="written by rank 1 of 2, and this is rank 0 of 1"):
        optimizer.load_state_dict({**state, "rank": 1, "world_size": 2})
    optimizer.close()


def test_a_recipe_config_naming_it_is_refused_with_why():
    cfg = _tiny_cfg("full", "optimizer._component_=torchtune_offload.distributed.sharded_offload.ShardedOffloadOptimizer")
    with pytest.raises(ValueError, match="steps FSDP2's shards in a training loop of your own"):
        check_recipe_config(cfg, recipe="full")


# ------------------------------------------------------------- the distributed recipe

ENGINE = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
          "optimizer.minimal_size=0"]


def test_the_distributed_recipe_trains_the_shards_with_the_engine_as_with_adamw_and_resumes(tiny_assets, tmp_path):
    """Two ranks, accumulation and clipping: the engine's losses (host or device updates) are FSDP2
    + AdamW's; with 8-bit states the loss falls; a run resumed from its step checkpoint (each rank
    reads its own optimizer file) ends as the straight one."""
    train = tiny_asset_overrides(tiny_assets) + TRAIN + TWO_RANKS
    _tune_run_two_ranks(train + [f"output_dir={tmp_path / 'adamw'}"],
                        train + ENGINE + [f"output_dir={tmp_path / 'engine'}"],
                        train + ENGINE + ["optimizer.update_on=device", f"output_dir={tmp_path / 'device'}"],
                        train + ENGINE + ["optimizer.offload_gradients=True", "optimizer.overlap=True",
                                          f"output_dir={tmp_path / 'overlap'}"],
                        train + ENGINE + ["optimizer.optimizer_class=torchtune_offload.AdamW8bit",
                                          "optimizer.offload_gradients=True", "optimizer.overlap=True",
                                          f"output_dir={tmp_path / 'eight_bit'}"])
    assert (_losses(tmp_path / "engine") == _losses(tmp_path / "device") == _losses(tmp_path / "overlap")
            == _losses(tmp_path / "adamw"))
    # 8-bit states inside each rank's shards (gradients offloaded, steps overlapped): not AdamW's
    # math, and the loss falls as with it.
    eight_bit = _losses(tmp_path / "eight_bit")
    assert eight_bit[-1] < eight_bit[0] - 0.5, eight_bit
    checkpoint = sorted((tmp_path / "engine" / "checkpoints").glob("step_*"))[0]
    assert sorted(p.name for p in checkpoint.glob("optimizer_rank*.pt")) == ["optimizer_rank00000.pt",
                                                                             "optimizer_rank00001.pt"]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "engine", resumed, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _tune_run_two_ranks(train + ENGINE + [f"output_dir={resumed}", "resume_from_checkpoint=True"])
    assert _losses(resumed) == _losses(tmp_path / "engine")[STEPS:]
    a = load_file(resumed / "epoch_1" / "model-00001-of-00001.safetensors")
    b = load_file(tmp_path / "engine" / "epoch_1" / "model-00001-of-00001.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [["optimizer.offload_gradients=True", "optimizer.overlap=True"],
                                     ["optimizer.update_on=device", "optimizer.overlap=True"]],
                         ids=["host-ring-overlap", "device-update-overlap"])
def test_the_engine_on_one_cuda_ranks_shards_trains_as_fsdp2_with_adamw(tiny_assets, tmp_path, options):
    """FSDP2 on one CUDA rank: the gradient shards reach the engine from FSDP2's reduce-scatter stream
    (its hooks' copies wait on the current stream, which FSDP2 has made its reduce-scatter stream
    there) and each unit waits for its uploads before FSDP2 all-gathers it. The losses are FSDP2 +
    AdamW's; where the engine measures a host sum's norm on the CPU and FSDP2 a device gradient's
    with CUDA's multi-tensor kernel, their last bits may differ, hence the tolerance."""
    train = tiny_asset_overrides(tiny_assets) + ["device=cuda", "max_steps_per_epoch=4", "batch_size=8",
                                                  "gradient_accumulation_steps=2", "clip_grad_norm=1.0"]
    _run_in_process(train + [f"output_dir={tmp_path / 'adamw'}"])
    _run_in_process(train + ENGINE + options + [f"output_dir={tmp_path / 'engine'}"])
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "engine")), torch.tensor(_losses(tmp_path / "adamw")),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, fragment", [
    (["optimizer.device_weights=fp8"], "optimizer.device_weights=fp8 with this recipe: FSDP2 shards"),
    (["fsdp_cpu_offload=True", "device=cuda"], "fsdp_cpu_offload=True with optimizer._component_=torchtune_offload"),
])
def test_what_the_engine_cannot_do_on_shards_is_refused_by_the_recipes_check(overrides, fragment):
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(ENGINE + overrides))
    with pytest.raises(ValueError) as err:
        check_recipe_config(cfg, recipe="distributed", device_present=False)
    assert fragment in str(err.value), str(err.value)


def test_the_host_preflight_counts_each_ranks_engine_over_its_shards(tiny_assets):
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(tiny_asset_overrides(tiny_assets) + ENGINE))
    settings = check_recipe_config(cfg, recipe="distributed", device_present=False)
    assert settings.optimizer.kind is OptimizerKind.SHARDED_ENGINE
    need = fit.sharded_host_memory_need(cfg, settings, world_size=2, local_world_size=2)
    copies = need.phases["training"]["parameter copies (engine, all ranks)"]
    model = fit.meta_model(cfg.model, settings)
    # Two ranks on this node, each with a copy of its shards (dim 0 split in two), each buffer aligned.
    shard_bytes = sum(buffer_bytes(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * p.element_size(), pinning=NONE)
                      for p in model.parameters())
    assert copies == 2 * shard_bytes, (copies, shard_bytes)
    # AdamW's two states a shard element, unaligned, and a step count a tensor.
    raw = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())
    state = need.phases["training"]["optimizer state (engine, all ranks)"]
    assert 2 * 2 * raw <= state <= 2 * 2 * raw + 2 * 8 * len(list(model.parameters())), (state, raw)
