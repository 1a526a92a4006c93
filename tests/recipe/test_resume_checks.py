"""Resuming with another kind of optimizer, rank count or batching than the run that saved the checkpoint is
refused, saying how to go on."""

import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipe.test_recipes import FULL_OFFLOAD, RESUME, run_recipe
from torchtune_offload.recipe.checkpoints.resume import no_checkpoint_problem
from torchtune_offload.recipe.checkpoints.step_checkpoints import StepCheckpoints
from torchtune_offload.recipe.checks.config import ConfigError
from torchtune_offload.recipe.progress import Progress


OFFLOAD_ADAMW = "optimizer._component_=torchtune_offload.optim.offload_optimizer.OffloadOptimizer " \
                "optimizer.optimizer_class=torch.optim.adamw.AdamW"


@pytest.mark.parametrize("saved_with, resumed_with, saved_said, configured_said", [
    ([], FULL_OFFLOAD, "optimizer._component_=torch.optim.adamw.AdamW", OFFLOAD_ADAMW),
    (FULL_OFFLOAD, [], OFFLOAD_ADAMW, "optimizer._component_=torch.optim.adamw.AdamW"),
    ([], ["optimizer._component_=torch.optim.SGD"], "optimizer._component_=torch.optim.adamw.AdamW",
     "optimizer._component_=torch.optim.sgd.SGD"),
    (FULL_OFFLOAD, [*FULL_OFFLOAD, "optimizer.optimizer_class=torchtune_offload.AdamW8bit"], OFFLOAD_ADAMW,
     "optimizer._component_=torchtune_offload.optim.offload_optimizer.OffloadOptimizer "
     "optimizer.optimizer_class=torchtune_offload.optim.adamw8bit.AdamW8bit"),
])
def test_resume_with_another_optimizer_is_refused_before_any_weight_is_read(tiny_assets, tmp_path, saved_with,
                                                                          resumed_with, saved_said, configured_said):
    run_recipe("full", tiny_assets, tmp_path, *RESUME, *saved_with, stop_after_epoch=0)
    resume = ["resume_from_checkpoint=True"]
    # Its manifest names the optimizer, so the recipe's constructor refuses (before the model is built).
    with pytest.raises(ConfigError) as err:
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *resumed_with, *resume,
                   before_train=lambda _: pytest.fail("it trained"))
    message = str(err.value)
    assert f"was saved with {saved_said}, and this config has {configured_said}. " in message, message
    assert f"resume with {saved_said}, or start fresh in another output_dir" in message, message
    # The same optimizer spelt another way resumes.
    if not saved_with:
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *resume, "optimizer._component_=torch.optim.adamw.AdamW")


@pytest.mark.parametrize("saved_with, resumed_with, saved_kind", [
    ([], FULL_OFFLOAD, "a plain optimizer"),
    (FULL_OFFLOAD, [], "torchtune_offload.OffloadOptimizer"),
])
def test_a_checkpoint_that_does_not_name_its_optimizer_is_refused_when_its_state_loads(
        tiny_assets, tmp_path, saved_with, resumed_with, saved_kind):
    # Written before the manifest named the optimizer: the optimizer's own load refuses it.
    run_recipe("full", tiny_assets, tmp_path, *RESUME, *saved_with, stop_after_epoch=0)
    manifest_file = tmp_path / "checkpoints" / "step_00000004" / "complete.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["optimizer"]
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as err:
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *resumed_with, "resume_from_checkpoint=True")
    message = str(err.value)
    assert f"the checkpoint's optimizer state was written by {saved_kind}" in message
    assert "resume_from_checkpoint=False" in message


def test_the_preflight_counts_what_a_resume_loads(tiny_assets, tmp_path):
    run_recipe("full", tiny_assets, tmp_path, *RESUME, *FULL_OFFLOAD, stop_after_epoch=0)
    resume = ["resume_from_checkpoint=True"]
    resumed = run_recipe("full", tiny_assets, tmp_path, *RESUME, *FULL_OFFLOAD, *resume)
    need = resumed.recipe.host_memory
    # The configured weights are read again; the trained ones come from the checkpoint tensor by tensor.
    configured = tiny_assets / "model" / "model.safetensors"
    assert need.phases["loading the checkpoint"]["checkpoint files"] == configured.stat().st_size
    state = tmp_path / "checkpoints" / "step_00000004" / "training_state.pt"
    assert need.phases["training"]["optimizer state being loaded"] == state.stat().st_size


