"""The single-device recipes, run for real on the tiny assets (CPU, fp32).

Most runs happen in-process (the recipe class built from an OmegaConf config), which is several
times faster than ``tune run``; one ``tune run`` per recipe proves the command line and the
``optimizer._component_`` swap. Every comparison pairs an offload run with a plain-AdamW run of the
same config, and every reference run is also checked to learn (loss falls).
"""

import gzip
import json
import re
import subprocess
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torchtune.modules.peft import get_adapter_state_dict

from tests import zygote
from tests.recipe.cpu_setup import cpu_recipe_setup
from tests.recipe_harness import TUNE, load_recipe_module, tiny_asset_overrides, working_tree_env
from torchtune_offload.bench.trace_summary import summarize
from torchtune_offload.recipe import OptimizerKind, build_optimizer, describe_optimizer, read_disk_log

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {kind: REPO_ROOT / "configs" / "tiny" / f"{kind}.yaml" for kind in ("full", "lora")}
RECIPE_FILES = {"full": "full_finetune_single_device", "lora": "lora_finetune_single_device"}
RECIPE_CLASSES = {"full": "FullFinetuneRecipeSingleDevice", "lora": "LoRAFinetuneRecipeSingleDevice"}
WEIGHTS = "model-00001-of-00001.safetensors"  # what FullModelHFCheckpointer writes into epoch_<N>/
FP32 = dict(rtol=1.3e-6, atol=1e-5)

OFFLOAD = [
    "optimizer._component_=torchtune_offload.OffloadOptimizer",
    "optimizer.optimizer_class=torch.optim.AdamW",
]
# Accumulation and a clip far below the tiny model's gradient norm (about 3), with the configs'
# cosine schedule: the settings where a post-backward scale or clip would miss offloaded gradients.
CLIP = "clip_grad_norm=0.5"
FULL_EQUIV = ["max_steps_per_epoch=5", "batch_size=4", "gradient_accumulation_steps=3", CLIP]
LORA_EQUIV = ["max_steps_per_epoch=12", "batch_size=4", "gradient_accumulation_steps=2", CLIP]
LEARN = ["max_steps_per_epoch=30", "batch_size=8"]
RESUME = ["epochs=2", "max_steps_per_epoch=4", "batch_size=4", "gradient_accumulation_steps=2", CLIP]
FULL_OFFLOAD = [*OFFLOAD, "optimizer.minimal_size=1024"]  # most tiny-model weights go to the host
LORA_OFFLOAD = [*OFFLOAD, "optimizer.minimal_size=256"]  # every LoRA matrix goes to the host
CPU_LOG_KEYS = {"loss", "lr", "tokens_per_second", "grad_norm", "host_rss", "host_rss_peak"}
OFFLOAD_LOG_KEYS = {"optimizer_host", "optimizer_pinned", "optimizer_device_saved", "offload_wait_s",
                    "host_step_s", "grad_copy_s", "param_copy_s", "offload_step_s", "host_step_hidden"}
SUM_LOG_KEYS = {"grad_sum_wait_s", "grad_sum_add_s"}  # with offload_gradients


def _load_recipe_class(kind: str) -> type:
    return getattr(load_recipe_module(RECIPE_FILES[kind]), RECIPE_CLASSES[kind])


def _config(kind: str, assets: Path, output_dir: Path, overrides: List[str]) -> DictConfig:
    cfg = OmegaConf.load(CONFIGS[kind])
    dotlist = [f"output_dir={output_dir}", *tiny_asset_overrides(assets), *overrides]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))


class Run:
    """What the tests read from one in-process recipe run."""

    def __init__(self, recipe, output_dir: Path, log_file: Path) -> None:
        self.recipe = recipe
        self.output_dir = output_dir
        self.losses = list(recipe._loop.losses)
        self.log = read_disk_log(log_file)
        self.params = {k: v.detach().clone() for k, v in recipe._model.state_dict().items()}


class _Killed(Exception):
    """Stands in for a job killed between two epochs."""


def run_recipe(
    kind: str,
    assets: Path,
    output_dir: Path,
    *overrides: str,
    stop_after_epoch: Optional[int] = None,
    before_train: Optional[Callable[[Any], None]] = None,
) -> Run:
    """Runs a recipe in-process; with ``stop_after_epoch`` it dies right after that epoch's checkpoint."""
    log_file = output_dir / "logs" / f"run_{len(list(output_dir.glob('logs/run_*.txt')))}.txt"
    cfg = _config(kind, assets, output_dir, [*overrides, f"metric_logger.filename={log_file.name}"])
    recipe = _load_recipe_class(kind)(cfg)
    recipe.setup(cfg)
    if before_train is not None:
        before_train(recipe)
    if stop_after_epoch is not None:
        save = recipe._checkpoints.save

        def save_then_die(**kwargs: Any) -> Path:
            path = save(**kwargs)
            # The checkpoint written at the epoch's end, to start the next epoch from.
            if recipe.progress.epochs_run == stop_after_epoch + 1 and recipe.progress.steps_run_in_epoch == 0:
                raise _Killed
            return path

        recipe._checkpoints.save = save_then_die
    try:
        recipe.train()
    except _Killed:
        pass
    finally:
        recipe.cleanup()
    return Run(recipe, output_dir, log_file)


