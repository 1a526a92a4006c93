"""Re-sharding the engine's per-rank states to another rank count (``distributed/reshard.py``).

The unit tests stand in for FSDP2's ranks with one engine per ``torch.chunk`` row range of the same
tensors, stepped on the same rows of the same gradients: AdamW is elementwise, so rank ``k`` of
``N`` holds exactly rows ``k`` of the states of one engine over the whole tensors, and re-sharding
``N`` ranks' files must give, bit for bit, what ``M`` such engines hold. The recipe tests run the
distributed recipe for real: two ranks at accumulation 1 train as one rank at accumulation 2 (the
same global batch of one-sample micro-batches, so the same micro-batches), so a run resumed on the
other rank count must continue the uninterrupted one exactly.
"""

import re
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed.test_distributed_recipe import CONFIG, _cfg, _losses, _run_in_process, _tune_run_two_ranks
from tests.optim.side_by_side import assert_same_states
from tests.recipe_harness import load_recipe_module, tiny_asset_overrides
from torchtune_offload.distributed.reshard import (
    ShardLayout,
    rank_files_problems,
    reshard_engine_state,
    resharded_state,
)
from torchtune_offload.distributed.sharded_offload import SHARDED_STATE_FORMAT, ShardedOffloadOptimizer
from torchtune_offload.models import tiny_llama
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.recipe.checkpoints.resume import no_checkpoint_problem
from torchtune_offload.recipe.checkpoints.step_checkpoints import StepCheckpoints
from torchtune_offload.recipe.chosen_optimizer import describe_optimizer

#: Uneven rows: 5 over 2 ranks is 3 + 2, over 3 ranks 2 + 2 + 1; "b" has fewer rows than 3 ranks.
SHAPES = {"w": (5, 3), "b": (2,), "e": (7, 4)}