@pytest.mark.parametrize("saved_ranks, world_size, fragment", [
    (None, None, None),
    (2, 2, None),
    (2, None, "was written by the distributed recipe on 2 ranks. Resume it with tune run --nproc_per_node 2"),
    (None, 2, "was written by a single-device recipe"),
    (4, 2, "was written on 4 ranks and this run has 2"),
])
def test_a_checkpoint_is_resumed_only_by_a_run_of_its_rank_count(tmp_path, saved_ranks, world_size, fragment):
    # Read from the manifest alone, before any weight: the recipes call it from their constructor.
    StepCheckpoints(tmp_path, keep_last=1).save(global_step=1, epoch=0, step_in_epoch=1,
                                               weights={"w": torch.zeros(2)}, state={}, ranks=saved_ranks)
    problem = no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path)}), world_size=world_size)
    assert problem is None if fragment is None else fragment in problem


@pytest.mark.parametrize("configured, fragment", [
    ({"batch_size": 4, "gradient_accumulation_steps": 2}, None),
    ({"batch_size": 2, "gradient_accumulation_steps": 2}, "and this config has batch_size=2. "),
    ({"batch_size": 4}, "and this config has gradient_accumulation_steps=1. "),  # its default
    ({"batch_size": 4, "gradient_accumulation_steps": None}, "and this config has gradient_accumulation_steps=1. "),
    ({"batch_size": 2, "gradient_accumulation_steps": None}, "and this config has batch_size=2, "
                                                             "gradient_accumulation_steps=1. "),
    ({"batch_size": 2, "gradient_accumulation_steps": 4},
     "and this config has batch_size=2, gradient_accumulation_steps=4. "),
    ({"batch_size": "four"}, None),  # the config check's to refuse
])
@pytest.mark.parametrize("step_in_epoch", [0, 3])  # at an epoch's start as in its middle
def test_a_checkpoint_is_resumed_only_with_its_batching(tmp_path, configured, fragment, step_in_epoch):
    # Read from the manifest alone, before any weight. Before, a resume with another batch_size went
    # on: the data position and the step counts were read in the new batches.
    saved = {"batch_size": 4, "gradient_accumulation_steps": 2}
    StepCheckpoints(tmp_path, keep_last=1).save(global_step=3, epoch=1, step_in_epoch=step_in_epoch,
                                               weights={"w": torch.zeros(2)}, state={}, batching=saved)
    problem = no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), **configured}))
    if fragment is None:
        assert problem is None, problem
        return
    assert "was saved with batch_size=4, gradient_accumulation_steps=2, " + fragment in problem, problem
    read = {"gradient_accumulation_steps": 1, **{k: v for k, v in configured.items() if v is not None}}
    resume_with = " ".join(f"{k}={saved[k]}" for k in saved if read[k] != saved[k])
    assert f"resume with {resume_with}, or start fresh in another output_dir" in problem, problem


def test_a_checkpoint_without_its_batching_is_resumed_with_a_warning(tmp_path, caplog):
    path = StepCheckpoints(tmp_path, keep_last=1).save(global_step=1, epoch=0, step_in_epoch=1,
                                                       weights={"w": torch.zeros(2)}, state={})
    assert no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), "batch_size": 2})) is None
    StepCheckpoints.load(path)
    assert "does not record the batch_size and gradient_accumulation_steps it was saved with" in caplog.text


def test_the_recipe_refuses_a_resume_with_another_batch_size_before_training(tiny_assets, tmp_path):
    run_recipe("full", tiny_assets, tmp_path, *RESUME, *FULL_OFFLOAD, stop_after_epoch=0)
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000004" / "complete.json").read_text())
    assert manifest["batching"] == {"batch_size": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match="and this config has batch_size=2. ") as err:
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *FULL_OFFLOAD, "batch_size=2",
                   "resume_from_checkpoint=True", before_train=lambda _: pytest.fail("it trained"))
    assert "resume with batch_size=4, or start fresh" in str(err.value)


