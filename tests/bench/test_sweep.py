"""The optimizer sweep on the tiny model with synthetic data, the gradient-norm probe, the ballast's checks."""

import importlib.util
import inspect
import json
import math
import os
import runpy
import sys
import types

import pytest
import torch

from tests.recipe_harness import REPO, tiny_asset_overrides
from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench import sweep
from torchtune_offload.bench.ballast import GpuBallast
from torchtune_offload.bench.grad_probe import ENV, GradNormProbeAdamW, read_probe
from torchtune_offload.bench.sweep import (
    VariantResult,
    diverged,
    log_to_wandb,
    markdown_table,
    run_variant,
    write_results,
)
from torchtune_offload.bench.variants import OFFLOAD_ONLY_KEYS, VARIANTS, legend
from torchtune_offload.plan.planner import default_variants, load_config, variant_config
from torchtune_offload.recipe import read_disk_log
from torchtune_offload.recipe.reports.memory import EXPANDABLE_SEGMENTS

SYNTHETIC = ["dataset._component_=torchtune_offload.data.synthetic_dataset", "~dataset.source",
             "~dataset.data_files", "~dataset.split", "~dataset.train_on_input", "dataset.seq_len=64",
             "dataset.num_samples=96", "batch_size=8", "clip_grad_norm=1.0"]
CONFIG = str(REPO / "configs" / "tiny" / "full.yaml")


def overrides_for(config: str, name: str) -> list:
    return VARIANTS[name].overrides(config)