def chunk_rows(num_rows: int, *, rank: int, num_ranks: int) -> Tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank`` when ``torch.chunk`` cuts ``num_rows`` rows ``num_ranks`` ways
    (FSDP2's cut; a rank past the last piece holds none)."""
    pieces = torch.arange(num_rows).chunk(num_ranks)
    start = sum(len(piece) for piece in pieces[:rank])
    return start, start + (len(pieces[rank]) if rank < len(pieces) else 0)


def _full(dtype: torch.dtype = torch.float32, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


def _engines(num_ranks: int, *, steps: int = 2, dtype: torch.dtype = torch.float32,
             base: str = "torch.optim.AdamW", **options) -> List[OffloadOptimizer]:
    """One engine per rank over that rank's rows, stepped on those rows of the same gradients."""
    weights, engines = _full(dtype), []
    grads = [_full(dtype, seed=1 + step) for step in range(steps)]
    for rank in range(num_ranks):
        rows = {n: slice(*chunk_rows(t.shape[0], rank=rank, num_ranks=num_ranks)) for n, t in weights.items()}
        params = {n: torch.nn.Parameter(t[rows[n]].clone()) for n, t in weights.items()}
        engine = OffloadOptimizer(list(params.items()), base, lr=1e-2, weight_decay=0.1, minimal_size=0, **options)
        for grad in grads:
            for n, p in params.items():
                p.grad = grad[n][rows[n]].clone()
            engine.step()
        engines.append(engine)
    return engines


def _write(engines: List[OffloadOptimizer], folder: Path) -> List[Path]:
    paths = []
    for rank, engine in enumerate(engines):
        paths.append(folder / f"optimizer_rank{rank:05d}.pt")
        torch.save({"format": SHARDED_STATE_FORMAT, "engine": engine.state_dict(), "rank": rank,
                    "world_size": len(engines)}, paths[-1])
    return paths


def _layouts(rank: int, num_ranks: int) -> Dict[str, ShardLayout]:
    return {n: ShardLayout(shape, *chunk_rows(shape[0], rank=rank, num_ranks=num_ranks)) for n, shape in SHAPES.items()}


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("options", [{}, {"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "master_dtype": "fp32"}],
                         ids=["fp32", "bf16", "bf16-fp32-masters"])
def test_states_cut_for_another_rank_count_are_those_of_that_rank_count(tmp_path, old, new, options):
    written = _write(_engines(old, **options), tmp_path)
    assert rank_files_problems(written) == []
    for rank, engine in enumerate(_engines(new, **options)):
        assert_same_states(reshard_engine_state(written, layouts=_layouts(rank, new)), engine.state_dict())


def test_a_single_device_engines_state_is_the_one_rank_case(tmp_path):
    (full,) = _engines(1)
    torch.save(full.state_dict(), tmp_path / "engine.pt")
    # As the single-device recipe's step checkpoint holds it, beside its data position.
    torch.save({"optimizer": full.state_dict(), "dataloader": {}}, tmp_path / "training_state.pt")
    for path in (tmp_path / "engine.pt", tmp_path / "training_state.pt"):
        for rank, engine in enumerate(_engines(2)):
            assert_same_states(reshard_engine_state([path], layouts=_layouts(rank, 2)), engine.state_dict())
    # Among several ranks' files it is no rank's.
    with pytest.raises(ValueError, match="not a state of the engine on FSDP2's shards"):
        reshard_engine_state([tmp_path / "engine.pt"] * 2, layouts=_layouts(0, 1))


def test_a_resharded_state_loads_into_the_sharded_optimizer_and_trains_on_as_the_uninterrupted_run(tmp_path):
    written = _write(_engines(2, steps=2), tmp_path)
    (straight,), (two_steps,) = _engines(1, steps=3), _engines(1, steps=2)
    # The weights after two steps, as a resume reads them, and the uninterrupted run's third gradient.
    model = {n: torch.nn.Parameter(p.detach().clone()) for n, p in zip(SHAPES, two_steps.param_groups[0]["params"])}
    grads = _full(seed=3)
    # A larger minimal_size: this run steps "b" on the device, where the writers stepped it on the host.
    ours = ShardedOffloadOptimizer(list(model.items()), "torch.optim.AdamW", lr=1e-2, weight_decay=0.1,
                                   minimal_size=4)
    ours.load_state_dict(resharded_state(written, optimizer=ours, layouts=_layouts(0, 1), rank=0, world_size=1))
    assert [s["offloaded"] for s in ours.engine.state_dict()["state"].values()] == [True, False, True]
    for n, p in model.items():
        p.grad = grads[n].clone()
    ours.step()
    for n, p in zip(SHAPES, straight.param_groups[0]["params"]):
        assert torch.equal(model[n], p), n
    ours.close()


def test_8bit_states_are_refused_by_name_before_any_is_read(tmp_path):
    written = _write(_engines(2, base="torchtune_offload.AdamW8bit", min_8bit_size=0), tmp_path)
    (problem,) = rank_files_problems(written)
    assert "optimizer.optimizer_class=torchtune_offload.optim.adamw8bit.AdamW8bit" in problem
    assert "requantize" in problem
    with pytest.raises(ValueError, match=r"cannot be re-sharded(.|\n)*AdamW8bit(.|\n)*--nproc_per_node 2"):
        reshard_engine_state(written, layouts=_layouts(0, 1))


def test_a_state_of_unknown_layout_is_refused_by_name(tmp_path):
    written = _write(_engines(2), tmp_path)
    saved = torch.load(written[1], weights_only=True)
    saved["engine"]["state"]["e"]["optimizer"]["state"][0]["blocks"] = torch.zeros(1)
    torch.save(saved, written[1])
    (problem,) = rank_files_problems(written)
    assert "e: state 'blocks' is torch.float32[1], neither shaped as the shard [3, 4] nor a scalar" in problem
    with pytest.raises(ValueError, match="state 'blocks'"):
        reshard_engine_state(written, layouts=_layouts(0, 1))


@pytest.mark.parametrize("change, fragment", [
    (lambda layouts: {**layouts, "x": ShardLayout((4,), 0, 4)}, r"missing \['x'\]"),
    (lambda layouts: {n: l for n, l in layouts.items() if n != "b"}, r"unexpected \['b'\]"),
    (lambda layouts: {**layouts, "w": ShardLayout((5, 4), 0, 5)}, r"w: a shard of \[3, 3\] there, and the model's "
                                                                  r"parameter is \[5, 4\]"),
    (lambda layouts: {**layouts, "w": ShardLayout((6, 3), 0, 6)}, "w: the files hold 5 of its 6 rows"),
    (lambda layouts: {**layouts, "w": ShardLayout((4, 3), 0, 4)}, "w: the files hold more than its 4 rows"),
], ids=["missing", "unexpected", "columns", "fewer-rows", "more-rows"])
def test_names_and_shapes_that_differ_from_the_models_are_refused(tmp_path, change, fragment):
    written = _write(_engines(2), tmp_path)
    with pytest.raises(ValueError, match=fragment):
        reshard_engine_state(written, layouts=change(_layouts(0, 1)))


def test_a_missing_or_misplaced_rank_file_and_disagreeing_steps_are_refused(tmp_path):
    written = _write(_engines(2), tmp_path)
    with pytest.raises(ValueError, match="written by rank 1 of 2, given as rank 0 of 2"):
        reshard_engine_state(written[::-1], layouts=_layouts(0, 1))
    # One rank a step ahead: its step count differs from the other's.
    ahead = _engines(2, steps=3)[1]
    torch.save({"format": SHARDED_STATE_FORMAT, "engine": ahead.state_dict(), "rank": 1, "world_size": 2}, written[1])
    with pytest.raises(ValueError, match="state 'step' is tensor\\(3.\\) there and tensor\\(2.\\) in rank 0's file"):
        reshard_engine_state(written, layouts=_layouts(0, 1))
    written[1].unlink()
    assert rank_files_problems(written) == [f"{written[1]}: rank 1's optimizer state is missing"]
    with pytest.raises(ValueError, match="rank 1's optimizer state is missing"):
        reshard_engine_state(written, layouts=_layouts(0, 1))


# ------------------------------------------------------------- the resume check, from the manifest

ENGINE = {"_component_": "torchtune_offload.OffloadOptimizer", "optimizer_class": "torch.optim.AdamW", "lr": 1e-3}


@pytest.mark.parametrize("base, saved, configured, fragment", [
    ("torch.optim.AdamW", (2, 1, 1), (1, 1, 2), None),
    ("torch.optim.AdamW", (None, 2, 2), (2, 1, 2), None),  # the single-device recipe's engine
    ("torch.optim.AdamW", (2, 1, 1), (1, 1, 1),
     "a global batch of 2 samples; this run's is 1 x 1 x 1 ranks = 1. .* \\(here: gradient_accumulation_steps=2\\)"),
    ("torchtune_offload.AdamW8bit", (2, 1, 1), (1, 1, 2),
     "holds the states of optimizer.optimizer_class=torchtune_offload.optim.adamw8bit.AdamW8bit, written by 2 "
     "ranks, and this run has 1: .*requantize.* resume with tune run --nproc_per_node 2, or start fresh .*"
     "resume_from_checkpoint=False"),
], ids=["2-to-1", "single-device-to-2", "other-global-batch", "8bit"])
def test_another_rank_count_is_checked_from_the_manifest(tmp_path, base, saved, configured, fragment):
    ranks, batch_size, accumulation = saved
    identity = describe_optimizer(OmegaConf.create({**ENGINE, "optimizer_class": base}), in_backward=False).identity
    StepCheckpoints(tmp_path, keep_last=1).save(
        global_step=1, epoch=0, step_in_epoch=1, weights={"w": torch.zeros(2)}, state={}, ranks=ranks,
        batching={"batch_size": batch_size, "gradient_accumulation_steps": accumulation}, optimizer=identity)
    world_size, batch_size, accumulation = configured
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "batch_size": batch_size,
                            "gradient_accumulation_steps": accumulation,
                            "optimizer": {**ENGINE, "optimizer_class": base}})
    problem = no_checkpoint_problem(cfg, world_size=world_size)
    assert (problem is None) if fragment is None else re.search(fragment, problem), problem


# ------------------------------------------------------------- the distributed recipe

STEPS = ["clip_grad_norm=null", "max_steps_per_epoch=4", "epochs=1", "save_every_n_steps=2", "batch_size=1"]
ADAMW = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
         "optimizer.minimal_size=0"]
#: 8-bit states in blocks of 256 elements: with min_8bit_size=1024 every 8-bit tensor's shards (half
#: of 2048 rows x columns and more) start on a block boundary, and no tensor is 8-bit on one rank
#: count and fp32 on the other (none has 1024 to 2047 elements), so the blocks are the same.
EIGHT_BIT = [*ADAMW, "optimizer.optimizer_class=torchtune_offload.AdamW8bit", "optimizer.min_8bit_size=1024"]
TWO, ONE = ["gradient_accumulation_steps=1"], ["gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory) -> Dict[str, Path]:
    """Two-rank runs (AdamW and 8-bit, at once) and one-rank runs of the same global batch."""
    root = tmp_path_factory.mktemp("reshard_runs")
    out = {name: root / name for name in ("two", "one", "two_8bit", "one_8bit")}
    base = tiny_asset_overrides(tiny_assets) + STEPS
    _tune_run_two_ranks(base + ADAMW + TWO + [f"output_dir={out['two']}"],
                        base + EIGHT_BIT + TWO + [f"output_dir={out['two_8bit']}"])
    _run_in_process(base + ADAMW + ONE + [f"output_dir={out['one']}"])
    _run_in_process(base + EIGHT_BIT + ONE + [f"output_dir={out['one_8bit']}"])
    return out


def _weights(out: Path) -> Dict[str, torch.Tensor]:
    return load_file(out / "epoch_0" / "model-00001-of-00001.safetensors")


def _stopped_at_step_2(out: Path, tmp_path: Path) -> Path:
    """A copy of ``out`` as it stood after its step-2 checkpoint."""
    copy = tmp_path / f"{out.name}_stopped"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("epoch_0", "logs"))
    return copy


def test_two_ranks_train_as_one_rank_over_the_same_one_sample_micro_batches(trained):
    """FSDP2 divides the gradients by the rank count (2: exact) and the recipe multiplies the loss
    by it, so with one sample a micro-batch the two runs' arithmetic is the same, bit for bit."""
    for two, one in (("two", "one"), ("two_8bit", "one_8bit")):
        assert _losses(trained[two]) == _losses(trained[one]), two
        a, b = _weights(trained[two]), _weights(trained[one])
        assert all(torch.equal(a[k], b[k]) for k in b), two
    eight_bit = _losses(trained["two_8bit"])
    assert eight_bit[-1] < eight_bit[0], eight_bit


def test_two_ranks_states_resharded_are_one_ranks_and_resume_on_one_rank_exactly(trained, tiny_assets, tmp_path):
    step = Path("checkpoints") / "step_00000002"
    written = [trained["two"] / step / f"optimizer_rank{k:05d}.pt" for k in range(2)]
    layouts = {n: ShardLayout(tuple(p.shape), 0, p.shape[0]) for n, p in tiny_llama().named_parameters()}
    straight = torch.load(trained["one"] / step / "optimizer_rank00000.pt", weights_only=True)["engine"]
    assert_same_states(reshard_engine_state(written, layouts=layouts), straight)
    resumed = _stopped_at_step_2(trained["two"], tmp_path)
    _run_in_process(tiny_asset_overrides(tiny_assets) + STEPS + ADAMW + ONE + [
        f"output_dir={resumed}", "resume_from_checkpoint=True"])
    assert _losses(resumed) == _losses(trained["two"])[2:]
    a, b = _weights(resumed), _weights(trained["two"])
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_8bit_states_on_another_rank_count_are_refused_before_any_weight_is_read(trained, tiny_assets, tmp_path):
    stopped = _stopped_at_step_2(trained["two_8bit"], tmp_path)
    module = load_recipe_module("full_finetune_distributed")
    cfg = _cfg(CONFIG, tiny_asset_overrides(tiny_assets) + STEPS + EIGHT_BIT + ONE + [
        f"output_dir={stopped}", "resume_from_checkpoint=True"])
    with pytest.raises(ValueError) as err:
        module.FullFinetuneRecipeDistributed(cfg)  # the preflight, before the process group or any file
    message = str(err.value)
    assert "AdamW8bit, written by 2 ranks, and this run has 1" in message, message
    assert "resume with tune run --nproc_per_node 2" in message and "resume_from_checkpoint=False" in message


def test_rank_files_that_do_not_belong_together_are_refused_at_load_naming_the_rank_count_to_resume_with(
        trained, tiny_assets, tmp_path):
    """The preflight reads only the manifest; the rank files themselves are checked as the checkpoint
    is loaded, before any weight is read, and refused with the same remedy (here two files of the
    same size swapped, which the manifest's sizes do not catch)."""
    stopped = _stopped_at_step_2(trained["two"], tmp_path)
    first, second = (stopped / "checkpoints" / "step_00000002" / f"optimizer_rank{k:05d}.pt" for k in range(2))
    assert first.stat().st_size == second.stat().st_size
    first.rename(tmp_path / "swap.pt")
    second.rename(first)
    (tmp_path / "swap.pt").rename(second)
    with pytest.raises(ValueError) as err:
        _run_in_process(tiny_asset_overrides(tiny_assets) + STEPS + ADAMW + ONE + [
            f"output_dir={stopped}", "resume_from_checkpoint=True"])
    message = str(err.value)
    assert "was written by 2 rank(s) and its optimizer states cannot be re-sharded to this run's 1" in message, message
    assert f"{first}: written by rank 1 of 2, given as rank 0" in message, message
    assert "To continue, resume with tune run --nproc_per_node 2, or start fresh from its weights" in message, message
