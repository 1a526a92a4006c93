"""``tune-offload``: names resolve to the shipped recipes and configs, bad input names what exists.

In-process and fast. Training through the installed command, single-device and 2-rank, is the
acceptance test in tests/test_install.py.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
from torchtune._cli.run import Run
from torchtune.training.metric_logging import DiskLogger

import torchtune_offload.assets as tta
from torchtune_offload.cli import RECIPE_KINDS, Shipped, main, shipped_root
from torchtune_offload.recipe.shipped import SHIPPED_DIR

REPO = Path(__file__).resolve().parents[1]
RECIPE_NAMES = sorted(p.stem for p in (REPO / "recipes").glob("*.py") if not p.stem.startswith("_"))


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_working_tree_reads_the_clones_folders():
    assert shipped_root() == REPO


def test_an_installed_copy_comes_before_the_clone(tmp_path):
    package = tmp_path / "site" / "torchtune_offload"
    for root in (package / SHIPPED_DIR, package.parent):
        (root / "recipes").mkdir(parents=True)
        (root / "recipes" / "__init__.py").write_text("TORCHTUNE_OFFLOAD_RECIPES = True\n")
        (root / "configs").mkdir()
    assert shipped_root(package_dir=package) == package / SHIPPED_DIR
    shutil.rmtree(package / SHIPPED_DIR)
    assert shipped_root(package_dir=package) == package.parent
    # torchtune's own top-level `recipes` package is not ours: no marker, not taken.
    (package.parent / "recipes" / "__init__.py").write_text("")
    with pytest.raises(FileNotFoundError, match="pip install"):
        shipped_root(package_dir=package)


def test_ls_lists_every_recipe_and_config_like_tune_ls(capsys):
    code, out, _ = _cli(capsys, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RECIPE", "CONFIG"]
    listed = [line.split()[-1] for line in lines[1:]]
    assert sorted(listed) == sorted(p.relative_to(REPO / "configs").with_suffix("").as_posix()
                                    for p in (REPO / "configs").rglob("*.yaml"))
    recipes = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]
    assert recipes == RECIPE_NAMES
    assert "tiny/full" in Shipped(REPO).configs_by_recipe()["full_finetune_single_device"]
    assert "tiny/full_distributed" in Shipped(REPO).configs_by_recipe()["full_finetune_distributed"]


def test_every_config_header_names_its_recipe_and_every_recipe_has_a_kind():
    # A config whose header names none of our recipes would be listed apart and validated partly.
    assert Shipped(REPO).configs_by_recipe().get(None) is None
    assert sorted(RECIPE_KINDS) == RECIPE_NAMES


def test_a_config_added_later_is_found_without_a_list(tmp_path):
    for name in ("recipes", "configs"):
        shutil.copytree(REPO / name, tmp_path / name)
    added = tmp_path / "configs" / "newmodel" / "7B_qlora.yaml"
    added.parent.mkdir()
    added.write_text("# Launch:\n#   tune-offload run lora_finetune_single_device --config newmodel/7B_qlora\nbatch_size: 1\n")
    shipped = Shipped(tmp_path)
    assert shipped.config("newmodel/7B_qlora") == added
    assert "newmodel/7B_qlora" in shipped.configs_by_recipe()["lora_finetune_single_device"]


def test_cp_copies_a_config_and_a_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _cli(capsys, "cp", "tiny/full", "./my.yaml")[0] == 0
    assert (tmp_path / "my.yaml").read_bytes() == (REPO / "configs" / "tiny" / "full.yaml").read_bytes()
    assert _cli(capsys, "cp", "tiny/lora", "./other")[0] == 0  # a config stays a .yaml, as with tune cp
    assert (tmp_path / "other.yaml").is_file()
    assert _cli(capsys, "cp", "full_finetune_distributed", ".")[0] == 0
    assert (tmp_path / "full_finetune_distributed.py").read_bytes() == (
        REPO / "recipes" / "full_finetune_distributed.py").read_bytes()
    (tmp_path / "my.yaml").write_text("mine\n")
    code, out, _ = _cli(capsys, "cp", "-n", "tiny/full", "my.yaml")
    assert code == 0 and "not overwriting" in out and (tmp_path / "my.yaml").read_text() == "mine\n"
    # Without -n or --force an existing file is refused, even one the destination's suffix leads to.
    for dest in ("my.yaml", "my.txt"):
        code, _, err = _cli(capsys, "cp", "tiny/full", dest)
        assert code == 2 and "already exists" in err and "--force" in err
        assert (tmp_path / "my.yaml").read_text() == "mine\n"
    assert "my.txt with its .yaml suffix" in err
    assert _cli(capsys, "cp", "tiny/full", "my.yaml", "--force")[0] == 0
    assert (tmp_path / "my.yaml").read_bytes() == (REPO / "configs" / "tiny" / "full.yaml").read_bytes()
    code, _, err = _cli(capsys, "cp", "tiny/full", "new/dir/my.yaml")
    assert code == 2 and "--make-parents" in err
    assert _cli(capsys, "cp", "tiny/full", "new/dir/my.yaml", "--make-parents")[0] == 0
    assert (tmp_path / "new" / "dir" / "my.yaml").is_file()


@pytest.mark.parametrize("argv, looked_for, exists", [
    (["cp", "tiny/fulll", "x.yaml"], "tiny/fulll", "tiny/full"),
    (["cat", "llama3_2/1B_nope"], "configs/llama3_2/1B_nope.yaml", "llama3_2/1B_full_offload"),
    (["cat", "missing.yaml"], "missing.yaml", "tiny/full"),
    (["validate", "--config", "tiny/nope"], "configs/tiny/nope.yaml", "tiny/full"),
    (["run", "full_finetune", "--config", "tiny/full"], "recipes/full_finetune.py", "full_finetune_single_device"),
    (["run", "full_finetune_single_device", "--config", "./nope.yaml"], "nope.yaml", "tiny/full"),
    (["run", "full_finetune_single_device"], "--config", "tiny/full"),
    (["run", "--nproc_per_node", "2", "full_finetune_single_device", "--config", "tiny/full"],
     "runs on one device", "full_finetune_distributed"),
])
def test_bad_input_exits_non_zero_naming_what_it_looked_for_and_what_exists(argv, looked_for, exists, capsys,
                                                                         tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(capsys, *argv)
    assert code == 2
    assert looked_for in err and exists in err, err
    assert not list(tmp_path.iterdir())  # nothing was written or run


def test_cat_prints_a_config_by_name_or_path(capsys, tmp_path):
    code, out, _ = _cli(capsys, "cat", "tiny/full")
    assert code == 0 and "output_dir: outputs/tiny/full" in out
    (tmp_path / "mine.yaml").write_text("b: 1\na: 2\n")
    assert _cli(capsys, "cat", str(tmp_path / "mine.yaml"), "--sort")[1] == "a: 2\nb: 1\n"
    code, _, err = _cli(capsys, "cat", "full_finetune_single_device")
    assert code == 2 and "is a recipe" in err


@pytest.fixture
def cache_with_tiny_assets(tiny_assets, tmp_path, monkeypatch):
    """XDG_CACHE_HOME such that the tiny configs resolve to the test run's assets."""
    (tmp_path / "cache" / "torchtune_offload").mkdir(parents=True)
    os.symlink(tiny_assets, tmp_path / "cache" / "torchtune_offload" / "tiny")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tta.default_tiny_dir().resolve() == tiny_assets.resolve()


