"""The memory planner: one traced step per shape of run, variants side by side, the pre-flight's host figure."""

import json
import re
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tests import zygote
from tests.recipe_harness import tiny_asset_overrides, working_tree_env
import torchtune_offload.plan.planner as planner
from torchtune_offload.optim.handoff import handoff_groups
from torchtune_offload.plan.planner import load_config, miniature_step, plan_variant, process_baseline
from torchtune_offload.plan.trace import trace_training_step
from torchtune_offload.recipe import check_recipe_config, host_memory_need

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny/full.yaml"


def _plan_cli(tmp_path, *args):
    out = tmp_path / "plan.json"
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", CONFIG, "--force", "--json",
                       str(out), *args],
                          cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, {p["name"]: p for p in json.loads(out.read_text())["plans"]}


def test_a_gpu_run_planned_on_a_cpu_machine_orders_the_variants(tiny_assets, tmp_path):
    stdout, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                              "--device-gib", "1", "--host-gib", "64")
    assert "| variant | device peak GiB | + paged GiB | fits device | host peak GiB | fits host |" in stdout
    for name, plan in plans.items():
        assert plan["problem"] is None or name.startswith("paged"), (name, plan["problem"])
    adamw, offload, grads = plans["adamw"], plans["offload"], plans["offload_grads"]
    # AdamW's state is on the device; the offloaders keep it (and with offload_gradients the
    # gradients too) on the host. The tiny model peaks in the loss, before gradients exist.
    assert adamw["device_bytes"] > offload["device_bytes"] >= grads["device_bytes"]
    assert not any("gradient" in k for k in grads["device_parts"])
    assert any("optstate" in k for k in adamw["device_parts"])
    assert offload["host_bytes"] > adamw["host_bytes"]
    assert plans["torchao"]["device_bytes"] == offload["device_bytes"]
    # The 8-bit variant (torchtune_offload.AdamW8bit on the host): less host memory, and no more on
    # the device (the weights left there keep an int step count instead of torch's step tensors).
    eight_bit = plans["offload_grads_8bit"]
    assert eight_bit["host_bytes"] < grads["host_bytes"] and eight_bit["device_bytes"] <= grads["device_bytes"]


def test_a_config_asking_for_the_fused_step_is_traced_with_it(tiny_assets, tmp_path):
    # The *_full_distributed configs set optimizer.fused=True; torch refuses it beside the foreach
    # the planner asks for otherwise (a RuntimeError traceback, before this was fixed).
    _, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                         "optimizer.fused=True", "--device-gib", "1", "--host-gib", "64")
    assert plans["adamw"]["problem"] is None and plans["adamw"]["device_bytes"] > 0


def test_refused_variants_say_why(tiny_assets, tmp_path):
    _, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}",
                         "--variants", "config,torchao")
    assert plans["config"]["problem"] is None and plans["config"]["host_bytes"] > 0
    assert "torchao's optimizer needs CUDA or XPU" in plans["torchao"]["problem"]


def test_the_host_figure_is_the_preflight_calculation(tiny_assets, tmp_path):
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                 "optimizer._component_=torchtune_offload.OffloadOptimizer",
                 "optimizer.optimizer_class=torch.optim.AdamW", "optimizer.minimal_size=1024"]
    plan = plan_variant(CONFIG, overrides, "config", recipe="full", seq_len=None, baseline=123)
    cfg = load_config(CONFIG, overrides)
    need = host_memory_need(cfg, check_recipe_config(cfg, recipe="full", device_present=False))
    assert plan.host_bytes == 123 + need.peak


def test_gradients_freed_in_backward_lower_the_traced_peak(tiny_assets, tmp_path):
    # Two tokens: activations are small next to the weights, so the peak holds the gradients.
    cfg = load_config(CONFIG, [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "batch_size=1"])
    settings = check_recipe_config(cfg, recipe="full")
    kept = trace_training_step(cfg, settings, seq_len=2)
    freed = trace_training_step(cfg, settings, seq_len=2, free_gradients=True)
    assert kept.by_kind["Gradient"] > 0 and freed.by_kind.get("Gradient", 0) == 0
    assert freed.peak_bytes < kept.peak_bytes
    weights = sum(p.numel() * p.element_size() for p in torch.nn.Module.parameters(_tiny(cfg, settings)))
    assert kept.by_kind["Parameter"] == weights