def test_overrides_swap_only_the_optimizer():
    assert overrides_for(CONFIG, "offload_grads") == [
        "optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
        "optimizer.offload_gradients=True"]
    # torchtune's 8B setting steps in backward, which refuses clipping and accumulation: the sweep and
    # the planner alike run it without both.
    assert overrides_for(CONFIG, "paged_adamw8bit_in_bwd")[-3:] == [
        "optimizer_in_bwd=True", "clip_grad_norm=null", "gradient_accumulation_steps=1"]
    # The 8-bit offload variant (and so the planner's, which takes the sweep's) is this project's AdamW8bit.
    assert "optimizer.optimizer_class=torchtune_offload.AdamW8bit" in overrides_for(CONFIG, "offload_grads_8bit")
    fp8 = overrides_for(CONFIG, "offload_grads_8bit_fp8")
    assert "optimizer.device_weights=fp8" in fp8 and "optimizer.optimizer_class=torchtune_offload.AdamW8bit" in fp8
    # From an FP8 config, the other variants drop the key (plain optimizers would refuse it).
    fp8_config = str(REPO / "configs" / "llama3_1" / "8B_full_offload_fp8.yaml")
    assert "~optimizer.device_weights" in overrides_for(fp8_config, "offload_grads")
    assert "~optimizer.device_weights" in overrides_for(fp8_config, "adamw")
    # The shipped full configs add their sums on the device; the sweep's variants say where they add
    # them: offload_grads_overlap on the host (the option's default), its twin on the device.
    engine = str(REPO / "configs" / "llama3_1" / "8B_full_offload_engine.yaml")
    assert "~optimizer.grad_sum_on" in overrides_for(engine, "offload_grads_overlap")
    twin = overrides_for(engine, "offload_grads_overlap_device_sums")
    assert "optimizer.grad_sum_on=device" in twin and "~optimizer.grad_sum_on" not in twin
    assert set(twin) - {"optimizer.grad_sum_on=device"} == set(overrides_for(engine, "offload_grads_overlap")) - {
        "~optimizer.grad_sum_on"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_variant_name_means_one_config_for_the_sweep_and_the_planner(name, tmp_path):
    """The planner plans the config the sweep runs: the same overrides, one description."""
    shared = ["clip_grad_norm=1.0", "gradient_accumulation_steps=4"]
    swept = load_config(CONFIG, sweep.variant_overrides(name=name, config=CONFIG, steps=3, output_dir=tmp_path,
                                                        extra=shared))
    planned = variant_config(CONFIG, shared, name)
    for key in ("optimizer", "optimizer_in_bwd", "clip_grad_norm", "gradient_accumulation_steps"):
        assert swept.get(key) == planned.get(key), key
    variant = VARIANTS[name]
    # What a variant needs wins over the shared overrides, in both.
    expected = (None, 1) if variant.needs else (1.0, 4)
    assert (planned.clip_grad_norm, planned.gradient_accumulation_steps) == expected
    assert variant.replaced(shared) == (shared if variant.needs else [])
    if variant.optimizer["_component_"].startswith("bitsandbytes"):
        pytest.importorskip("bitsandbytes")
    chosen = variant.describe()
    assert chosen.component == variant.optimizer["_component_"] and chosen.kind.offloads is ("optimizer_class" in
                                                                                              variant.optimizer)
    assert legend([name, "not-a-variant"]).endswith(f"\n  {name}: {variant.description}") and legend(["x"]) == ""


def test_every_option_of_our_optimizer_is_dropped_for_a_plain_one():
    """A config's own engine option (grad_sum_on, say) would be refused by a plain variant's optimizer."""
    own = [name for name, p in inspect.signature(OffloadOptimizer.__init__).parameters.items()
           if p.kind is p.KEYWORD_ONLY]
    assert own and set(own) <= set(OFFLOAD_ONLY_KEYS)


def test_sweep_runs_variants_and_reports_a_refused_one(tiny_assets, tmp_path, monkeypatch, capsys):
    """The script end to end: three variants, one refused by its config check, then the table, the
    JSON, the plot and (where wandb is installed) one offline W&B run per variant."""
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # then W&B's files go in the sweep's folder
    # Data only from the synthetic dataset: the tiny data file is not named.
    extra = [o for o in tiny_asset_overrides(tiny_assets) if not o.startswith("dataset.")] + SYNTHETIC
    out = tmp_path / "sweep"
    wandb = ["--wandb", "tiny-sweep"] if importlib.util.find_spec("wandb") else []
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--steps", "11", "--variants",
                                      "adamw,offload,paged_adamw8bit_in_bwd,torchao", "--output-dir", str(out), *wandb,
                                      "--", *extra])
    script["main"]()
    printed = capsys.readouterr().out
    results = [VariantResult(**r) for r in json.loads((out / "results.json").read_text())]
    assert [r.name for r in results] == ["adamw", "offload", "paged_adamw8bit_in_bwd", "torchao"]
    adamw, offload, in_bwd, torchao = results
    assert adamw.status == offload.status == "ok" and adamw.steps == offload.steps == adamw.steps_requested == 11
    # Same math: the tiny model's losses agree (fp32, host against device order of operations).
    assert offload.first_loss == pytest.approx(adamw.first_loss, rel=1e-6)
    assert offload.last_loss == pytest.approx(adamw.last_loss, rel=1e-5)
    assert adamw.tokens_per_second > 0 and adamw.peaks_gib["host_rss_peak"] > 0
    # torchtune's in-backward setting runs without clipping or accumulation whatever the shared
    # overrides say (clip_grad_norm=1.0 here), as the planner plans it.
    assert in_bwd.status == "ok" and in_bwd.steps == 11
    assert ("[sweep] paged_adamw8bit_in_bwd runs with clip_grad_norm=null gradient_accumulation_steps=1 in place "
            "of clip_grad_norm=1.0 (what its optimizer needs)") in printed
    # torchao's offloader needs CUDA: refused by the config check, and said so.
    assert torchao.status.startswith("failed") and "device=cpu" in torchao.status
    text = (out / "results.md").read_text()
    assert text.startswith("Device: CPU; whole device. Config") and text in printed
    assert "| adamw | ok |" in text and "| paged_adamw8bit_in_bwd | ok" in text and "| torchao | failed" in text
    assert markdown_table(results).count("\n") == 5 and "| 11 | " in text  # the steps asked for, all logged
    assert f"[sweep] each step's loss, side by side: tune-offload compare {out}" in printed

    # The plot: a PNG with both panels, the refused variant named in its title.
    if importlib.util.find_spec("matplotlib"):
        png = out / "results.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # W&B: one offline run per variant, all in one group (the output folder's name).
    if wandb:
        assert f"[sweep] W&B project tiny-sweep, group sweep: 4 runs (W&B's files: {out / 'wandb'})" in printed
        offline = sorted((out / "wandb").glob("offline-run-*"))
        assert len(offline) == 4 and all(any(d.glob("*.wandb")) for d in offline)