def test_validate_checks_a_config_as_its_recipe_reads_it(cache_with_tiny_assets, capsys):
    code, out, _ = _cli(capsys, "validate", "--config", "tiny/full")
    assert code == 0 and "full_finetune_single_device" in out
    assert _cli(capsys, "validate", "tiny/lora")[0] == 0  # the config as the first argument works too
    code, _, err = _cli(capsys, "validate", "--config", "tiny/full", "batch_sise=4")
    assert code == 1 and "batch_sise" in err and "batch_size" in err
    code, _, err = _cli(capsys, "validate", "--config", "tiny/full", "dataset.data_files=/nonexistent.json")
    assert code == 1 and "/nonexistent.json" in err


@pytest.mark.parametrize("override, named", [
    # torchtune's own validate raised a TypeError uncaught for these (their components take other objects too).
    ("optimizer.ofload_gradients=True", "optimizer.ofload_gradients"),
    ("lr_scheduler.num_warmup_step=3", "lr_scheduler.num_warmup_steps"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),  # an IndexError in torch's AdamW
    ("model.zzz=1", "model.zzz: not an option of torchtune_offload.models.tiny_llama"),
    ("model._component_=torchtune.models.nope", "model._component_=torchtune.models.nope: cannot be imported"),
    # The builder checks none of its values: a TypeError inside the build, naming no key.
    ("model.num_layers=abc", "model.num_layers='abc': must be an integer >= 1"),
])
def test_validate_names_an_option_a_component_does_not_take_without_a_traceback(cache_with_tiny_assets, capsys,
                                                                                 override, named):
    code, _, err = _cli(capsys, "validate", "--config", "tiny/full", override)
    assert code == 1 and named in err and "Traceback" not in err


