"""Missing or damaged files are refused in the recipe's __init__, naming the key, the file and the fix."""

import shutil
import sys

import datasets
import huggingface_hub
import pytest
from omegaconf import OmegaConf

from tests.recipe.test_recipes import _config, _load_recipe_class
from torchtune_offload.recipe.checks import file_checks
from torchtune_offload.recipe.checks.config import ConfigError
from torchtune_offload.recipe.checks.file_checks import file_problems, safetensors_problem
from torchtune_offload.recipe.checks.preflight import preflight
from torchtune_offload.recipe.dataset_build import build_dataset, dataset_build_problems


@pytest.fixture
def assets_copy(tiny_assets, tmp_path):
    """A private copy of the tiny assets, to damage."""
    return shutil.copytree(tiny_assets, tmp_path / "assets")


def _refusal(kind, assets, tmp_path, *overrides):
    cfg = _config(kind, assets, tmp_path / "out", list(overrides))
    with pytest.raises(ValueError) as err:
        _load_recipe_class(kind)(cfg)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    return str(err.value)


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_missing_checkpoint_dir(assets_copy, tmp_path):
    message = _refusal("full", assets_copy, tmp_path, f"checkpointer.checkpoint_dir={tmp_path / 'nope'}")
    assert f"checkpointer.checkpoint_dir={tmp_path / 'nope'}: no such directory" in message


def test_missing_checkpoint_file(assets_copy, tmp_path):
    message = _refusal("lora", assets_copy, tmp_path, "checkpointer.checkpoint_files=[model-2.safetensors]")
    assert "checkpointer.checkpoint_files: model-2.safetensors is not in" in message
    assert "List the files that are there (weight files: model.safetensors)." in message  # what to list instead


@pytest.mark.parametrize("keep, why", [(5000, "truncated"), (1000, "header claims"), (4, "no readable safetensors header")])
def test_damaged_safetensors(assets_copy, tmp_path, keep, why):
    _truncate(assets_copy / "model" / "model.safetensors", keep)
    message = _refusal("full", assets_copy, tmp_path)
    assert "is not a complete safetensors file" in message and why in message and "Download it again" in message


def test_the_intact_file_passes(tiny_assets):
    assert safetensors_problem(tiny_assets / "model" / "model.safetensors") is None


@pytest.mark.parametrize("key", ["path", "special_tokens_path"])
def test_missing_tokenizer_files(assets_copy, tmp_path, key):
    message = _refusal("full", assets_copy, tmp_path, f"tokenizer.{key}={tmp_path / 'tok.model'}")
    assert f"tokenizer.{key}={tmp_path / 'tok.model'}: no such file" in message


@pytest.mark.parametrize("content, why", [
    ("", "it is empty"),
    ('{"input": "a", "output": "b"}\nnot json\n', "line 2 is not JSON"),
])
def test_bad_dataset_file(assets_copy, tmp_path, content, why):
    (assets_copy / "data" / "train.json").write_text(content)
    message = _refusal("full", assets_copy, tmp_path)
    assert "dataset.data_files:" in message and why in message


def test_missing_dataset_file(assets_copy, tmp_path):
    message = _refusal("full", assets_copy, tmp_path, f"dataset.data_files={tmp_path / 'd.json'}")
    assert f"dataset.data_files: {tmp_path / 'd.json'} not found" in message


def test_every_file_problem_is_listed_at_once(assets_copy, tmp_path):
    (assets_copy / "data" / "train.json").write_text("")
    cfg = _config("full", assets_copy, tmp_path, [f"tokenizer.path={tmp_path / 'x'}",
                                                  f"checkpointer.checkpoint_dir={tmp_path / 'y'}"])
    assert len(file_problems(cfg)) == 3


def test_the_distributed_recipe_checks_files_with_its_config_too(assets_copy, tmp_path):
    from omegaconf import OmegaConf

    from tests.distributed.test_distributed_recipe import CONFIG
    from tests.recipe_harness import load_recipe_module, tiny_asset_overrides

    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(
        [*tiny_asset_overrides(assets_copy), "device=cpu", f"output_dir={tmp_path}",
         f"tokenizer.path={tmp_path / 'gone'}", "batch_size=0"]))
    with pytest.raises(ValueError, match="(?s)batch_size=0: must be .*tokenizer.path=.*: no such file"):
        load_recipe_module("full_finetune_distributed").FullFinetuneRecipeDistributed(cfg)