_cpu_setup = pytest.fixture(autouse=True, scope="module")(cpu_recipe_setup)


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    """Memoised in-process runs, so tests that read the same run share it."""
    cache: Dict[tuple, Run] = {}

    def get(kind: str, *overrides: str) -> Run:
        key = (kind, *overrides)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{kind}_run")
            cache[key] = run_recipe(kind, tiny_assets, out, *overrides)
        return cache[key]

    return get


def _grad_norms(run: Run) -> torch.Tensor:
    return torch.tensor([row["grad_norm"] for row in run.log])


def _saved_weights(run: Run, epoch: int = 0) -> Dict[str, torch.Tensor]:
    return load_file(run.output_dir / f"epoch_{epoch}" / WEIGHTS)


def _assert_same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m: f"{k}: {m}", **tol)


# ------------------------------------------------------------------------- full: equivalence


def test_weights_the_device_cannot_hold_are_refused_before_the_model_is_built(tiny_assets, tmp_path, monkeypatch):
    """The full recipe asks whether the checkpoint's weights fit the device (a CUDA device's free
    memory: torch.cuda.mem_get_info, faked in tests/recipe/test_grad_math_and_memory.py) before it
    builds the model there; a refusal ends setup with nothing built."""
    module = load_recipe_module(RECIPE_FILES["full"])
    seen = {}

    def refuse(weights, *, device, dtype, device_weights=None):
        seen.update(names=set(weights), device=device, dtype=dtype, device_weights=device_weights)
        raise ValueError("no room")

    monkeypatch.setattr(module, "check_weights_fit_device", refuse)
    monkeypatch.setattr(module, "instantiate_model", lambda *args, **kwargs: pytest.fail("the model was built"))
    cfg = _config("full", tiny_assets, tmp_path, [*FULL_OFFLOAD, "optimizer.device_weights=fp8"])
    recipe = getattr(module, RECIPE_CLASSES["full"])(cfg)
    with pytest.raises(ValueError, match="no room"):
        recipe.setup(cfg)
    recipe.cleanup()
    assert seen["device_weights"] == "fp8" and seen["dtype"] == recipe.settings.dtype
    assert seen["device"] == recipe.settings.device and "tok_embeddings.weight" in seen["names"]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_misspelt_dataset_option_is_named_before_the_weights_load(tiny_assets, tmp_path, monkeypatch, kind):
    """torchtune's dataset builders pass unknown options on to load_dataset, so the config check cannot
    know them: the recipe names the option when it builds the data, before it reads the checkpoint."""
    module = load_recipe_module(RECIPE_FILES[kind])
    monkeypatch.setattr(module, "load_checkpoint", lambda *args, **kwargs: pytest.fail("the checkpoint was read"))
    cfg = _config(kind, tiny_assets, tmp_path, ["dataset.train_on_inputs=True"])
    recipe = getattr(module, RECIPE_CLASSES[kind])(cfg)
    with pytest.raises(ValueError, match=re.escape("dataset.train_on_inputs: neither torchtune.datasets.instruct_dataset "
                                                   "nor the datasets library")) as raised:
        recipe.setup(cfg)
    recipe.cleanup()
    assert "Did you mean 'dataset.train_on_input'?" in str(raised.value)


def test_a_nulled_scheduler_runs_at_a_constant_learning_rate_and_says_so(runs, capsys):
    """torchtune reads lr_scheduler=null on the command line as lr_scheduler._component_=null (and
    cannot delete a component with ~lr_scheduler): the recipe runs without a schedule, and says so,
    instead of failing in torchtune's instantiate after the weights have loaded."""
    plain = runs("full", *FULL_EQUIV)
    flat = runs("full", *FULL_EQUIV, "lr_scheduler._component_=null")
    assert "lr_scheduler._component_ is null: no schedule" in capsys.readouterr().out
    rates = [row["lr"] for row in flat.log]
    assert len(rates) == 5 and set(rates) == {float(OmegaConf.load(CONFIGS["full"]).optimizer.lr)}, rates
    assert len({row["lr"] for row in plain.log}) > 1  # the shipped config's schedule warms up


