"""A config's component options checked against each component's signature before anything is built."""

import re
from pathlib import Path
from typing import Optional

import pytest
import torchtune
from omegaconf import OmegaConf

from torchtune_offload.recipe.checks.component_options import (
    component_option_problems,
    component_removal_problem,
    model_option_problems,
)
from torchtune_offload.recipe.checks.config import check_recipe_config
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


def _tiny_lora(*overrides: str):
    return OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / "lora.yaml"),
                           OmegaConf.from_dotlist(list(overrides)))


def test_every_shipped_config_gives_its_model_builder_options_it_can_use():
    paths = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(paths) > 10
    for path in paths:
        assert model_option_problems(OmegaConf.load(path)) == [], path


@pytest.mark.parametrize("config, override, expected", [
    # A builder checks none of these: each failed inside the build with a TypeError naming no key,
    # after the checkpoint had been read, or later (lora_rank=0 at the first step, dividing by it).
    (_tiny_lora, "model.lora_rank=abc", "model.lora_rank='abc': must be an integer >= 1"),
    (_tiny_lora, "model.lora_rank=0", "model.lora_rank=0: must be an integer >= 1"),
    (_tiny_lora, "model.lora_rank=4.0", "model.lora_rank=4.0: must be an integer >= 1"),
    (_tiny_lora, "model.lora_alpha=x", "model.lora_alpha='x': must be a number"),
    (_tiny_lora, "model.apply_lora_to_mlp=maybe", "model.apply_lora_to_mlp='maybe': must be True or False"),
    (_tiny_lora, "model.lora_dropout=1.0", "model.lora_dropout=1.0: must be a probability, at least 0 and below 1"),
    (_tiny_lora, "model.num_layerz=2", "model.num_layerz: not an option of torchtune_offload.models.lora_tiny_llama. "
                                       "Did you mean 'model.num_layers'?"),
    (_tiny, "model.num_layers=abc", "model.num_layers='abc': must be an integer >= 1 "
                                    "(torchtune_offload.models.tiny_llama takes num_layers)"),
    (_tiny, "model.norm_eps=true", "model.norm_eps=True: must be a number"),
])
def test_a_model_option_its_builder_cannot_use_is_refused_by_key_before_anything_is_built(config, override, expected):
    (problem,) = model_option_problems(config(override))
    assert problem.startswith(expected), problem
    recipe = "lora" if config is _tiny_lora else "full"
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_recipe_config(config(override), recipe=recipe, device_present=False)


def test_good_model_values_pass_with_the_kinds_their_annotations_allow():
    # An int where a float is annotated, a dropout of 0, a null where the annotation is Optional.
    assert model_option_problems(_tiny_lora("model.lora_alpha=8", "model.lora_dropout=0")) == []
    base = {"_component_": "torchtune.models.llama3.llama3", "vocab_size": 512, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "embed_dim": 64, "max_seq_len": 256, "intermediate_dim": None}
    assert model_option_problems(OmegaConf.create({"model": base})) == []
    (problem,) = model_option_problems(OmegaConf.create({"model": {**base, "intermediate_dim": 0}}))
    assert problem.startswith("model.intermediate_dim=0: must be null or an integer >= 1"), problem