def test_dataset_paths_that_datasets_resolves_itself_are_not_refused(tmp_path):
    from omegaconf import OmegaConf

    good = tmp_path / "data"
    good.mkdir()
    (good / "a.json").write_text('{"input": "x", "output": "y"}\n')
    (good / "b.json.gz").write_bytes(b"\x1f\x8b not checked")
    cfg = OmegaConf.create({"checkpointer": {"checkpoint_dir": str(tmp_path), "checkpoint_files": {"filename_format": "x"}},
                            "dataset": [
                                {"source": "json", "data_files": {"train": str(good / "a.json")}},
                                {"source": "json", "data_files": str(good / "*.json")},
                                {"source": "json", "data_files": "hf://datasets/x/y.json"},
                                {"source": "json", "data_files": "b.json.gz", "data_dir": str(good)},
                                {"source": "tatsu-lab/alpaca"},
                            ]})
    assert file_problems(cfg) == []
    cfg.dataset[0].data_files = {"train": str(good / "missing.json")}
    assert file_problems(cfg) == [f"dataset[0].data_files: {good / 'missing.json'} not found. Build it or point the "
                                  "key at your data file."]


def test_a_fresh_run_does_not_replace_an_earlier_runs_checkpoints(tiny_assets, tmp_path):
    from tests.recipe.test_recipes import run_recipe

    run_recipe("full", tiny_assets, tmp_path, "max_steps_per_epoch=1", "batch_size=4")
    before = (tmp_path / "epoch_0" / "model-00001-of-00001.safetensors").read_bytes()
    cfg = _config("full", tiny_assets, tmp_path, ["max_steps_per_epoch=1", "batch_size=4"])
    with pytest.raises(ValueError, match=r"holds the checkpoints of an earlier run \(epoch_0\).*overwrite_checkpoints=True"):
        _load_recipe_class("full")(cfg)
    assert (tmp_path / "epoch_0" / "model-00001-of-00001.safetensors").read_bytes() == before
    # A finished run left nothing to resume from: resuming is not offered, as it would fail.
    message = "\n".join(file_problems(cfg, step_resume=True))
    assert f"It finished ({tmp_path / 'epoch_0'} holds its final weights)" in message, message
    assert "resume_from_checkpoint" not in message
    # Nor where a finished run kept checkpoints (from before its last steps): the resume would be refused.
    kept = tmp_path / "kept"
    run_recipe("full", tiny_assets, kept, "max_steps_per_epoch=2", "batch_size=4", "epochs=2", "save_every_n_steps=1")
    message = "\n".join(file_problems(_config("full", tiny_assets, kept, ["batch_size=4", "epochs=2"]),
                                       step_resume=True))
    assert f"It finished ({kept / 'epoch_1'} holds its final weights)" in message and \
        "resume_from_checkpoint" not in message, message
    # One stopped after a step checkpoint is offered its resume.
    stopped = tmp_path / "stopped"
    run_recipe("full", tiny_assets, stopped, "max_steps_per_epoch=2", "batch_size=4", "epochs=2",
               "save_every_n_steps=1", stop_after_epoch=0)
    message = "\n".join(file_problems(_config("full", tiny_assets, stopped, ["batch_size=4"]), step_resume=True))
    assert "holds the checkpoints of an earlier run" in message and "Resume it with resume_from_checkpoint=True" in message
    # Told to, it replaces them.
    run_recipe("full", tiny_assets, tmp_path, "max_steps_per_epoch=1", "batch_size=4", "overwrite_checkpoints=True")


def test_resume_without_a_checkpoint_is_a_file_problem(tiny_assets, tmp_path):
    cfg = _config("full", tiny_assets, tmp_path / "out", ["resume_from_checkpoint=True"])
    problems = file_problems(cfg, step_resume=True)
    # A run that never wrote one has no checkpoints/ folder: the message names what is there, not a missing folder.
    assert any(f"{tmp_path / 'out'} holds no checkpoints/ folder to resume from" in p for p in problems), problems
    with pytest.raises(ValueError, match="holds no checkpoints/ folder"):
        _load_recipe_class("full")(cfg)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_data_problem_fails_before_any_weight_is_read(tiny_assets, tmp_path, monkeypatch, kind):
    # Before: the dataloader was built after the model and the optimizer, so an epoch shorter than
    # one window (or a dataset that cannot load) failed after the weights had loaded (minutes at 8B).
    recipe_class = _load_recipe_class(kind)
    module = sys.modules[recipe_class.__module__]

    def no_weights(*args, **kwargs):
        pytest.fail("the checkpoint was read before the data problem was found")

    monkeypatch.setattr(module, "load_checkpoint", no_weights)
    cfg = _config(kind, tiny_assets, tmp_path / "out", ["gradient_accumulation_steps=1000"])
    recipe = recipe_class(cfg)
    try:
        with pytest.raises(ValueError, match=r"gradient_accumulation_steps=1000 exceeds the \d+ batches of one epoch"):
            recipe.setup(cfg)
    finally:
        recipe.cleanup()