def test_a_lora_model_the_device_cannot_hold_is_refused_before_the_weights_load(tiny_assets, tmp_path, monkeypatch):
    """The LoRA recipe asks whether its model fits the device (faked in
    tests/recipe/test_grad_math_and_memory.py) before it reads the checkpoint and builds the model
    there; a refusal ends setup with neither done."""
    module = load_recipe_module(RECIPE_FILES["lora"])
    seen = {}

    def refuse(cfg_model, settings):
        seen.update(component=cfg_model._component_, settings=settings)
        raise ValueError("no room")

    monkeypatch.setattr(module, "check_lora_model_fits_device", refuse)
    for never in ("load_checkpoint", "instantiate_model"):
        monkeypatch.setattr(module, never, lambda *args, _never=never, **kwargs: pytest.fail(f"{_never} ran"))
    cfg = _config("lora", tiny_assets, tmp_path, [])
    recipe = getattr(module, RECIPE_CLASSES["lora"])(cfg)
    with pytest.raises(ValueError, match="no room"):
        recipe.setup(cfg)
    recipe.cleanup()
    assert seen == {"component": cfg.model._component_, "settings": recipe.settings}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_full_offload_matches_plain_adamw(runs, tiny_assets, offload_gradients, overlap):
    plain = runs("full", *FULL_EQUIV)
    off = runs("full", *FULL_EQUIV, *FULL_OFFLOAD, f"optimizer.offload_gradients={offload_gradients}",
               f"optimizer.overlap={overlap}")
    assert off.recipe._optimizer.optimizer.overlap is overlap

    report = off.recipe._optimizer.memory_report()
    assert report.num_offloaded > 0 and report.num_on_device > 0  # both step paths are exercised
    assert off.recipe._optimizer.optimizer.offload_gradients is offload_gradients
    if offload_gradients or overlap:
        # The recipe passes named parameters: one hand-off per layer (2) and per bucket of the others
        # (the embedding, the final norm, the output) a micro-batch (5 steps of 3).
        assert 15 * 2 < off.recipe._optimizer.optimizer.handoff_count() <= 15 * (2 + 4)
    assert len(plain.losses) == len(off.losses) == 5
    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(plain.losses), **FP32)
    # The clip bites (norm above 0.5) in every step, so equal norms and losses mean equal clipping.
    assert (_grad_norms(plain) > 0.5).all()
    torch.testing.assert_close(_grad_norms(off), _grad_norms(plain), **FP32)
    torch.testing.assert_close([r["lr"] for r in off.log], [r["lr"] for r in plain.log])

    # The saved checkpoints agree, and training moved them away from the initial weights.
    saved_plain, saved_off = _saved_weights(plain), _saved_weights(off)
    _assert_same_tensors(saved_off, saved_plain, **FP32)
    initial = load_file(tiny_assets / "model" / "model.safetensors")
    assert initial.keys() == saved_plain.keys()
    assert all(not torch.equal(initial[k], saved_plain[k]) for k in initial)
    _assert_same_tensors(off.params, plain.params, **FP32)


def test_a_handoff_per_parameter_from_the_config_trains_as_plain_adamw(runs, tiny_assets):
    plain = runs("full", *FULL_EQUIV)
    off = runs("full", *FULL_EQUIV, *FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True",
               "optimizer.handoff=parameter")
    engine = off.recipe._optimizer.optimizer
    assert engine.options.handoff == "parameter" and "handoff=parameter" in off.recipe._optimizer.name
    # One hand-off per gradient: every trainable tensor a micro-batch (5 steps of 3).
    tensors = sum(1 for p in off.recipe._model.parameters() if p.requires_grad)
    assert engine.handoff_count() == engine.hook_call_count() == 15 * tensors
    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(plain.losses), **FP32)
    torch.testing.assert_close(_grad_norms(off), _grad_norms(plain), **FP32)