def test_the_fsdp2_variants_run_the_distributed_recipe_on_ranks(tiny_assets, tmp_path, monkeypatch, capsys):
    """--nproc-per-node 2: FSDP2 with torch's AdamW and with the engine on each rank's shards train
    the same losses, bit for bit; the planner refuses to plan them by name."""
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    monkeypatch.chdir(REPO)
    extra = [o for o in tiny_asset_overrides(tiny_assets) if not o.startswith("dataset.")] + SYNTHETIC
    out = tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--steps", "11", "--variants",
                                      "fsdp2_adamw,fsdp2_offload", "--nproc-per-node", "2", "--output-dir", str(out),
                                      "--", *extra, "device=cpu"])
    script["main"]()
    results = {r["name"]: VariantResult(**r) for r in json.loads((out / "results.json").read_text())}
    # Two ranks share each step's data: one epoch of the 96 samples is 6 steps of 8 a rank.
    assert [(r.status, r.steps) for r in results.values()] == [("ok", 6), ("ok", 6)], results
    assert "--nproc_per_node 2 recipes/full_finetune_distributed.py" in (out / "fsdp2_offload" / "run.log").read_text()
    losses = {name: [row["loss"] for row in read_disk_log(out / name)] for name in results}
    assert losses["fsdp2_offload"] == losses["fsdp2_adamw"]
    assert "fsdp2_adamw" not in default_variants()


def test_a_diverging_variant_is_reported_diverged_not_ok(tiny_assets, tmp_path, monkeypatch):
    # On an H100 (2026-11-22) update_on=device trained to nan and the sweep said "ok". lr=1e37 moves
    # every weight by about 1e37 in step 1; step 2 overflows and the recipe stops with an error.
    monkeypatch.chdir(REPO)
    extra = [o for o in tiny_asset_overrides(tiny_assets) if not o.startswith("dataset.")] + SYNTHETIC + [
        "optimizer.lr=1e37", "lr_scheduler.num_warmup_steps=0"]
    result = run_variant(name="offload_device_update", config=CONFIG, steps=11, output_dir=tmp_path, extra=extra,
                         timeout_s=300)
    assert result.status == "diverged"
    # The figures of the steps it logged, the step that diverged last.
    assert result.steps == 2 and math.isfinite(result.first_loss) and result.tokens_per_second > 0
    assert "TrainingDivergedError: Training diverged at step 2" in (tmp_path / "offload_device_update" /
                                                                     "run.log").read_text()
    text = write_results([result], output_dir=tmp_path, header="tiny").read_text()
    assert "| offload_device_update | diverged |" in text
    assert json.loads((tmp_path / "results.json").read_text())[0]["status"] == "diverged"

    # W&B: the run's summary and config say so too (a stand-in module records what it is given).
    summaries, logged, metrics = [], [], []

    def init(**kwargs):
        run = types.SimpleNamespace(id="r1", name=kwargs["name"], group=kwargs["group"], summary={},
                                    log=lambda row, **k: logged.append((row, k)), finish=lambda: None,
                                    config=kwargs["config"], define_metric=lambda *a, **k: metrics.append((a, k)))
        summaries.append(run)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    log_to_wandb([result], project="p", group="g", config={})
    assert summaries[0].summary["status"] == summaries[0].config["status"] == "diverged"
    # Steps on torchtune's WandBLogger's x-axis, global_step, so the runs overlay recipe runs logged to W&B.
    assert metrics == [(("global_step",), {}), (("*",), {"step_metric": "global_step", "step_sync": True})]
    assert [(row["global_step"], k) for row, k in logged] == [(1, {}), (2, {})]
    assert logged[0][0]["loss"] == result.first_loss and "step" not in logged[0][0]
    assert "recipe_config" not in summaries[0].config  # none given
    # What the variant is, in the run's config: a W&B chart can group by the optimizer it set.
    assert summaries[0].config["variant_optimizer"] == {
        "_component_": "torchtune_offload.OffloadOptimizer", "optimizer_class": "torch.optim.AdamW",
        "update_on": "device"}
    assert summaries[0].config["description"] == VARIANTS["offload_device_update"].description
    assert summaries[0].summary["wall_s"] == result.seconds