def hub_like_dataset(tokenizer, *, source: str, **load_dataset_kwargs):
    """Raises as the datasets library does for a hub dataset's config given an option it lacks."""
    for key in load_dataset_kwargs:
        raise ValueError(f"BuilderConfig ParquetConfig(name='default') doesn't have a '{key}' key.")


def test_a_hub_datasets_unknown_option_is_named_too():
    # A local file's builder raises a TypeError (tests/recipe/test_recipes.py); a hub dataset's config a ValueError.
    cfg = OmegaConf.create({"_component_": f"{__name__}.hub_like_dataset", "source": "x", "splt": "train"})
    with pytest.raises(ValueError, match=r"dataset\.splt: neither .*hub_like_dataset nor the datasets library .* "
                                         r"Its options: source\."):
        build_dataset(cfg, tokenizer=None, key="dataset")


def packing_refuses_dataset(tokenizer, **options):
    """Raises as torchtune's packer does for a sample longer than max_seq_len."""
    raise ValueError("Dataset sample is too long (70 > 64). Please set `split_across_pack=True` or increase "
                     "`max_seq_len`.")


def test_a_packing_error_is_not_blamed_on_the_split(tiny_assets, tmp_path):
    # torchtune's packer says "split_across_pack": not the datasets library refusing dataset.split.
    cfg = OmegaConf.merge(_config("full", tiny_assets, tmp_path, ["dataset.split=train"]).dataset,
                          {"_component_": f"{__name__}.packing_refuses_dataset"})
    with pytest.raises(ValueError, match="split_across_pack") as raised:
        build_dataset(cfg, tokenizer=None, key="dataset")
    assert not isinstance(raised.value, ConfigError)  # its own words, not "dataset.split=train: ..."


@pytest.mark.parametrize("override, start, words", [
    ("dataset.split=trian", "dataset.split=trian: the datasets library cannot take it (",
     "Unknown split \"trian\". Should be one of ['train']"),
    ("dataset.split=train[:200%]", "dataset.split=train[:200%]: the datasets library cannot take it (",
     "Percent slice boundaries"),
    ("dataset.source=jsn", "dataset.source=jsn: neither one of the datasets library's loaders nor a local folder, "
                           "and the Hub could not give it (", "Did you mean dataset.source=json?"),
    ("dataset.column_map.inputt=input", "dataset.column_map: torchtune's torchtune.datasets.instruct_dataset refuses it",
     "Its keys are the builder's column names"),
])
def test_a_value_the_datasets_library_or_torchtune_refuses_is_named(tiny_assets, tmp_path, monkeypatch, override,
                                                                     start, words):
    # Before: the datasets library's or torchtune's error under a traceback, naming no config key.
    # A source not found here is not looked for on the Hub (both libraries read the variable at import).
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = _config("full", tiny_assets, tmp_path, [override]).dataset
    with pytest.raises(ConfigError) as raised:
        build_dataset(cfg, tokenizer=None, key="dataset")
    assert str(raised.value).startswith(start) and words in str(raised.value), str(raised.value)


def test_a_hub_dataset_is_named_as_not_built_with_what_it_reads():
    # Not built (it would be downloaded): neither refused nor called checked.
    cfg = OmegaConf.create({"tokenizer": {"_component_": "not.built"}, "dataset": [
        {"_component_": "torchtune.datasets.alpaca_dataset"},  # its own source
        {"_component_": "torchtune.datasets.instruct_dataset", "source": "jsn"}]})
    assert dataset_build_problems(cfg) == ([], [
        "dataset[0] (torchtune.datasets.alpaca_dataset's own source, from the Hub)",
        "dataset[1] (source=jsn, from the Hub; or did you mean dataset[1].source=json?)"])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_config_problem_and_a_file_problem_are_named_in_one_error(assets_copy, tmp_path, kind):
    message = _refusal(kind, assets_copy, tmp_path, "batch_size=0", f"tokenizer.path={tmp_path / 'x'}")
    assert message.startswith("Invalid config:\n  - batch_size=0: must be an integer >= 1")
    assert f"Files the config names cannot be used:\n  - tokenizer.path={tmp_path / 'x'}: no such file" in message


def test_a_config_too_malformed_to_find_its_files_is_named_by_its_own_problems(tiny_assets, tmp_path, monkeypatch):
    def unreadable(cfg, **kwargs):
        raise TypeError("no files to find in this config")

    monkeypatch.setattr(file_checks, "file_problems", unreadable)
    with pytest.raises(ConfigError, match=r"^Invalid config:\n  - batch_size=0") as err:
        preflight(_config("full", tiny_assets, tmp_path, ["batch_size=0"]), recipe="full")
    assert "no files to find" not in str(err.value)
    with pytest.raises(TypeError, match="no files to find"):  # with no config problem to explain it, the error stands
        preflight(_config("full", tiny_assets, tmp_path, []), recipe="full")