def test_a_profiled_run_trains_the_same_bits_and_traces_the_engine_on_each_thread(runs):
    """``profiler.enabled``: the trace names the engine's ranges on the training thread and on its
    host threads (the overlap step and the staging ring's adder), which torch records only when it
    profiles every thread (``profiler.all_threads``, on by default); profiling changes no bit."""
    settings = (*FULL_EQUIV, *FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True")
    schedule = ("profiler.enabled=True", "profiler.wait_steps=1", "profiler.warmup_steps=1",
                "profiler.active_steps=2", "profiler.num_cycles=1")
    plain = runs("full", *settings)
    profiled = runs("full", *settings, *schedule)
    assert torch.equal(torch.tensor(profiled.losses), torch.tensor(plain.losses))
    summary = summarize(profiled.output_dir / "profiling_outputs")
    assert [number for number, _ in summary.steps] == [2, 3]
    # The steps the profiler warmed up (global step 2) and recorded (3, 4) are marked in the log,
    # so that a median of tok/s leaves them out.
    assert [r["step"] for r in profiled.log if r.get("profiled")] == [2, 3, 4]
    assert not any("profiled" in r for r in plain.log)
    threads = _threads_of_ranges(summary)
    training = summary.training_thread
    assert threads["offload/gradient hook"] == {training}
    # Each window's 3 micro-batches: the two later ones go through the staging ring's adder thread.
    assert {*threads["offload/sum: add"], *threads["offload/host step"]}.isdisjoint({training})
    assert not summary.device_s  # a CPU-only run: no device rows to read

    one_thread = summarize(runs("full", *settings, *schedule, "profiler.all_threads=False").output_dir)
    assert set(_threads_of_ranges(one_thread)["offload/gradient hook"]) == {one_thread.training_thread}
    assert len({thread for thread, _ in one_thread.ranges}) == 1

    # With stacks recorded (torchtune's verbose option, kept beside every thread's): both show.
    stacks = summarize(runs("full", *settings, *schedule, "profiler.with_stack=True").output_dir)
    assert _threads_of_ranges(stacks)["offload/sum: add"]
    with gzip.open(stacks.source, "rt") as f:
        assert any("Call stack" in e.get("args", {}) for e in json.load(f)["traceEvents"])


def _threads_of_ranges(summary) -> Dict[str, set]:
    threads: Dict[str, set] = {}
    for thread, name in summary.ranges:
        threads.setdefault(name, set()).add(thread)
    return threads


@pytest.mark.parametrize("overlap", [False, True])
def test_full_device_update_matches_plain_adamw_bit_for_bit(runs, overlap):
    """update_on=device runs plain AdamW's own kernel on the device (here the CPU emulation): the
    same bits as plain AdamW, slice by slice through a staging area smaller than the largest weight."""
    plain = runs("full", *FULL_EQUIV)
    dev = runs("full", *FULL_EQUIV, *FULL_OFFLOAD, "optimizer.update_on=device", "optimizer.device_staging_mib=0.25",
               f"optimizer.overlap={overlap}")
    opt = dev.recipe._optimizer.optimizer
    assert opt.options.update_on == "device" and opt.overlap is overlap
    report = opt.memory_report()
    assert report.num_offloaded > 0 and 0 < report.device_staging_bytes <= 0.25 * 2**20
    assert any(len(opt._streamer.slices(s)) > 1 for s in opt._slots if s.streamed)
    assert dev.losses == plain.losses and len(dev.losses) == 5
    assert torch.equal(_grad_norms(dev), _grad_norms(plain))
    assert all(torch.equal(dev.params[k], plain.params[k]) for k in plain.params)
    assert {"optimizer_host", "optimizer_device_staging", "offload_wait_s", "state_upload_s",
            "state_download_s"} <= dev.log[-1].keys()


# ------------------------------------------------------------------------ full: 8-bit host states

ADAMW8BIT = "optimizer._component_=torchtune_offload.AdamW8bit"
OFFLOAD_8BIT = ["optimizer._component_=torchtune_offload.OffloadOptimizer",
                "optimizer.optimizer_class=torchtune_offload.AdamW8bit", "optimizer.minimal_size=1024",
                "optimizer.offload_gradients=True", "optimizer.overlap=True"]


def test_full_offload_8bit_matches_adamw8bit_alone_and_learns(runs):
    """AdamW8bit as the engine's host base optimizer (offload_gradients, overlap, accumulation,
    clipping, the config's schedule) against AdamW8bit stepping the whole model itself."""
    alone = runs("full", *FULL_EQUIV, ADAMW8BIT)
    off = runs("full", *FULL_EQUIV, *OFFLOAD_8BIT)
    opt = off.recipe._optimizer.optimizer
    eight_bit = [s for s in opt._slots
                 if s.offloaded and s.optimizer.state[s.step_param]["state1"].dtype == torch.uint8]
    assert eight_bit and any(not s.offloaded for s in opt._slots)  # 8-bit host states, and device steps
    assert len(off.losses) == len(alone.losses) == 5
    # Gradient norms summed in another order may differ in the last bit, and so the clip's scale.
    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(alone.losses), **FP32)
    torch.testing.assert_close(_grad_norms(off), _grad_norms(alone), **FP32)
    _assert_same_tensors(off.params, alone.params, **FP32)
    learn = runs("full", *LEARN, *OFFLOAD_8BIT).losses
    assert sum(learn[-5:]) / 5 < learn[0] - 1.0, learn