def test_a_tiny_config_before_the_assets_are_built_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    for argv in (["validate", "--config", "tiny/full"], ["run", "full_finetune_single_device", "--config", "tiny/full"]):
        code, _, err = _cli(capsys, *argv)
        assert code != 0 and f"{sys.executable} -m torchtune_offload.assets" in err, err
        assert str(tmp_path / "empty" / "torchtune_offload" / "tiny") in err


@pytest.fixture
def launches(monkeypatch):
    """Records what ``run`` hands to torchtune's ``tune run`` machinery instead of training."""
    calls = []
    monkeypatch.setattr(Run, "_run_single_device", lambda self, args, is_builtin: calls.append(("single", args, is_builtin)))
    monkeypatch.setattr(Run, "_run_distributed", lambda self, args, is_builtin: calls.append(("torchrun", args, is_builtin)))
    return calls


def test_run_hands_the_recipe_file_and_config_file_to_tune_run(cache_with_tiny_assets, launches, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "configs" / "tiny" / "full.yaml", tmp_path / "my.yaml")
    assert main(["run", "full_finetune_single_device", "--config", "tiny/full", "max_steps_per_epoch=2"]) == 0
    assert main(["run", "full_finetune_single_device", "--config=./my.yaml", "device=cpu"]) == 0
    assert main(["run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "tiny/full_distributed"]) == 0
    (kind1, a1, b1), (kind2, a2, _), (kind3, a3, b3) = launches
    assert (kind1, kind2, kind3) == ("single", "single", "torchrun")
    assert b1 and b3  # launched as torchtune launches its built-in recipes: by file path
    assert a1.recipe == str(REPO / "recipes" / "full_finetune_single_device.py")
    assert a1.recipe_args == ["--config", str(REPO / "configs" / "tiny" / "full.yaml"), "max_steps_per_epoch=2"]
    assert a2.recipe_args == ["--config", str(tmp_path / "my.yaml"), "device=cpu"]
    assert a3.recipe == str(REPO / "recipes" / "full_finetune_distributed.py") and a3.nproc_per_node == "2"


def test_validate_checks_the_components_of_a_config_that_names_no_recipe(cache_with_tiny_assets, tmp_path, capsys):
    lines = (REPO / "configs" / "tiny" / "full.yaml").read_text().splitlines()
    (tmp_path / "bare.yaml").write_text("\n".join(line for line in lines if not line.startswith("#")) + "\n")
    code, out, _ = _cli(capsys, "validate", "--config", str(tmp_path / "bare.yaml"))
    assert code == 0 and "component arguments only" in out
    code, _, err = _cli(capsys, "validate", "--config", str(tmp_path / "bare.yaml"), "optimizer.ofload_gradients=True")
    assert code == 1 and "optimizer.ofload_gradients: not an option of torch.optim.AdamW" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text, expected", [
    ("a: [1, 2\nb: 3\n", "not a YAML config (line 2): expected ',' or ']', but got ':'"),
    ("42\n", "and this file holds a number"),
    ("just some prose\n", "and this file holds text"),
    ("{}\n", "and this file holds no keys"),
    ("a: ${foo\n", "torchtune's OmegaConf cannot read it"),
    ("seed: 1\nseed: 2\n", "not a YAML config (line 2): found duplicate key seed"),  # torchtune refuses it too
    ("- 1\n- 2\n", "a config is a mapping of keys (model:, optimizer:, ...), and this file holds a list"),
    ("", "and this file holds nothing"),
])
@pytest.mark.parametrize("verb", ["validate", "cat", "run"])
def test_a_file_that_is_no_yaml_config_is_one_line_not_a_traceback(tmp_path, capsys, text, expected, verb):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    argv = ["run", "full_finetune_single_device", "--config", str(path)] if verb == "run" else [verb, str(path)]
    code, _, err = _cli(capsys, *argv)
    assert code != 0 and f"{path}: " in err and expected in err and "Traceback" not in err


