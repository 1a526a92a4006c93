"""A config's component options checked against each component's signature before anything is built."""

import pytest
from omegaconf import OmegaConf

from torchtune_offload.recipe.component_options import component_option_problems
from torchtune_offload.recipe.config import check_recipe_config
from tests.conftest import REPO_ROOT as REPO


def _tiny(*overrides: str):
    return OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / "full.yaml"),
                           OmegaConf.from_dotlist(list(overrides)))


def test_the_shipped_tiny_configs_give_their_components_only_options_they_take():
    for path in sorted((REPO / "configs" / "tiny").glob("*.yaml")):
        assert component_option_problems(OmegaConf.load(path)) == [], path.name


@pytest.mark.parametrize("override, expected", [
    ("lr_scheduler.num_warmup_step=3", "lr_scheduler.num_warmup_step: not an option of "
                                       "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup. "
                                       "Did you mean 'lr_scheduler.num_warmup_steps'?"),
    ("checkpointer.model_typ=LLAMA3", "Did you mean 'checkpointer.model_type'?"),
    ("loss.zzz=1", "loss.zzz: not an option of"),
])
def test_an_option_a_component_does_not_take_is_named_with_the_closest_one(override, expected):
    problems = component_option_problems(_tiny(override))
    assert len(problems) == 1 and expected in problems[0], problems
    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.")):
        check_recipe_config(_tiny(override), recipe="full", device_present=False)


def test_an_option_without_a_close_one_says_how_to_remove_it_and_lists_the_options():
    (problem,) = component_option_problems(_tiny("lr_scheduler.qqqqqqqq=1"))
    assert "Remove it: drop a lr_scheduler.qqqqqqqq=... override, or ~lr_scheduler.qqqqqqqq deletes it" in problem and "num_warmup_steps" in problem


def test_a_key_the_recipes_read_themselves_is_not_a_strangers():
    cfg = _tiny("profiler._component_=torchtune.training.setup_torch_profiler", "profiler.enabled=False",
                "profiler.all_threads=False")
    assert component_option_problems(cfg) == []
    (problem,) = component_option_problems(_tiny("profiler._component_=torchtune.training.setup_torch_profiler",
                                                  "profiler.all_thread=False"))
    assert "profiler.all_thread: not an option" in problem


def test_a_component_that_cannot_be_imported_is_named():
    (problem,) = component_option_problems(_tiny("loss._component_=torchtune.modules.loss.NoSuchLoss"))
    assert problem.startswith("loss._component_=torchtune.modules.loss.NoSuchLoss: cannot be imported")


def test_components_checked_elsewhere_or_taking_any_keyword_are_left_alone():
    # The model and the optimizer are checked by the recipe's build and the optimizer rules; a dataset
    # builder forwards unknown keywords to load_dataset, a DiskLogger to its file.
    assert component_option_problems(_tiny("model.zzz=1", "optimizer.zzz=1", "metric_logger.zzz=1")) == []