def test_a_model_builders_required_argument_is_named_when_missing():
    cfg = OmegaConf.create({"model": {"_component_": "torchtune.models.llama3.llama3", "vocab_size": 512,
                                      "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 64}})
    (problem,) = model_option_problems(cfg)
    assert problem.startswith("model.max_seq_len: required by torchtune.models.llama3.llama3; set it"), problem


def test_a_model_builder_that_cannot_be_imported_is_named_by_the_recipes_check():
    # Before, the recipe met it in torchtune's instantiate, with a traceback, after reading the checkpoint.
    override = "model._component_=torchtune.models.no_such_builder"
    (problem,) = model_option_problems(_tiny(override))
    assert problem.startswith(f"{override}: cannot be imported"), problem
    with pytest.raises(ValueError, match=re.escape(f"{override}: cannot be imported")):
        check_recipe_config(_tiny(override), recipe="full", device_present=False)


def test_torchtunes_own_configs_give_their_model_builders_options_they_can_use():
    # The ranges (ints >= 1, dropouts below 1) hold for torchtune's builders: none of its configs is refused.
    paths = sorted((Path(torchtune.__file__).parents[1] / "recipes" / "configs").rglob("*.yaml"))
    if not paths:
        pytest.skip("this torchtune install ships no recipes/configs")
    checked = 0
    for path in paths:
        problems = model_option_problems(OmegaConf.load(path))
        if problems and "cannot be imported" in problems[0] and "torchvision" in problems[0]:
            continue  # the vision builders need torchvision, not a dependency here
        assert problems == [], path
        checked += 1
    assert checked > 100


def builder_of_a_users_own(*, frozen_layers: int = 0, pad_id: Optional[int] = -1, width: "int | None" = None,
                           dropout: float = 0.0):
    """A model builder from outside torchtune: its ints need not be sizes."""


def test_a_users_own_builder_gets_its_types_checked_but_not_torchtunes_ranges():
    component = f"model._component_={__name__}.builder_of_a_users_own"
    cfg = _tiny(component, "model.frozen_layers=0", "model.pad_id=-1", "model.dropout=1.0")
    assert model_option_problems(cfg) == []
    problems = model_option_problems(_tiny(component, "model.frozen_layers=two", "model.width=abc"))
    assert problems == [
        f"model.frozen_layers='two': must be an integer ({__name__}.builder_of_a_users_own takes frozen_layers).",
        f"model.width='abc': must be null or an integer ({__name__}.builder_of_a_users_own takes width).",
    ], problems


def test_deleting_a_component_on_the_command_line_says_what_works_instead():
    # torchtune's merge refuses ~lr_scheduler and says the key was not found, though the YAML has it.
    data = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "tiny" / "full.yaml"))
    problem = component_removal_problem(data, ["batch_size=2", "~lr_scheduler"])
    assert problem.startswith("~lr_scheduler: torchtune cannot delete a component from the command line") and \
        "give lr_scheduler=null instead" in problem, problem
    assert "model cannot be left out" in component_removal_problem(data, ["~model"])
    assert component_removal_problem(data, ["~tokenizer.max_seq_len", "~shuffle", "~nothing.here"]) is None


def test_a_required_component_nulled_on_the_command_line_is_named():
    # torchtune reads loss=null as loss._component_=null; a recipe would fail in instantiate.
    with pytest.raises(ValueError, match=re.escape("loss._component_ is null (loss=null on the command line sets "
                                                   "it): loss is required")):
        check_recipe_config(_tiny("loss._component_=null"), recipe="full", device_present=False)
    check_recipe_config(_tiny("lr_scheduler._component_=null"), recipe="full", device_present=False)


@pytest.mark.parametrize("override, expected", [
    # Each passed validate and failed in the run, after the optimizer was built, naming no key.
    ("lr_scheduler.num_warmup_steps=abc", "lr_scheduler.num_warmup_steps='abc': must be an integer ("),
    ("lr_scheduler.num_cycles=half", "lr_scheduler.num_cycles='half': must be a number ("),
    ("lr_scheduler.num_warmup_steps='3'", "lr_scheduler.num_warmup_steps='3': must be an integer ("),
    # The recipe passes these itself, overwriting the config's without a word.
    ("lr_scheduler.num_training_steps=100", "lr_scheduler.num_training_steps: the recipe sets it (the run's step "
                                            "count), so a value here would be overwritten."),
    ("checkpointer.should_load_recipe_state=True", "checkpointer.should_load_recipe_state: the recipe sets it "
                                                   "(resume_from_checkpoint)"),
])
def test_a_components_option_value_is_checked_against_its_annotation(override, expected):
    (problem,) = component_option_problems(_tiny(override))
    assert problem.startswith(expected), problem
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_recipe_config(_tiny(override), recipe="full", device_present=False)


def test_options_the_recipe_passes_are_not_offered_as_the_closest():
    (problem,) = component_option_problems(_tiny("lr_scheduler.num_warmup_step=3"))
    assert problem.endswith("Its options: num_cycles, num_warmup_steps."), problem


@pytest.mark.parametrize("override, named", [
    ("optimizer.gradient_accumulation_steps=2", "optimizer.gradient_accumulation_steps: not an option of AdamW. It is "
                                                "a top-level key of the config: give gradient_accumulation_steps=..."),
    ("lr_scheduler.clip_grad_norm=1.0", "lr_scheduler.clip_grad_norm: not an option of torchtune.training."
                                        "lr_schedulers.get_cosine_schedule_with_warmup. It is a top-level key of the "
                                        "config: give clip_grad_norm=..."),
])
def test_a_top_level_key_given_under_a_component_says_where_it_goes(override, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_recipe_config(_tiny(override), recipe="full", device_present=False)
