"""A catalogue of bad inputs, each given to ``tune run`` as a user would.

Every case runs in an ``output_dir`` that holds an earlier run's files (weights, step
checkpoints, logs). Each must fail in the recipe's constructor, before ``setup()`` reads any
weight, with a ``ValueError`` naming the key and the fix, and must leave every file of the
earlier run as it was. The distributed cases are ``tune run --nproc_per_node 2`` processes; the
single-device ones go through torchtune's CLI entry point, many to a process
(``tests/recipe/tune_run_batch.py``), as ``tune run`` itself runs a single-device recipe in its own
process: that pays the imports once instead of once a case.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch

from tests import zygote
from tests.recipe.test_recipes import run_recipe
from tests.recipe_harness import TUNE, tiny_asset_overrides, working_tree_env

REPO = Path(__file__).resolve().parents[2]
RECIPES = {"full": "recipes/full_finetune_single_device.py", "lora": "recipes/lora_finetune_single_device.py",
           "distributed": "recipes/full_finetune_distributed.py"}
CONFIGS = {"full": "full", "lora": "lora", "distributed": "full_distributed"}
# How tune run launches each kind: the distributed recipe on two ranks, as its users run it.
LAUNCH = {"full": [], "lora": [], "distributed": ["--nproc_per_node", "2"]}
OFFLOAD = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW"]
CPU_AO = "optimizer._component_=torchtune_offload.CPUOffloadOptimizer"
PARALLEL = 4
BATCHES = 2  # processes for the single-device cases: the CI machine's two cores


class Case(NamedTuple):
    overrides: List[str]
    expected: Tuple[str, ...]  # fragments: the key, and the fix
    kind: str = "full"
    damage: Optional[Callable[[Path], None]] = None  # edits the case's private copy of the assets
    overwrite: bool = True  # False: the earlier run's files themselves are the problem


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(assets: Path) -> None:
        path = assets / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda assets: (assets / name).write_text(text)


def _remove(name: str) -> Callable[[Path], None]:
    return lambda assets: (assets / name).unlink()


CASES: Dict[str, Case] = {
    # Keys and values.
    "unknown_key": Case(["gradient_acumulation_steps=2"], ("gradient_acumulation_steps", "Did you mean 'gradient_accumulation_steps'")),
    "key_of_another_recipe": Case(["optimizer_in_bwd=True"], ("optimizer_in_bwd: unknown config key",), kind="lora"),
    "batch_size_0": Case(["batch_size=0"], ("batch_size=0", "integer >= 1")),
    "epochs_word": Case(["epochs=two"], ("epochs='two'", "integer >= 1")),
    "negative_clip": Case(["clip_grad_norm=-1"], ("clip_grad_norm=-1", "positive number")),
    "misspelt_boolean": Case(["compile=Ture"], ("compile='Ture'", "True or False")),
    "fp16": Case(["dtype=fp16"], ("dtype='fp16'", "use bf16 or fp32")),
    "save_every_0": Case(["save_every_n_steps=0"], ("save_every_n_steps=0", "integer >= 1")),
    "keep_last_0": Case(["keep_last_n_checkpoints=0"], ("keep_last_n_checkpoints=0", "integer >= 1")),
    "step_checkpoints_key_typo": Case(["save_every_n_step=5"], ("save_every_n_step", "Did you mean 'save_every_n_steps'")),
    # Optimizer options.
    "optimizer_unresolvable": Case(["optimizer._component_=torch.optim.AdamWW"], ("optimizer._component_", "does not resolve")),
    "optimizer_class_unresolvable": Case([OFFLOAD[0], "optimizer.optimizer_class=torch.optim.Nope"],
                                         ("optimizer.optimizer_class", "does not resolve")),
    "offload_option_typo": Case([*OFFLOAD, "optimizer.offload_gradient=True"],
                                ("optimizer.offload_gradient", "Did you mean 'offload_gradients'")),
    "base_option_typo": Case([*OFFLOAD, "optimizer.weight_decy=0.1"], ("optimizer.weight_decy", "Did you mean 'weight_decay'")),
    "lr_word": Case(["optimizer.lr=fast"], ("optimizer.lr='fast': AdamW refuses it", "Give a number such as 0.001")),
    "lr_word_offload": Case([*OFFLOAD, "optimizer.lr=fast"],
                            ("optimizer.lr='fast': OffloadOptimizer (base AdamW) refuses it", "Give a number")),
    "betas_number": Case(["optimizer.betas=0.9"], ("optimizer.betas=0.9", "a list of 2 numbers", "optimizer.betas=[0.9,0.999]")),
    "negative_lr": Case([*OFFLOAD, "optimizer.lr=-1"], ("optimizer.lr=-1: OffloadOptimizer (base AdamW) refuses it",
                                                       "Invalid learning rate")),
    "lora_lr_word": Case(["optimizer.lr=fast"], ("optimizer.lr='fast': AdamW refuses it", "Give a number"), kind="lora"),
    "negative_minimal_size": Case([*OFFLOAD, "optimizer.minimal_size=-1"], ("optimizer.minimal_size=-1", "non-negative integer")),
    "offload_gradients_number": Case([*OFFLOAD, "optimizer.offload_gradients=2"], ("optimizer.offload_gradients=2", "True or False")),
    "overlap_word": Case([*OFFLOAD, "optimizer.overlap=maybe"], ("optimizer.overlap='maybe'", "True or False")),
    "master_dtype_on_plain": Case(["optimizer.master_dtype=fp32"], ("optimizer.master_dtype",)),
    "master_dtype_bad": Case([*OFFLOAD, "optimizer.master_dtype=fp8"], ("master_dtype", "use fp32")),
    "in_bwd_with_clip": Case(["optimizer_in_bwd=True", "clip_grad_norm=1.0"], ("optimizer_in_bwd=True with clip_grad_norm", "Set")),
    "in_bwd_with_offload": Case([*OFFLOAD, "optimizer_in_bwd=True"], ("optimizer_in_bwd=True with optimizer._component_", "Set optimizer_in_bwd=False")),
    "torchao_on_cpu": Case([CPU_AO], ("device=cpu with torchtune_offload.CPUOffloadOptimizer", "torchtune_offload.OffloadOptimizer")),
    "torchao_with_clip": Case([CPU_AO, "clip_grad_norm=1.0"], ("clip_grad_norm is set", "Set clip_grad_norm=null")),
    "lora_module_typo": Case(["model.lora_attn_modules=[q_proj,v_prj]"], ("model.lora_attn_modules", "Did you mean 'v_proj'"), kind="lora"),
    "lora_option_typo": Case(["optimizer.lrr=1e-3"], ("optimizer.lrr", "Did you mean 'lr'"), kind="lora"),
    # Files.
    "checkpoint_dir_missing": Case(["checkpointer.checkpoint_dir=/nonexistent/model"],
                                   ("checkpointer.checkpoint_dir=/nonexistent/model", "Point it at")),
    "checkpoint_file_missing": Case(["checkpointer.checkpoint_files=[nope.safetensors]"],
                                    ("checkpointer.checkpoint_files", "nope.safetensors")),
    "checkpoint_truncated": Case([], ("checkpointer.checkpoint_files", "not a complete safetensors file", "Download it again"),
                                 damage=_truncate("model/model.safetensors")),
    "tokenizer_missing": Case([], ("tokenizer.path", "no such file"), damage=_remove("tokenizer/tokenizer.model")),
    "dataset_not_json": Case([], ("dataset.data_files", "cannot be read as JSON"), damage=_write("data/train.json", "{not json\n")),
    "dataset_missing": Case([], ("dataset.data_files", "not found"), damage=_remove("data/train.json")),
    "lora_checkpoint_truncated": Case([], ("checkpointer.checkpoint_files", "not a complete safetensors file"), kind="lora",
                                      damage=_truncate("model/model.safetensors")),
    # torchtune's way to resume ({out}: the case's output_dir, which holds the earlier run).
    "torchtune_resume_epoch_files": Case(
        ["resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.safetensors]"],
        ("checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.safetensors]", "torchtune's way to resume",
         "set resume_from_checkpoint=True with no path", "now step_00000003")),
    "torchtune_resume_output_dir": Case(
        ["resume_from_checkpoint=True", "checkpointer.checkpoint_dir={out}",
         "checkpointer.checkpoint_files=[epoch_1/model-00001-of-00001.safetensors]",
         "checkpointer.recipe_checkpoint=recipe_state/recipe_state.pt"],
        ("epoch_1/model-00001-of-00001.safetensors", "torchtune's way to resume", "the model you fine-tuned from")),
    "torchtune_recipe_checkpoint": Case(["resume_from_checkpoint=True", "checkpointer.recipe_checkpoint=recipe_state/recipe_state.pt"],
                                        ("checkpointer.recipe_checkpoint=recipe_state/recipe_state.pt",
                                         "resume_from_checkpoint=True with no path")),
    "torchtune_lora_adapter_checkpoint": Case(
        ["resume_from_checkpoint=True", "checkpointer.adapter_checkpoint=epoch_0/adapter_model.pt"],
        ("checkpointer.adapter_checkpoint=epoch_0/adapter_model.pt", "resume_from_checkpoint=True with no path"),
        kind="lora"),
    # The distributed recipe (two ranks; the earlier run is a single-device one).
    "dist_save_every_word": Case(["save_every_n_steps=often"], ("save_every_n_steps='often'", "integer >= 1"),
                                 kind="distributed"),
    "dist_offload_optimizer_fp8": Case([*OFFLOAD, "optimizer.device_weights=fp8"],
                                       ("optimizer.device_weights=fp8 with this recipe", "Remove it (~optimizer.device_weights)"),
                                       kind="distributed"),
    "dist_fsdp_cpu_offload_on_cpu": Case(["fsdp_cpu_offload=True"], ("fsdp_cpu_offload=True with device=cpu",
                                                                     "Set fsdp_cpu_offload=False"), kind="distributed"),
    "dist_shard_policy_typo": Case(["fsdp_shard_policy=[layer]"], ("fsdp_shard_policy[0]='layer'",), kind="distributed"),
    "dist_lr_word": Case(["optimizer.lr=fast"], ("optimizer.lr='fast': AdamW refuses it", "Give a number"),
                         kind="distributed"),
    "dist_resume_single_device_checkpoint": Case(["resume_from_checkpoint=True"],
                                                 ("was written by a single-device recipe", "another output_dir"),
                                                 kind="distributed"),
    "dist_torchtune_resume_epoch_files": Case(
        ["resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.safetensors]"],
        ("torchtune's way to resume", "set resume_from_checkpoint=True with no path"), kind="distributed"),
    # Runs.
    "earlier_run_would_be_replaced": Case([], ("holds the checkpoints of an earlier run", "overwrite_checkpoints=True"),
                                          overwrite=False),
}
if not torch.cuda.is_available():
    CASES["device_cuda_without_one"] = Case(["device=cuda"], ("device=cuda: this machine has no cuda device", "Set device=cpu"))


def _snapshot(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tiny_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("earlier") / "run"
    run_recipe("full", tiny_assets, out, "epochs=2", "max_steps_per_epoch=2", "batch_size=4", "save_every_n_steps=1")
    assert (out / "epoch_1").is_dir() and list((out / "checkpoints").glob("step_*"))
    return out


@pytest.fixture(scope="module")
def results(tiny_assets, earlier_run, tmp_path_factory, request):
    """Runs every selected case through ``tune run``; per case: (return code, output, files before, files after)."""
    root = tmp_path_factory.mktemp("catalogue")
    base = TUNE
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")

    def prepare(name: str) -> Tuple[List[str], Path, Dict[str, str]]:
        """The case's arguments to ``tune``, its output_dir (a copy of the earlier run) and that copy's files."""
        case = CASES[name]
        assets = tiny_assets
        if case.damage is not None:
            assets = shutil.copytree(tiny_assets, root / name / "assets")
            case.damage(assets)
        out = shutil.copytree(earlier_run, root / name / "out")
        argv = ["run", *LAUNCH[case.kind], RECIPES[case.kind], "--config", f"configs/tiny/{CONFIGS[case.kind]}.yaml",
                f"output_dir={out}", *tiny_asset_overrides(assets),
                *(["overwrite_checkpoints=True"] if case.overwrite else []),
                *[o.replace("{out}", str(out)) for o in case.overrides]]
        return argv, out, _snapshot(out)

    def run_process(argv: List[str]) -> List[Tuple[int, str]]:
        proc = zygote.run([*base, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        return [(proc.returncode, proc.stdout + proc.stderr)]

    def run_batch(commands: List[List[str]], index: int) -> List[Tuple[int, str]]:
        batch = root / f"batch_{index}"
        batch.mkdir()
        (batch / "commands.json").write_text(json.dumps(commands))
        results = batch / "results.jsonl"
        try:
            proc = zygote.run([sys.executable, "-m", "tests.recipe.tune_run_batch", str(batch / "commands.json"),
                                   str(results)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            died = f"the batch process ended with status {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        except subprocess.TimeoutExpired as err:
            died = f"the batch process was stopped after {err.timeout} s"
        done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        # The batch writes a line as each command ends: a command without one fails its own case.
        return [(r["returncode"], r["output"]) for r in done] + [(-1, died)] * (len(commands) - len(done))

    # Only the cases this run selects (pytest -k selects a few).
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params]
    prepared = {name: prepare(name) for name in selected}
    single = [name for name in selected if CASES[name].kind != "distributed"]
    batches = [group for group in (single[i::BATCHES] for i in range(BATCHES)) if group]
    launches = [[name] for name in selected if CASES[name].kind == "distributed"]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        # The batches first: they take longest.
        futures = [(group, pool.submit(run_batch, [prepared[name][0] for name in group], i))
                   for i, group in enumerate(batches)]
        futures += [(group, pool.submit(run_process, prepared[group[0]][0])) for group in launches]
        outcomes = {name: outcome for group, future in futures
                    for name, outcome in zip(group, future.result(), strict=True)}
    return {name: (*outcomes[name], prepared[name][2], _snapshot(prepared[name][1])) for name in selected}


def test_the_catalogue_has_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_before_any_weight_is_read_and_nothing_changed(name, results):
    returncode, output, before, after = results[name]
    assert returncode != 0, output[-3000:]
    # The config check's refusals are ConfigErrors (ValueErrors the tune-offload command prints alone).
    at = max(output.rfind("ValueError"), output.rfind("ConfigError"))
    assert at >= 0, output[-3000:]
    error = output[at:]
    for fragment in CASES[name].expected:
        assert fragment in error, error[-3000:]
    # Raised by the recipe's constructor: setup(), where weights are read, never ran.
    assert "__init__" in output and "in setup" not in output, output[-3000:]
    assert after == before, "a file of the earlier run was changed, added or removed"
