"""Resuming with another kind of optimizer than the one that saved the state is refused, saying how to go on."""

import pytest

from tests.recipe.test_recipes import FULL_OFFLOAD, RESUME, run_recipe


@pytest.mark.parametrize("saved_with, resumed_with, saved_kind", [
    ([], FULL_OFFLOAD, "a plain optimizer"),
    (FULL_OFFLOAD, [], "torchtune_offload.OffloadOptimizer"),
])
def test_resume_with_another_optimizer_is_refused(tiny_assets, tmp_path, saved_with, resumed_with, saved_kind):
    run_recipe("full", tiny_assets, tmp_path, *RESUME, *saved_with, stop_after_epoch=0)
    resume = ["resume_from_checkpoint=True"]
    with pytest.raises(ValueError) as err:
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *resumed_with, *resume)
    message = str(err.value)
    assert f"the checkpoint's optimizer state was written by {saved_kind}" in message
    assert "resume_from_checkpoint=False" in message


def test_another_plain_optimizer_class_is_refused_too(tiny_assets, tmp_path):
    run_recipe("full", tiny_assets, tmp_path, *RESUME, stop_after_epoch=0)
    resume = ["resume_from_checkpoint=True"]
    with pytest.raises(ValueError, match="a plain optimizer with the options"):
        run_recipe("full", tiny_assets, tmp_path, *RESUME, *resume, "optimizer._component_=torch.optim.SGD")


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