@pytest.mark.parametrize("measured_first", [True, False])
def test_a_resumed_run_takes_the_checkpoints_max_steps_per_epoch_as_it_says(measured_first, caplog):
    # Before: restore() warned "using the checkpoint's" but the epoch was measured with the config's.
    # The recipes now measure the data before they resume, the distributed one after: both agree.
    class Loader:
        def __len__(self):
            return 12

    settings = type("Settings", (), {"gradient_accumulation_steps": 2, "max_steps_per_epoch": 5})()
    progress = Progress(seed=0, epochs_run=0, total_epochs=2, max_steps_per_epoch=5)
    saved = Progress(seed=0, epochs_run=1, total_epochs=2, max_steps_per_epoch=3, steps_run_in_epoch=2).state()
    if measured_first:
        progress.measure_epoch(Loader(), settings)
        assert progress.steps_per_epoch == 5
    progress.restore(saved)
    if not measured_first:
        progress.measure_epoch(Loader(), settings)
    assert progress.max_steps_per_epoch == 3 and progress.steps_per_epoch == 3
    assert "config max_steps_per_epoch=5 differs from the checkpoint's 3; using the checkpoint's" in caplog.text


def test_a_finished_run_is_not_resumed_and_is_pointed_to_its_final_weights(tiny_assets, tmp_path):
    # Before, its newest step checkpoint (from before the last steps) was resumed without a word: the
    # last steps trained again and the final weights were written anew.
    run_recipe("full", tiny_assets, tmp_path, *RESUME, "save_every_n_steps=3")
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "epochs": 2})
    problem = no_checkpoint_problem(cfg)
    assert f"the run in {tmp_path} finished ({tmp_path / 'epoch_1'} holds its final weights" in problem, problem
    go_on = (f"checkpointer.checkpoint_dir={tmp_path / 'epoch_1'} "
             "checkpointer.checkpoint_files=[model-00001-of-00001.safetensors] with another output_dir")
    assert go_on in problem, problem
    with pytest.raises(ConfigError, match="nothing is left to resume"):
        run_recipe("full", tiny_assets, tmp_path, *RESUME, "save_every_n_steps=3", "resume_from_checkpoint=True")
    # More epochs than it ran: its last epoch's weights are not the final ones, so it resumes.
    assert no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), "epochs": 3})) is None
    # epochs=two is the config check's to refuse (validate catches ValueErrors only): no TypeError here.
    assert no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), "epochs": "two"})) is None


def test_resuming_where_no_checkpoint_was_ever_written_says_so_and_how_to_go_on(tiny_assets, tmp_path):
    # One epoch and no save_every_n_steps: only the final weights are written, no checkpoint.
    run_recipe("full", tiny_assets, tmp_path, *RESUME, "epochs=1")
    problem = no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), "epochs": 1}))
    assert f"{tmp_path} holds no checkpoints/ folder to resume from" in problem, problem  # it named a missing folder
    assert f"checkpointer.checkpoint_dir={tmp_path / 'epoch_0'} checkpointer.checkpoint_files=[" in problem
    # Following the advice trains on (before, the config's checkpoint_files were not in that folder).
    go_on = re.search(r"checkpointer\.checkpoint_dir=(\S+) checkpointer\.checkpoint_files=(\S+) with", problem)
    run_recipe("full", tiny_assets, tmp_path / "on", *RESUME, "epochs=1", *(f"checkpointer.{k}={v}" for k, v in
               zip(("checkpoint_dir", "checkpoint_files"), go_on.groups())))
    assert (tmp_path / "on" / "epoch_0" / ".complete").is_file()


def test_a_finished_adapter_only_run_is_not_sent_to_train_on_from_no_files(tmp_path):
    # save_adapter_weights_only=True: its final folder holds the adapter alone.
    final = tmp_path / "epoch_0"
    final.mkdir()
    (final / "adapter_model.safetensors").write_bytes(b"")
    (final / ".complete").write_text("complete\n")
    problem = no_checkpoint_problem(OmegaConf.create({"output_dir": str(tmp_path), "epochs": 1}))
    assert "checkpoint_files=[]" not in problem, problem
    assert f"Its final folder, {final}, holds no full weights (an adapter only)" in problem, problem