def test_full_fp8_device_weights_learn_as_the_full_precision_run_does(runs):
    """FP8 layer weights on the device (the tiny model's offloaded linears): the run learns, its
    losses stay near the full-precision run's, and its saved weights are the host masters."""
    engine = [*FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True"]
    full = runs("full", *LEARN, *engine)
    fp8 = runs("full", *LEARN, *engine, "optimizer.device_weights=fp8")
    opt = fp8.recipe._optimizer.optimizer
    held = opt._weights.held
    assert held and all(".layers." in f".{s.key}" for s in held)
    for slot in held:
        assert slot.param.untyped_storage().nbytes() == slot.param.element_size()  # no full device copy
        assert torch.equal(fp8.params[slot.key], slot.step_param)
    learn = fp8.losses
    assert sum(learn[-5:]) / 5 < learn[0] - 1.0, learn
    full_tail, fp8_tail = sum(full.losses[-5:]) / 5, sum(learn[-5:]) / 5
    assert abs(fp8_tail - full_tail) <= 0.02 * full_tail, (fp8_tail, full_tail)
    assert fp8.losses != full.losses  # the forward did use the FP8 images


# ---------------------------------------------------------------------- full: learns, bitsandbytes


def test_full_loss_falls(runs):
    losses = runs("full", *LEARN).losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_bitsandbytes_paged_adamw_on_cpu(runs):
    pytest.importorskip("bitsandbytes")
    plain = runs("full", *LEARN)
    paged = runs("full", *LEARN, "optimizer._component_=bitsandbytes.optim.PagedAdamW")
    optimizer = paged.recipe._optimizer.optimizer
    assert type(optimizer).__name__ == "PagedAdamW"
    # bitsandbytes warns that CPU has no paging and keeps plain fp32 moments in host memory.
    state = [s for s in optimizer.state.values() if s]
    assert state and all(s["state1"].dtype == s["state2"].dtype == torch.float32 for s in state)
    assert sum(paged.losses[-5:]) / 5 < paged.losses[0] - 1.0, paged.losses
    # On CPU bitsandbytes falls back to unpaged 32-bit AdamW: the same math, in another op order.
    torch.testing.assert_close(
        torch.tensor(paged.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-4
    )


# ------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("overlap", [False, True])
def test_lora_offload_matches_plain_adamw(runs, tiny_assets, overlap):
    plain = runs("lora", *LORA_EQUIV)
    off = runs("lora", *LORA_EQUIV, *LORA_OFFLOAD, "optimizer.offload_gradients=True", f"optimizer.overlap={overlap}")

    optimizer = off.recipe._optimizer
    report = optimizer.memory_report()
    lora_params = [n for n, p in off.recipe._model.named_parameters() if p.requires_grad]
    assert lora_params and all(".lora_" in n for n in lora_params)
    assert report.num_offloaded == len(lora_params) and report.num_on_device == 0

    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(plain.losses), **FP32)
    assert (_grad_norms(plain) > 0.5).all()
    torch.testing.assert_close(_grad_norms(off), _grad_norms(plain), **FP32)
    _assert_same_tensors(off.params, plain.params, **FP32)
    assert sum(plain.losses[-3:]) / 3 < plain.losses[0] - 0.75, plain.losses

    # The adapter checkpoint holds exactly the trained adapters.
    epoch_dir = off.output_dir / "epoch_0"
    for name in ("adapter_model.pt", "adapter_model.safetensors", "adapter_config.json"):
        assert (epoch_dir / name).is_file(), name
    adapter = torch.load(epoch_dir / "adapter_model.pt", weights_only=True)
    _assert_same_tensors(adapter, get_adapter_state_dict(off.params), rtol=0, atol=0)
    assert (epoch_dir / WEIGHTS).is_file()  # the merged model, as save_adapter_weights_only=False


def test_lora_checkpoint_leaves_base_weights_alone(tiny_assets, tmp_path):
    """Merging adapters for the checkpoint must not write into the live model (on CPU .cpu() aliases)."""
    base = {}

    def snapshot(recipe):
        state = recipe._model.state_dict()
        base.update({k: v.detach().clone() for k, v in state.items() if ".lora_" not in k})

    run = run_recipe(
        "lora", tiny_assets, tmp_path, "max_steps_per_epoch=2", "batch_size=4", before_train=snapshot
    )
    after = {k: v for k, v in run.params.items() if ".lora_" not in k}
    _assert_same_tensors(after, base, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("full", [*FULL_OFFLOAD, "optimizer.offload_gradients=True"]),
        ("full", [*FULL_OFFLOAD, "optimizer.offload_gradients=False", "optimizer.overlap=True"]),
        # FP8 device weights: the checkpoints hold the host masters, and the resumed run re-quantizes them.
        ("full", [*FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True",
                  "optimizer.device_weights=fp8"]),
        ("lora", [*LORA_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True"]),
    ],
)
def test_resume_after_epoch_is_exact(kind, overrides, tiny_assets, tmp_path):
    straight = run_recipe(kind, tiny_assets, tmp_path / "straight", *RESUME, *overrides)
    assert len(straight.losses) == 8

    killed = run_recipe(kind, tiny_assets, tmp_path / "killed", *RESUME, *overrides, stop_after_epoch=0)
    assert killed.losses == straight.losses[:4]
    assert (tmp_path / "killed" / "checkpoints" / "step_00000004" / "complete.json").is_file()
    assert not (tmp_path / "killed" / "epoch_1").exists()

    # No path to edit: the newest complete checkpoint in output_dir is found.
    resumed = run_recipe(kind, tiny_assets, tmp_path / "killed", *RESUME, *overrides, "resume_from_checkpoint=True")
    assert resumed.recipe.progress.epochs_run == 2
    assert resumed.losses == straight.losses[4:]
    assert [r["step"] for r in resumed.log] == [5, 6, 7, 8]
    assert [r["lr"] for r in resumed.log] == [r["lr"] for r in straight.log[4:]]
    assert [r["grad_norm"] for r in resumed.log] == [r["grad_norm"] for r in straight.log[4:]]
    _assert_same_tensors(resumed.params, straight.params, rtol=0, atol=0)
    _assert_same_tensors(_saved_weights(resumed, 1), _saved_weights(straight, 1), rtol=0, atol=0)


# ----------------------------------------------------------------------------------- metrics


def test_logged_metrics_on_cpu(runs):
    plain = runs("full", *FULL_EQUIV)
    off = runs("full", *FULL_EQUIV, *FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=False")
    overlapped = runs("full", *FULL_EQUIV, *FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True")
    assert [r["step"] for r in plain.log] == [1, 2, 3, 4, 5]
    for row in plain.log:
        assert set(row) - {"step"} == CPU_LOG_KEYS
    for row in off.log:
        # No allocator or NVML figures on a CPU device: there is no device memory to report.
        assert set(row) - {"step"} == CPU_LOG_KEYS | OFFLOAD_LOG_KEYS | SUM_LOG_KEYS
        assert row["host_rss_peak"] >= row["host_rss"] > 0 and row["tokens_per_second"] > 0
        assert row["optimizer_device_saved"] > 0 and row["optimizer_host"] > row["optimizer_device_saved"]
        assert row["optimizer_pinned"] == 0  # nothing to pin for on a CPU-only machine
        # Serial: the training thread runs the host step inside step() and waits for all of it. Its
        # wait may exceed step()'s own time: clipping, before step(), waits for the gradients too.
        assert 0 <= row["host_step_s"] <= row["offload_wait_s"]
        assert row["host_step_s"] <= row["offload_step_s"]
        assert row["host_step_hidden"] == 0 and row["grad_copy_s"] > 0 and row["param_copy_s"] > 0
        # 3 micro-batches a step: the later two are added on the staging ring's thread.
        assert row["grad_sum_add_s"] > 0 and row["grad_sum_wait_s"] > 0
    assert [r["loss"] for r in off.log] == pytest.approx(off.losses, rel=1e-12)
    for i, row in enumerate(overlapped.log):
        # Overlapped: host steps run on the step thread and a window's finish during the next one,
        # so the first step() may have no host step behind it to report a hidden share of (or may,
        # where a host step queued in its backward ended before it returned: seen in 2 of 8 runs).
        keys = CPU_LOG_KEYS | OFFLOAD_LOG_KEYS | SUM_LOG_KEYS
        assert set(row) - {"step"} == keys or (i == 0 and set(row) - {"step"} == keys - {"host_step_hidden"})
        if i > 0:
            assert row["host_step_s"] > 0 and 0 <= row["host_step_hidden"] <= 1 and row["offload_wait_s"] >= 0


# --------------------------------------------------------------------------------- tune run


def _tune_run(kind: str, assets: Path, output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        *TUNE, "run", f"recipes/{RECIPE_FILES[kind]}.py", "--config", f"configs/tiny/{kind}.yaml",
        f"output_dir={output_dir}", *tiny_asset_overrides(assets), *overrides,
    ]
    # PYTHONPATH: the working tree's torchtune_offload, not an installed copy.
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")
    return zygote.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("full", [*FULL_OFFLOAD, "optimizer.offload_gradients=True"]),
        ("lora", [*LORA_OFFLOAD, "optimizer.offload_gradients=True"]),
    ],
)
def test_tune_run_with_offload_from_command_line(kind, overrides, tiny_assets, tmp_path):
    result = _tune_run(kind, tiny_assets, tmp_path, *overrides, "max_steps_per_epoch=3", "batch_size=4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The start line names what the options set, not only the engine.
    assert "optimizer OffloadOptimizer (offload; base AdamW; offload_gradients)." in result.stdout + result.stderr
    # The end: one line with the run's speed and memory, and how to compare runs.
    assert re.search(r"Finished: [0-9.]+ tok/s \(median of the logged steps after the first\); peak memory, GiB: "
                     r".*host_rss_peak [0-9.]+.*\. `tune-offload compare NAME=<output_dir> \.\.\.` puts runs side by "
                     r"side\.", result.stdout + result.stderr), (result.stdout + result.stderr)[-3000:]
    (log_file,) = (tmp_path / "logs").glob("log_*.txt")
    rows = read_disk_log(log_file)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert CPU_LOG_KEYS | OFFLOAD_LOG_KEYS | SUM_LOG_KEYS <= set(row)
        assert row["grad_norm"] > 0 and row["tokens_per_second"] > 0
    assert (tmp_path / "epoch_0" / WEIGHTS).is_file()
    if kind == "lora":
        assert (tmp_path / "epoch_0" / "adapter_model.safetensors").is_file()


def test_a_run_logged_to_wandb_gets_its_median_speed_and_peaks_in_the_run_summary(tiny_assets, tmp_path):
    """W&B's own summary holds each key's last value: one step's tok/s, the last line's peaks."""
    pytest.importorskip("wandb")
    cmd = [*TUNE, "run", "recipes/full_finetune_single_device.py", "--config", "configs/tiny/full.yaml",
           f"output_dir={tmp_path}", *tiny_asset_overrides(tiny_assets), "max_steps_per_epoch=3",
           "metric_logger._component_=torchtune.training.metric_logging.WandBLogger", "metric_logger.project=p"]
    env = working_tree_env(TIKTOKEN_CACHE_DIR="", WANDB_MODE="offline", WANDB_SILENT="false")
    result = zygote.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    finished = re.search(r"Finished: ([0-9.]+) tok/s .*host_rss_peak ([0-9.]+)\.$", out, re.MULTILINE)
    assert finished, out[-3000:]  # no pointer to compare: it reads DiskLogger files, and there are none
    summary = out.split("Run summary:")[1]
    assert float(re.search(r"tokens_per_second_median ([0-9.]+)", summary).group(1)) == pytest.approx(
        float(finished.group(1)), abs=0.06)
    assert float(re.search(r"host_rss_peak_gib ([0-9.]+)", summary).group(1)) == pytest.approx(
        float(finished.group(2)), abs=0.006)
    with pytest.raises(FileNotFoundError, match="logged to W&B only"):
        read_disk_log(tmp_path)


# ------------------------------------------------------------------------------- bad configs


def _bad(kind: str, assets: Path, tmp_path: Path, *overrides: str, delete=()) -> str:
    """The message of the ValueError the recipe's constructor raises; nothing may be built first."""
    cfg = _config(kind, assets, tmp_path, list(overrides))
    for key in delete:
        cfg.pop(key)
    cls = _load_recipe_class(kind)
    with pytest.MonkeyPatch.context() as mp:
        def refuse(*args, **kwargs):
            raise AssertionError("a component was instantiated before the config was checked")

        mp.setattr("torchtune.config.instantiate", refuse)
        with pytest.raises(ValueError) as info:
            cls(cfg)
    assert not any(tmp_path.iterdir()), "the recipe wrote output before rejecting its config"
    return str(info.value)


CPU_AO = "optimizer._component_=torchtune_offload.CPUOffloadOptimizer"
ACCUM2 = "gradient_accumulation_steps=2"
CLIP1 = "clip_grad_norm=1.0"


def _case(name, overrides, *expected, kind="full", delete=()):
    return pytest.param(kind, overrides, delete, expected, id=name)


BAD_CONFIGS = [
    _case("typo", ["gradient_acumulation_steps=2"],
          "gradient_acumulation_steps: unknown", "Did you mean 'gradient_accumulation_steps'"),
    _case("key_of_another_recipe", ["optimizer_in_bwd=True"],
          "optimizer_in_bwd: unknown config key", kind="lora"),
    _case("missing_required", [], "tokenizer: required", delete=("tokenizer",)),
    _case("batch_size_0", ["batch_size=0"], "batch_size=0: must be an integer >= 1"),
    _case("epochs_not_int", ["epochs=two"], "epochs='two': must be an integer"),
    _case("negative_clip", ["clip_grad_norm=-1"], "clip_grad_norm=-1"),
    _case("in_bwd_with_offload", [*OFFLOAD, "optimizer_in_bwd=True"],
          "optimizer_in_bwd=True with optimizer._component_=torchtune_offload.OffloadOptimizer"),
    _case("in_bwd_with_clip", ["optimizer_in_bwd=True", CLIP1], "optimizer_in_bwd=True with clip_grad_norm"),
    _case("in_bwd_with_accum", ["optimizer_in_bwd=True", ACCUM2],
          "optimizer_in_bwd=True with gradient_accumulation_steps"),
    _case("overlap_not_bool", [*OFFLOAD, "optimizer.overlap=maybe"], "optimizer.overlap='maybe' must be True or False"),
    _case("overlap_on_plain_adamw", ["optimizer.overlap=True"], "optimizer.overlap: not an option of AdamW"),
    _case("torchao_on_cpu", [CPU_AO], "device=cpu with torchtune_offload.CPUOffloadOptimizer"),
    _case("torchao_with_clip", [CPU_AO, CLIP1], "clip_grad_norm is set but"),
    _case("torchao_offload_grads_with_accum", [CPU_AO, "optimizer.offload_gradients=True", ACCUM2],
          "gradient_accumulation_steps > 1 with torchtune_offload.CPUOffloadOptimizer"),
    _case("torchao_class_directly", ["optimizer._component_=torchao.optim.CPUOffloadOptimizer"],
          "Use optimizer._component_=torchtune_offload.CPUOffloadOptimizer"),
    _case("unresolvable_component", ["optimizer._component_=torch.optim.AdamWW"],
          "optimizer._component_='torch.optim.AdamWW' does not resolve"),
    _case("unresolvable_optimizer_class", [OFFLOAD[0], "optimizer.optimizer_class=torch.optim.Nope"],
          "optimizer.optimizer_class='torch.optim.Nope' does not resolve"),
    _case("nested_offload", [OFFLOAD[0], "optimizer.optimizer_class=torchtune_offload.OffloadOptimizer"],
          "optimizer.optimizer_class", "do not nest"),
    _case("offload_gradients_not_bool", [*OFFLOAD, "optimizer.offload_gradients=2"],
          "optimizer.offload_gradients=2: must be True or False"),
    _case("fp16", ["dtype=fp16"], "dtype='fp16'"),
    _case("activation_offloading_on_cpu",
          ["enable_activation_offloading=True", "enable_activation_checkpointing=True"],
          "enable_activation_offloading=True needs device=cuda", kind="lora"),
    _case("low_cpu_ram", ["low_cpu_ram=True"], "low_cpu_ram=True", kind="lora"),
    _case("offload_option_typo", [*OFFLOAD, "optimizer.offload_gradient=True"],
          "optimizer.offload_gradient: not an option of OffloadOptimizer (base AdamW)",
          "Did you mean 'offload_gradients'"),
    _case("base_option_typo", [*OFFLOAD, "optimizer.weight_decy=0.1"], "Did you mean 'weight_decay'"),
    _case("plain_option_typo", ["optimizer.betas1=0.9"], "optimizer.betas1: not an option of AdamW",
          "Did you mean 'betas'"),
    _case("lr_not_a_number", ["optimizer.lr=fast"], "optimizer.lr='fast': AdamW refuses it", "Give a number"),
    _case("negative_lr", [*OFFLOAD, "optimizer.lr=-1"], "optimizer.lr=-1: OffloadOptimizer (base AdamW) refuses it",
          "Invalid learning rate"),
    _case("device_update_with_offload_gradients",
          [*OFFLOAD, "optimizer.update_on=device", "optimizer.offload_gradients=True"],
          "optimizer.update_on=device with optimizer.offload_gradients=True", "Set optimizer.offload_gradients=False"),
    _case("update_on_typo", [*OFFLOAD, "optimizer.update_on=gpu"], "optimizer.update_on='gpu': use 'host'"),
    _case("device_staging_negative", [*OFFLOAD, "optimizer.update_on=device", "optimizer.device_staging_mib=-4"],
          "optimizer.device_staging_mib=-4 must be a positive number"),
    _case("negative_minimal_size", [*OFFLOAD, "optimizer.minimal_size=-1"],
          "optimizer.minimal_size=-1 must be a non-negative integer"),
    _case("lora_option_typo", ["optimizer.lrr=1e-3"], "Did you mean 'lr'", kind="lora"),
    _case("lora_module_typo", ["model.lora_attn_modules=[q_proj,v_prj]"],
          "model.lora_attn_modules: 'v_prj' is not a layer LoRA can adapt", "Did you mean 'v_proj'", kind="lora"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_one_is_refused_not_run_on_the_cpu(tiny_assets, tmp_path):
    message = _bad("full", tiny_assets, tmp_path, "device=cuda")
    assert "device=cuda: this machine has no cuda device" in message and "Set device=cpu" in message


@pytest.mark.parametrize("kind, overrides, delete, expected", BAD_CONFIGS)
def test_bad_config_is_rejected_before_anything_is_built(
    kind, overrides, delete, expected, tiny_assets, tmp_path
):
    message = _bad(kind, tiny_assets, tmp_path, *overrides, delete=delete)
    for fragment in expected:
        assert fragment in message, message


def test_every_problem_is_reported_at_once(tiny_assets, tmp_path):
    message = _bad(
        "full", tiny_assets, tmp_path,
        "batch_size=0", "dtype=fp16", "optimizer_in_bwd=True", "clip_grad_norm=1.0", CPU_AO,
    )
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    for fragment in ("batch_size=0", "dtype='fp16'", "optimizer_in_bwd=True with clip_grad_norm",
                     "optimizer_in_bwd=True with optimizer._component_", "device=cpu with"):
        assert sum(fragment in line for line in lines) == 1, message
    # Two misspelt keys: both named, each with its suggestion.
    message = _bad("full", tiny_assets, tmp_path, "batch_szie=2", "clip_grad_nrom=1.0")
    assert "Did you mean 'batch_size'" in message and "Did you mean 'clip_grad_norm'" in message


def test_tune_run_reports_a_bad_config(tiny_assets, tmp_path):
    result = _tune_run("full", tiny_assets, tmp_path, "gradient_acumulation_steps=2")
    assert result.returncode != 0
    assert "Did you mean 'gradient_accumulation_steps'" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "logs").exists()


def test_a_paged_optimizer_on_the_cpu_is_said_to_run_unpaged(caplog):
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(8, 8)
    for component, said in (("bitsandbytes.optim.PagedAdamW", True), ("bitsandbytes.optim.AdamW", False)):
        # The settings build_optimizer reads, without a config check.
        cfg = OmegaConf.create({"_component_": component, "lr": 1e-3})
        settings = types.SimpleNamespace(optimizer=describe_optimizer(cfg, in_backward=False), clip_grad_norm=None)
        assert settings.optimizer.kind is OptimizerKind.BITSANDBYTES
        caplog.clear()
        build_optimizer(cfg, model, settings)
        assert ("bitsandbytes pages its states only on CUDA and runs unpaged on the CPU" in caplog.text) is said