def test_a_folder_given_as_a_config_is_named_as_a_folder(tmp_path, capsys):
    code, _, err = _cli(capsys, "cat", str(tmp_path))
    assert code != 0 and f"{tmp_path}: is a folder; name a config" in err


def test_a_misspelt_config_name_gets_the_closest_names(capsys, monkeypatch, tmp_path):
    code, _, err = _cli(capsys, "cat", "llama3_1/8B_ful_offload_engine")
    assert code == 2 and "Did you mean llama3_1/8B_full_offload_engine" in err, err
    # A clone's path given outside the clone (as the docs write them) is offered the shipped name.
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, "validate", "--config", "configs/llama3_1/8B_ful_offload_engine.yaml")
    assert code == 2 and "Did you mean llama3_1/8B_full_offload_engine" in err, err


@pytest.mark.parametrize("argv, said, not_said", [
    # torchtune's help texts name tune ls (torchtune's recipes only) and tune download.
    (["run", "--help"], "a recipe's name (tune-offload ls lists them with their configs)", "`tune ls`"),
    (["download", "--help"], "usage: tune-offload download <repo-id>", "$ tune download"),
    (["probe", "--help"], "Measures the rates the planner's step-time model reads", None),
])
def test_each_verbs_help_names_this_command(capsys, argv, said, not_said):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, _ = capsys.readouterr()
    assert exit_.value.code == 0 and said in " ".join(out.split()), out
    assert not_said is None or not_said not in out, out