def test_a_handoff_per_parameter_is_planned_with_its_handoffs_and_its_lower_peak(tiny_assets, tmp_path):
    # Two tokens and a small vocabulary: the layers' gradients outweigh the activations and the output's.
    engine = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda", "batch_size=1",
              "model.vocab_size=64",
              "optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
              "optimizer.minimal_size=0", "optimizer.offload_gradients=True", "optimizer.overlap=True"]
    per_group, per_parameter, kept = (
        plan_variant(CONFIG, [*engine, *extra], "config", recipe="full", seq_len=2, baseline=0)
        for extra in ([], ["optimizer.handoff=parameter"], ["optimizer.offload_gradients=False"]))
    cfg = load_config(CONFIG, engine)
    named = [(n, p) for n, p in _tiny(cfg, check_recipe_config(cfg, recipe="full", device_present=False)).named_parameters()]
    assert per_parameter.work.handoffs_per_micro_batch == len(named)
    assert per_group.work.handoffs_per_micro_batch == len(set(handoff_groups(
        [n for n, _ in named], [p.numel() * p.element_size() for _, p in named])))
    # A gradient leaves the device as it is made, not with its layer's last; kept on it, it stays to the step.
    assert per_parameter.device_bytes < per_group.device_bytes < kept.device_bytes
    no_handoff = plan_variant(CONFIG, [*engine, "optimizer.overlap=False", "optimizer.offload_gradients=False"],
                              "config", recipe="full", seq_len=2, baseline=0)
    assert no_handoff.work.handoffs_per_micro_batch == 0  # the engine takes no gradient in backward


def _tiny(cfg, settings):
    from torchtune_offload.recipe.checks.fit import meta_model
    return meta_model(cfg.model, settings)


def test_the_baseline_counts_the_built_tokenizer_and_dataset(tiny_assets, tmp_path):
    cfg = load_config(CONFIG, [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}"])
    baseline, notes = process_baseline(cfg, device=torch.device(cfg.device))
    assert baseline > 0 and notes == []
    cfg.tokenizer.path = str(tmp_path / "missing.model")
    _, notes = process_baseline(cfg, device=torch.device(cfg.device))
    assert notes and "not counted" in notes[0]


def test_the_baseline_runs_a_miniature_step_of_the_runs_kind(tiny_assets, tmp_path):
    # Its kernel code and caches are what a real step leaves resident (planner.miniature_step).
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "dtype=bf16",
                 "enable_activation_checkpointing=True"]
    for config, extra, kind in ((CONFIG, [], "full"), ("configs/tiny/lora.yaml", [], "LoRA"),
                                ("configs/tiny/lora.yaml", ["model.quantize_base=True"], "QLoRA")):
        assert miniature_step(load_config(config, [*overrides, *extra])) == kind
    # A loss the miniature cannot build: one kernel instead, and a note says what is not counted.
    cfg = load_config(CONFIG, [*overrides, "loss._component_=torchtune_offload.no_such_loss"])
    baseline, notes = process_baseline(cfg, device=torch.device("cpu"))
    assert baseline > 0 and len(notes) == 1 and "miniature training step could not run here" in notes[0], notes


def test_a_lora_run_traces_with_frozen_base_weights(tiny_assets, tmp_path):
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}"]
    plan = plan_variant("configs/tiny/lora.yaml", overrides, "config", recipe="lora", seq_len=None, baseline=0)
    assert plan.problem is None
    # Only the adapters get gradients; the frozen base weights are counted as parameters.
    assert plan.device_parts["step peak: parameter"] > 0
    assert plan.device_parts.get("step peak: gradient", 0) < plan.device_parts["step peak: parameter"]


def test_the_baseline_says_when_it_cannot_count_the_device_runtime(tiny_assets, tmp_path):
    cfg = load_config(CONFIG, [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}"])
    _, notes = process_baseline(cfg, device=torch.device("cuda"))
    if torch.cuda.is_available():
        assert notes == []
    else:
        assert len(notes) == 1 and "cuda runtime's own host memory is not counted" in notes[0]


def _plan_rc(*args):
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", CONFIG, *args], cwd=REPO,
                      env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def test_bad_arguments_are_refused_in_one_line_before_anything_is_planned(tmp_path):
    kept = tmp_path / "my.yaml"
    kept.write_text("output_dir: mine\n")
    for args, named in ((["--device-gib", "0"], "--device-gib 0.0: must be a positive number"),
                        (["--host-gib", "nan"], "--host-gib nan: must be a positive number"),
                        (["--device-gib", "-1"], "--device-gib -1.0"),
                        (["--seq-len", "0"], "--seq-len 0: must be at least 1"),
                        (["--json", str(tmp_path / "no" / "plan.json")],
                         f"the folder {tmp_path / 'no'} does not exist"),
                        (["--json", str(tmp_path)], "is a folder"),
                        # A file the user has (a config, say) is not replaced without --force.
                        (["--json", str(kept)], "already exists; pass --force to replace it"),
                        (["~"], "overrides must be key=value (or ~key")):
        code, out, err = _plan_rc(*args)
        assert code == 2 and named in err and "Traceback" not in err and "planning" not in err, (args, err)
    assert kept.read_text() == "output_dir: mine\n"


def test_a_config_without_a_model_is_refused_before_planning_not_with_a_traceback(tiny_assets, tmp_path):
    config = OmegaConf.load(REPO / CONFIG)
    del config["model"]
    OmegaConf.save(config, tmp_path / "no_model.yaml")
    common = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "--variants", "config", "--no-fine-tunes"]
    code, out, err = _plan_rc(*common, "--config", str(tmp_path / "no_model.yaml"))
    assert code == 1 and "Traceback" not in err and "  - model: required" in err and "planning" not in err, (out, err)
    # torchtune's merge refuses to delete a node holding a _component_ (saying it is not found), or a key
    # the config does not have: each said in one line.
    code, out, err = _plan_rc(*common, "~model")
    assert code == 2 and "Traceback" not in err and "~model: torchtune cannot delete a component" in err, err
    code, out, err = _plan_rc(*common, "~no_such_key")
    assert code == 2 and "Traceback" not in err and "~no_such_key: Could not find key no_such_key" in err, err