def test_a_variant_stepping_in_backward_names_that_in_its_wandb_config(monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(kwargs)
        return types.SimpleNamespace(id="r", name=kwargs["name"], group=kwargs["group"], summary={},
                                     finish=lambda: None, define_metric=lambda *a, **k: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    log_to_wandb([VariantResult(name="paged_adamw8bit_in_bwd", status="out of memory", seconds=3.0, output_dir="x")],
                 project="p", group="g", config={"overrides": "device=cpu"},
                 recipe_configs={"paged_adamw8bit_in_bwd": {"optimizer_in_bwd": True}})
    assert runs[0]["config"]["recipe_config"] == {"optimizer_in_bwd": True}
    assert runs[0]["config"]["variant_optimizer"] == {"_component_": "bitsandbytes.optim.PagedAdamW8bit"}
    assert runs[0]["config"]["variant_overrides"] == "optimizer_in_bwd=True clip_grad_norm=null gradient_accumulation_steps=1"
    assert runs[0]["config"]["overrides"] == "device=cpu"  # the sweep's own, given to every variant


def test_a_run_that_logged_a_nonfinite_loss_or_norm_diverged():
    # A run that exited 0 having logged nan (no recipe of ours does now) is not "ok" either.
    assert not diverged([{"step": 1, "loss": 6.2, "grad_norm": 3.0}, {"step": 2, "loss": 6.1}])
    assert diverged([{"step": 1, "loss": 12.17, "grad_norm": 3.0}, {"step": 2, "loss": math.nan, "grad_norm": 1.0}])
    assert diverged([{"step": 1, "loss": 6.2, "grad_norm": math.inf}])


def test_sweep_refuses_wandb_logging_without_wandb_before_running(monkeypatch, capsys):
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--wandb", "p"])
    with pytest.raises(SystemExit):
        script["main"]()
    assert "--wandb needs wandb" in capsys.readouterr().err


def test_sweep_refuses_wandb_online_without_an_api_key_before_running(monkeypatch, capsys):
    """wandb.init would fail (or ask for a key) only at the end, after every variant ran."""
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else find_spec(name, *a))
    logins = []

    def stand_in(mode: str, has_key: bool) -> types.SimpleNamespace:
        settings = types.SimpleNamespace(mode=mode)
        return types.SimpleNamespace(setup=lambda: types.SimpleNamespace(settings=settings),
                                     login=lambda **kw: logins.append(kw) or has_key, teardown=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", stand_in("online", False))
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--wandb", "p"])
    with pytest.raises(SystemExit):
        script["main"]()
    assert "--wandb: W&B has no API key here" in capsys.readouterr().err
    assert logins == [{"prompt": False, "verify": False}]  # no prompt, no network
    for mode, has_key in (("offline", False), ("disabled", False), ("online", True)):
        monkeypatch.setitem(sys.modules, "wandb", stand_in(mode, has_key))
        assert script["_wandb_problem"]() == ""


def test_the_wandb_check_leaves_no_wandb_service_to_the_variants(monkeypatch):
    """With the real wandb: wandb.setup() starts W&B's service and names it in WANDB_SERVICE, which
    every variant would inherit, so the check tears it down; a bad setting is an error, not a traceback."""
    pytest.importorskip("wandb")
    check = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")["_wandb_problem"]
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check() == "" and "WANDB_SERVICE" not in os.environ
    monkeypatch.setenv("WANDB_MODE", "onlin")
    assert check().startswith("--wandb: W&B refuses its settings: ") and "onlin" in check()


def test_a_variant_that_wrote_no_disk_log_is_reported_failed_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # An earlier sweep's log of the variant (replaced with --force) is not read as this run's.
    (tmp_path / "adamw" / "logs").mkdir(parents=True)
    (tmp_path / "adamw" / "logs" / "log_1.txt").write_text("Step 1 | loss:2.0 tokens_per_second:9.0\n")
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0))
    result = run_variant(name="adamw", config=CONFIG, steps=11, output_dir=tmp_path, extra=[], timeout_s=None)
    assert result.status.startswith("failed: no DiskLogger file (logs/log_*.txt) under") and result.steps == 0