def test_download_without_a_repository_is_refused_as_tune_offload_download(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["download"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "tune-offload download: error: the following arguments are required: repo_id" in err


def test_plan_is_the_planner_under_this_commands_name(cache_with_tiny_assets, capsys, tmp_path):
    code, out, _ = _cli(capsys, "plan", "--config", "tiny/full", f"output_dir={tmp_path}", "--variants", "config",
                        "--no-fine-tunes", "--jobs", "1")
    assert code == 0 and "Plan for " in out and "| config |" in out, out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", "tiny/ful"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "tune-offload plan: error: --config tiny/ful:" in err and "tiny/full?" in err
    # As validate and cat take it: the config as the first argument.
    code, positional, _ = _cli(capsys, "plan", "tiny/full", f"output_dir={tmp_path}", "--variants", "config",
                               "--no-fine-tunes", "--jobs", "1")
    assert code == 0 and "configs/tiny/full.yaml (batch 8 x 64 tokens)" in positional and "| config |" in positional
    with pytest.raises(SystemExit) as exit_:
        main(["plan", f"output_dir={tmp_path}"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "error: the config is required: --config <yaml or name> (or as the first" in err


def test_torchtunes_own_config_names_resolve_after_ours(tmp_path, capsys):
    # Our recipes take torchtune's configs, and the README says so: its names work as they do in tune run.
    path = Shipped(shipped_root()).config("llama3_2/1B_full_single_device")
    assert path.parts[-4:] == ("recipes", "configs", "llama3_2", "1B_full_single_device.yaml") and path.is_file()
    code, out, _ = _cli(capsys, "cp", "llama3_2/1B_full_single_device", str(tmp_path / "mine.yaml"))
    assert code == 0 and (tmp_path / "mine.yaml").read_bytes() == path.read_bytes(), out
    assert not set(Shipped(shipped_root()).configs) & {"llama3_2/1B_full_single_device"}


@pytest.mark.parametrize("argv, said", [
    (["run", "full_finetune_singel_device", "--config", "tiny/full"], "Did you mean full_finetune_single_device?"),
    (["cp", "tiny/lroa", "x.yaml"], "Did you mean tiny/lora?"),
    (["validate", "--config", "llama3_2/1B_full_single_devic"], "Did you mean llama3_2/1B_full_single_device"),
])
def test_a_misspelt_recipe_or_cp_name_gets_the_closest(capsys, argv, said):
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and said in err, err


def test_a_component_is_nulled_not_deleted_on_the_command_line(cache_with_tiny_assets, capsys):
    code, _, err = _cli(capsys, "validate", "--config", "tiny/full", "~lr_scheduler")
    assert code == 2 and "give lr_scheduler=null instead" in err, err
    assert _cli(capsys, "validate", "--config", "tiny/full", "lr_scheduler=null")[0] == 0
    code, _, err = _cli(capsys, "validate", "--config", "tiny/full", "loss=null")
    assert code == 1 and "loss._component_ is null (loss=null on the command line sets it)" in err, err


@pytest.mark.parametrize("override, said", [
    ("dataset.train_on_inputs=True", "dataset.train_on_inputs: neither torchtune.datasets.instruct_dataset nor the "
                                     "datasets library it passes options on to takes it"),
    ("dataset.split=trian", "dataset.split=trian: the datasets library cannot take it (Unknown split"),
    ("dataset.column_map.inputt=input", "dataset.column_map: torchtune's torchtune.datasets.instruct_dataset refuses "
                                        "it (Expected a key of 'input' in column_map"),
])
def test_validate_builds_local_data_as_the_recipe_would(cache_with_tiny_assets, capsys, override, said):
    # Before, it called these configs well-formed: torchtune hands the values to the datasets library.
    code, out, err = _cli(capsys, "validate", "--config", "tiny/full", override)
    assert code == 1 and said in err and "Traceback" not in err, err


def test_validate_says_which_data_it_did_not_build_and_which_names_no_signature_can_check(cache_with_tiny_assets,
                                                                                          capsys):
    # A Hub dataset is not downloaded to validate it; a dataset builder passes what it does not take
    # on to load_dataset. "well-formed" must not claim those.
    code, out, _ = _cli(capsys, "validate", "--config", "tiny/full", "dataset.source=jsn", "dataset.train_on_inputs=True")
    assert code == 0 and "Not built here, so their values (source, split, column_map) are not checked: dataset " \
                         "(source=jsn, from the Hub; or did you mean dataset.source=json?)" in out, out
    assert "so their names are not checked here: dataset.data_files, dataset.train_on_inputs." in out, out
    assert "(keys, values, files)." in out
    code, out, _ = _cli(capsys, "validate", "--config", "tiny/full")
    assert code == 0 and "(keys, values, files, data)." in out and "not checked" not in out, out


def test_a_config_the_recipe_refuses_is_printed_without_a_traceback(cache_with_tiny_assets, capsys, tmp_path):
    # The recipe's own message names the key and the fix; a traceback above it only hid it.
    code, _, err = _cli(capsys, "run", "full_finetune_single_device", "--config", "tiny/full",
                        f"output_dir={tmp_path}", "batch_sze=3")
    assert code == 1 and "Traceback" not in err, err
    assert "tune-offload run: error: Invalid config:\n  - batch_sze: unknown config key" in err, err


def test_compare_puts_finished_runs_side_by_side_and_refuses_bad_pairs(capsys, tmp_path):
    for name, losses in (("plain", [3.0, 2.0, 1.0]), ("offload", [3.0, 2.5, 1.5])):
        logger = DiskLogger(log_dir=str(tmp_path / name / "logs"), filename="log_1.txt")
        for step, loss in enumerate(losses, start=1):
            logger.log_dict({"loss": loss, "tokens_per_second": 100.0 * step, "host_rss_peak": 0.5}, step=step)
        logger.close()
    code, out, err = _cli(capsys, "compare", f"plain={tmp_path / 'plain'}", f"offload={tmp_path / 'offload'}")
    assert code == 0, err
    assert "largest loss difference from plain: 0.5" in out and "host_rss_peak" in out
    # A folder alone: a run's (named by its folder), or one holding runs, as a sweep's does (each variant).
    code, alone, err = _cli(capsys, "compare", str(tmp_path / "plain"), f"other={tmp_path / 'offload'}")
    assert code == 0 and "largest loss difference from plain: 0.5" in alone and "other: " in alone, err
    code, files, err = _cli(capsys, "compare", str(tmp_path / "plain" / "logs" / "log_1.txt"))
    assert code == 0 and "log_1: " in files, err  # a DiskLogger file, named by the file
    # A sweep's variant refused before training, and one out of memory after DiskLogger made its file.
    (tmp_path / "refused").mkdir()
    (tmp_path / "refused" / "run.log").write_text("ValueError: clip_grad_norm ...")
    (tmp_path / "oom" / "logs").mkdir(parents=True)
    (tmp_path / "oom" / "logs" / "log_1.txt").write_text("")
    (tmp_path / "oom" / "run.log").write_text("torch.OutOfMemoryError: ...")
    code, swept, err = _cli(capsys, "compare", str(tmp_path))
    assert code == 0 and "largest loss difference from offload: 0.5" in swept, err  # by name: offload, plain
    assert f"{tmp_path}: not compared, no step logged (see their run.log): oom, refused" in err
    # A run's logs folder is named by the run; a path holding '=' is a path.
    code, out, err = _cli(capsys, "compare", str(tmp_path / "plain" / "logs"), f"x={tmp_path / 'offload'}")
    assert code == 0 and "plain: " in out, err
    (tmp_path / "a=b").mkdir()
    shutil.copytree(tmp_path / "plain" / "logs", tmp_path / "a=b" / "logs")
    code, out, err = _cli(capsys, "compare", str(tmp_path / "a=b"))
    assert code == 0 and "a=b: " in out, err
    (tmp_path / "wandb_only" / "logs" / "wandb").mkdir(parents=True)
    code, out, err = _cli(capsys, "compare", str(tmp_path / "wandb_only"))
    assert code == 2 and "the run logged to W&B only (logs/wandb)" in err, err
    (tmp_path / "empty").mkdir()
    for argv, said in ((["=x"], "'=x': give NAME=OUTPUT_DIR"),
                       ([str(tmp_path / "nothing")], "no such folder. Give a run's or a sweep's output folder"),
                       ([str(tmp_path / "empty")], f"no DiskLogger file (logs/log_*.txt) under {tmp_path / 'empty'}: did the run start"),
                       ([f"a={tmp_path / 'plain'}", f"a={tmp_path / 'offload'}"], "'a' is named twice"),
                       ([str(tmp_path), str(tmp_path / "plain")], "'plain' is named twice"),
                       ([f"a={tmp_path / 'nothing'}"], "no DiskLogger file at")):
        code, out, err = _cli(capsys, "compare", *argv)
        assert code == 2 and said in err and out == "", err


def test_plan_refuses_the_fsdp2_variants_of_a_single_device_config_and_says_where_they_plan(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", "tiny/full", "--variants", "config,fsdp2_offload"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "--variants: fsdp2_offload run FSDP2 over several ranks" in err
    # Planned per rank for a config of the distributed recipe; run by the sweep.
    assert "config of the distributed recipe" in err and "with --nproc-per-node N" in err
    assert "scripts/benchmark_sweep.py --nproc-per-node N" in err