def test_a_misspelt_key_refuses_every_variant_before_anything_is_traced(tiny_assets, tmp_path):
    code, out, err = _plan_rc(*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "batch_sze=2")
    assert code == 1 and "is refused for every variant, so none was planned" in err and "'batch_size'" in err, err
    assert "tracing" not in err and "planning" not in err and out == "", (out, err)


def test_an_unknown_sequence_length_is_said_once_before_anything_is_traced(tiny_assets, tmp_path):
    # Each variant's row used to repeat it, twenty times for torchtune's configs (max_seq_len: null).
    common = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}"]
    code, out, err = _plan_rc(*common, "tokenizer.max_seq_len=null")
    assert code == 1 and "is refused for every variant, so none was planned" in err, err
    assert err.count("tokenizer.max_seq_len is null, so the sequence length is unknown: give --seq-len N.") == 1, err
    assert "tracing" not in err and "planning" not in err and out == "", (out, err)
    code, out, err = _plan_rc(*common, "tokenizer.max_seq_len=0")
    assert code == 1 and err.count("tokenizer.max_seq_len=0: ") == 1 and "planning" not in err, err


def test_a_refused_config_keeps_its_table_and_exits_1_and_a_deleted_key_is_planned(tiny_assets, tmp_path):
    common = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "--variants", "config,offload",
              "--no-fine-tunes"]
    code, out, err = _plan_rc(*common, "optimizer._component_=torchtune_offload.CPUOffloadOptimizer")
    assert code == 1 and "Traceback" not in err
    assert ("error: the config as given is refused: device=cpu with torchtune_offload.CPUOffloadOptimizer: torchao's "
            "optimizer needs CUDA or XPU.") in err, err
    assert re.search(r"^\| offload \| [0-9.]+ \|", out, flags=re.M), out
    code, out, err = _plan_rc(*common, "~clip_grad_norm")  # deleted as tune run deletes it
    assert code == 0, err[-2000:]


def test_torchaos_own_options_are_refused_by_the_plan_not_raised(tiny_assets, tmp_path):
    # Before: the config check passed optimizer.minimal_size=-3 for torchao's wrapper, and its memory
    # plan then raised out of the planner, losing every variant's plan.
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda", "clip_grad_norm=null",
                 "optimizer._component_=torchtune_offload.CPUOffloadOptimizer",
                 "optimizer.optimizer_class=torch.optim.AdamW", "optimizer.minimal_size=-3"]
    plan = plan_variant(CONFIG, overrides, "config", recipe="full", seq_len=None, baseline=0)
    assert plan.problem.startswith("optimizer.minimal_size=-3 must be a non-negative integer")


def test_a_memory_plan_that_refuses_the_optimizer_is_the_variants_problem(tiny_assets, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("optimizer.something=1 refused by the memory plan\nsecond line")

    monkeypatch.setattr(planner, "host_memory_need", refuse)
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}"]
    plan = plan_variant(CONFIG, overrides, "config", recipe="full", seq_len=None, baseline=0)
    assert plan.problem == "optimizer.something=1 refused by the memory plan"
    # Nothing of the refused run is reported as if it could run.
    assert plan.device_bytes is None and not plan.device_parts and plan.work is None and plan.host_bytes is None


def test_a_shipped_configs_name_is_planned_from_any_folder_and_a_misspelt_one_gets_the_closest(tiny_assets, tmp_path):
    # Outside a clone there is no configs/ folder to give a path in: tune-offload's names are what a user has.
    def plan(*args):
        return zygote.run([sys.executable, "-m", "torchtune_offload.plan", *args], cwd=tmp_path,
                          env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True, text=True, timeout=600)
    proc = plan("--config", "tiny/full", *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}",
                "--variants", "config", "--no-fine-tunes", "--jobs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Plan for {REPO / 'configs' / 'tiny' / 'full.yaml'} (batch" in proc.stdout, proc.stdout
    proc = plan("--config", "tiny/ful")
    assert proc.returncode == 2 and "--config tiny/ful: no config named 'tiny/ful'" in proc.stderr, proc.stderr
    assert "Did you mean tiny/full?" in proc.stderr and "planning" not in proc.stderr and "Traceback" not in proc.stderr