def test_a_variant_that_logged_fewer_steps_than_asked_says_so_in_the_table():
    short = VariantResult(name="adamw", status="ok", seconds=5.0, output_dir="x", tokens_per_second=9.0,
                          first_loss=2.0, last_loss=1.0, steps=8, steps_requested=20)
    assert "| 2.0000 -> 1.0000 | 8 of 20 | 5 |" in markdown_table([short])


def test_a_problem_every_variant_has_stops_the_sweep_before_any_run(tiny_assets, tmp_path, monkeypatch, capsys):
    """A misspelt shared override used to start one process per variant, each failing on it."""
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    monkeypatch.chdir(REPO)
    extra = [o for o in tiny_asset_overrides(tiny_assets) if not o.startswith("dataset.")] + SYNTHETIC
    out = tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--steps", "11", "--variants",
                                      "adamw,offload", "--output-dir", str(out), "--", *extra, "batch_sise=2"])
    with pytest.raises(SystemExit) as exit_:
        script["main"]()
    assert exit_.value.code == 2 and not out.exists()
    assert "batch_sise: unknown config key" in capsys.readouterr().err

    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--variants", "adamw,offload,adamw"])
    with pytest.raises(SystemExit):
        script["main"]()
    assert "--variants names adamw more than once" in capsys.readouterr().err

    # A shared override of a key a variant sets would have run SGD under the name adamw.
    for taken in ("optimizer._component_=torch.optim.SGD", "max_steps_per_epoch=3", f"output_dir={tmp_path}",
                  "optimizer_in_bwd=True",
                  "metric_logger._component_=torchtune.training.metric_logging.WandBLogger"):
        monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", "--config", CONFIG, "--variants", "adamw,offload",
                                          "--output-dir", str(out), "--", *extra, taken])
        with pytest.raises(SystemExit):
            script["main"]()
        assert f"set keys the sweep or a variant sets: {taken}" in capsys.readouterr().err and not out.exists()

    # A refusal of some variants only is theirs: the sweep runs the others and reports it.
    args = types.SimpleNamespace(config=CONFIG, steps=11, output_dir=str(out))
    assert "device=cpu" in script["_shared_config_problem"](args, ["torchao"], extra)
    assert script["_shared_config_problem"](args, ["torchao", "adamw"], extra) == ""
    # A variant's own settings win over the shared ones for it alone: not refused.
    assert script["_shared_config_problem"](args, ["paged_adamw8bit_in_bwd"], extra) == ""


def test_grad_probe_records_the_global_norm_per_step(tmp_path, monkeypatch):
    path = tmp_path / "probe.jsonl"
    monkeypatch.setenv(ENV, str(path))
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    # Two per-parameter optimizers, as offloading optimizers run them: their lines of a step add up.
    optimizers = [GradNormProbeAdamW([p], lr=0.1) for p in params]
    for grads in ([3.0, 0.0, 0.0], [4.0, 0.0]), ([1.0, 1.0, 1.0], [1.0, 0.0]):
        for p, g, opt in zip(params, grads, optimizers):
            p.grad = torch.tensor(g)
            opt.step()
    assert read_probe(path) == pytest.approx({1: 5.0, 2: 2.0})
    assert math.isclose(read_probe(path)[2], 2.0)


def test_ballast_needs_a_positive_limit():
    with pytest.raises(ValueError, match="--gpu-memory-gib"):
        GpuBallast(leave_gib=0)


def _sweep_error(monkeypatch, capsys, *args: str) -> str:
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    monkeypatch.setattr(sys, "argv", ["benchmark_sweep.py", *args])
    with pytest.raises(SystemExit):
        script["main"]()
    return capsys.readouterr().err


def test_sweep_keeps_an_earlier_sweeps_results_unless_forced(tmp_path, monkeypatch, capsys):
    # Before: a second sweep into the same folder replaced the first one's table without a word.
    (tmp_path / "results.json").write_text("{}")
    err = _sweep_error(monkeypatch, capsys, "--config", CONFIG, "--output-dir", str(tmp_path), "--variants", "adamw")
    assert "holds an earlier sweep's results" in err and "--force" in err
    assert (tmp_path / "results.json").read_text() == "{}"
    # A variant's log from an earlier sweep counts too.
    (tmp_path / "results.json").unlink()
    (tmp_path / "adamw").mkdir()
    (tmp_path / "adamw" / "run.log").write_text("earlier")
    err = _sweep_error(monkeypatch, capsys, "--config", CONFIG, "--output-dir", str(tmp_path), "--variants", "adamw")
    assert "adamw/run.log" in err
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")
    assert script["_output_dir_problem"](tmp_path, ["adamw"], force=True) == ""
    assert script["_output_dir_problem"](tmp_path, ["offload"], force=False) == ""


@pytest.mark.parametrize("args, expected", [
    (("--config", "no/such.yaml"), "--config no/such.yaml: no such file"),
    (("--config", CONFIG, "--timeout-s", "0"), "--timeout-s 0.0: must be a positive number"),
    (("--config", CONFIG, "--timeout-s", "nan"), "--timeout-s nan: must be a positive number"),
    (("--config", CONFIG, "--output-dir", CONFIG), "is a file; give a folder"),
])
def test_sweep_refuses_bad_arguments_before_running(monkeypatch, capsys, args, expected):
    assert expected in _sweep_error(monkeypatch, capsys, *args)


@pytest.mark.parametrize("user_setting", [None, "max_split_size_mb:128"])
def test_every_variant_runs_on_the_allocator_setting_offload_runs_get(monkeypatch, tmp_path, user_setting):
    """The recipes give offload runs expandable segments; the sweep gives them to every variant, so
    reserved and NVML peaks compare optimizers, not allocator settings. The user's setting wins."""
    if user_setting is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_setting)
    seen = []

    def fake_run(cmd, *, env, **kwargs):
        seen.append(env.get("PYTORCH_CUDA_ALLOC_CONF"))
        return types.SimpleNamespace(returncode=1)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    for name in ("adamw", "paged_adamw8bit", "offload_grads_overlap"):
        run_variant(name=name, config=CONFIG, steps=2, output_dir=tmp_path, extra=[], timeout_s=10)
    assert seen == [user_setting or EXPANDABLE_SEGMENTS] * 3
    assert sweep.variant_environment()["CUDA_DEVICE_ORDER"] == os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


@pytest.mark.parametrize("visible, expected", [
    (None, ("index", 0)), ("2,0", ("index", 2)), ("GPU-1234-abcd", ("index", 1)), ("GPU-1234", ("index", 1)),
])
def test_the_nvml_baseline_is_read_from_the_gpu_the_variants_train_on(monkeypatch, visible, expected):
    """The run's NVML peak less the baseline: both of one GPU, the first one CUDA_VISIBLE_DEVICES names."""
    looked_up = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: looked_up.append(("index", i)) or i,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetUUID=lambda handle: ["GPU-9999-ffff", "GPU-1234-abcd"][handle],
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=3 if handle == expected[1] else 5),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sweep._nvml_used_bytes() == 3 and looked_up[-1] == expected


def test_the_header_says_paged_variants_page_nothing_on_the_cpu():
    """bitsandbytes falls back to ordinary states without CUDA: a CPU sweep's paged rows are not paging."""
    header = runpy.run_path(str(REPO / "scripts" / "benchmark_sweep.py"), run_name="benchmark_sweep")["_header"]
    args = types.SimpleNamespace(config="c.yaml", steps=11, variants="adamw,paged_adamw8bit")
    assert header("CPU", "; whole device", args, []).endswith("page nothing (no CUDA unified memory).")
    assert "page nothing" not in header("NVIDIA H100", "; whole device", args, [])
    assert "page nothing" not in header("CPU", "; whole device", types.SimpleNamespace(
        config="c.yaml", steps=11, variants="adamw,offload"), [])
