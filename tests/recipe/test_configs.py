"""Checks on the YAML configs under configs/.

* every ``configs/**/*.yaml`` passes the check ``tune validate`` runs (in-process, plus one real
  CLI call), names its launch command in its header, and, where it uses an offload or paged
  optimizer, respects that optimizer's limits;
* the per-model configs form the complete model x variant table below, and the variants of one
  model share their base settings so their throughput and memory compare fairly.

Everything runs on CPU in well under a minute: models are built on the meta device only.
"""

import inspect
import re
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
import torchtune.training
import torchtune.utils
from torchtune import config
from torchtune.config._errors import ConfigError
from torchtune.config._utils import _get_component_from_path, _has_component

from tests import zygote
from tests.recipe_harness import TUNE
from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer, resolve_optimizer_class
from torchtune_offload.optim import capabilities_of
from torchtune_offload.recipe import check_recipe_config

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
ALL_CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml"))

OFFLOAD_COMPONENTS = {
    "torchtune_offload.OffloadOptimizer": OffloadOptimizer,
    "torchtune_offload.CPUOffloadOptimizer": CPUOffloadOptimizer,
}
PAGED_COMPONENTS = {"bitsandbytes.optim.PagedAdamW", "bitsandbytes.optim.PagedAdamW8bit"}

# (family, size) -> (output_dir slug, input/output embeddings tied)
MODELS = {
    ("llama3_2", "1B"): ("llama3_2_1B", True),
    ("llama3_2", "3B"): ("llama3_2_3B", True),
    ("llama3_1", "8B"): ("llama3_1_8B", False),
    ("qwen2_5", "7B"): ("qwen2_5_7B", False),
    ("phi3", "mini"): ("phi3_mini", False),
}
# variant -> (recipe file, optimizer component, offload_gradients or None when not an offload one)
VARIANTS = {
    "full_offload": (
        "full_finetune_single_device.py", "torchtune_offload.CPUOffloadOptimizer", False),
    "full_offload_gradients": (
        "full_finetune_single_device.py", "torchtune_offload.CPUOffloadOptimizer", True),
    "full_offload_engine": (
        "full_finetune_single_device.py", "torchtune_offload.OffloadOptimizer", True),
    "full_paged_adamw": ("full_finetune_single_device.py", "bitsandbytes.optim.PagedAdamW", None),
    "full_paged_adamw8bit": (
        "full_finetune_single_device.py", "bitsandbytes.optim.PagedAdamW8bit", None),
    "lora_offload": ("lora_finetune_single_device.py", "torchtune_offload.OffloadOptimizer", True),
}
FULL_VARIANTS = [v for v in VARIANTS if v.startswith("full_")]
# Variants whose accumulation / clipping are forced by torchao's CPUOffloadOptimizer.
AO_FORCED_ACCUM = {"full_offload_gradients"}
AO_FORCED_CLIP = {"full_offload", "full_offload_gradients"}

LAUNCH_RE = re.compile(r"tune run (recipes/\S+\.py) --config (\S+\.yaml)")


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _table_path(family: str, size: str, variant: str) -> Path:
    return CONFIG_DIR / family / f"{size}_{variant}.yaml"


def _load(path: Path) -> DictConfig:
    return OmegaConf.load(path)


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def _optimizer_component(path: Path):
    cfg = _load(path)
    opt = cfg.get("optimizer")
    return opt.get("_component_") if isinstance(opt, DictConfig) else None


CONFIGS_WITH_OPTIMIZER = [p for p in ALL_CONFIGS if _optimizer_component(p)]
OFFLOAD_CONFIGS = [p for p in ALL_CONFIGS if _optimizer_component(p) in OFFLOAD_COMPONENTS]
PAGED_CONFIGS = [p for p in ALL_CONFIGS if _optimizer_component(p) in PAGED_COMPONENTS]
TABLE = [(f, s, v) for (f, s) in MODELS for v in VARIANTS]


def _ids(paths):
    return [_rel(p) for p in paths]


# ------------------------------------------------------------------------ tune validate


def test_glob_finds_every_table_config():
    found = set(ALL_CONFIGS)
    missing = [_rel(_table_path(*row)) for row in TABLE if _table_path(*row) not in found]
    assert not missing, f"configs/**/*.yaml does not pick up {missing}"


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_config_passes_tune_validate(path):
    # Exactly what `tune validate <config>` does (torchtune/_cli/validate.py): load, then
    # config.validate, which binds each top-level component's keys to its signature.
    cfg = OmegaConf.load(path)
    components = [k for k, v in cfg.items() if _has_component(v)]
    assert components, f"{_rel(path)} has no top-level _component_ for validate to check"
    config.validate(cfg)  # raises ConfigError on an unknown or missing keyword


def test_validate_rejects_a_misspelled_key():
    # The check above is only worth something if it fails on a bad key: show it does.
    cfg = _load(_table_path("llama3_2", "1B", "full_paged_adamw"))
    cfg.model.num_layerz = 2
    with pytest.raises(ConfigError, match="num_layerz"):
        config.validate(cfg)
    # For components with a required argument the config cannot give (an optimizer's params),
    # torchtune's validate lets the TypeError of its partial bind escape instead of a ConfigError;
    # `tune validate` still fails on it.
    cfg = _load(_table_path("llama3_2", "1B", "full_paged_adamw"))
    cfg.optimizer.weight_decy = 0.01
    with pytest.raises((ConfigError, TypeError), match="weight_decy"):
        config.validate(cfg)


def test_tune_validate_cli_accepts_a_config():
    target = _table_path("llama3_2", "1B", "full_offload_engine")
    proc = zygote.run(
        TUNE + ["validate", _rel(target)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Config is well-formed!" in proc.stdout


# ------------------------------------------------------------------------------ headers


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_header_launch_command_names_this_config(path):
    header = _header(path)
    assert header, f"{_rel(path)} has no leading # header"
    launches = LAUNCH_RE.findall(header)
    assert launches, f"{_rel(path)}: header has no 'tune run recipes/<recipe>.py --config ...' line"
    assert {cfg for _, cfg in launches} == {_rel(path)}, launches


def test_every_config_writes_to_a_folder_and_w_and_b_run_of_its_own():
    """Two configs sharing an output_dir share checkpoints and logs: the second run is refused as
    an earlier run's folder, or resumes the other's optimizer state. Each folder and W&B name ends
    with the config's own name (less the model size its folder already names)."""
    folders, names = {}, {}
    for path in ALL_CONFIGS:
        own = (path.stem, path.stem.split("_", 1)[-1])
        folder = str(_load(path).output_dir)
        assert folder.endswith(own), f"{_rel(path)}: output_dir {folder} is not named for the config"
        folders.setdefault(folder, []).append(_rel(path))
        for name in re.findall(r"metric_logger\.name=(\S+)", _header(path)):
            assert name.endswith(own), f"{_rel(path)}: W&B run name {name} is not named for the config"
            names.setdefault(name, []).append(_rel(path))
    assert not {k: v for k, v in folders.items() if len(v) > 1}
    assert not {k: v for k, v in names.items() if len(v) > 1}


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_header_launch_recipe_exists(path):
    recipes = {recipe for recipe, _ in LAUNCH_RE.findall(_header(path))}
    assert recipes, f"{_rel(path)}: no launch command in the header"
    for recipe in recipes:
        assert (REPO / recipe).is_file(), f"{_rel(path)} launches {recipe}, which does not exist"


# Recipe file -> the key set torchtune_offload.recipe.checks.config checks it against.
RECIPE_KIND = {
    "full_finetune_single_device.py": "full",
    "lora_finetune_single_device.py": "lora",
    "full_finetune_distributed.py": "distributed",
}


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_config_passes_its_recipes_own_check(path, monkeypatch):
    # Our recipes reject unknown keys and impossible combinations up front
    # (torchtune_offload.recipe.check_recipe_config); run that check here.
    recipes = {Path(r).name for r, _ in LAUNCH_RE.findall(_header(path))}
    kinds = {RECIPE_KIND[r] for r in recipes if r in RECIPE_KIND}
    if not kinds:
        pytest.skip(f"{_rel(path)} launches {sorted(recipes)}, which this test does not map")
    # Only the device/dtype lookups need the configured hardware: stub them as if it were here.
    monkeypatch.setattr(torchtune.utils, "get_device", lambda device=None: torch.device(device or "cpu"))
    monkeypatch.setattr(torchtune.training, "get_dtype", lambda dtype=None, device=None: torch.float32)
    cfg = _load(path)
    expected_class = _get_component_from_path(cfg.optimizer._component_)
    for kind in kinds:
        settings = check_recipe_config(cfg, recipe=kind)  # ValueError lists problems
        assert settings.optimizer.optimizer_class is expected_class
        assert settings.optimizer.capabilities == capabilities_of(expected_class)
        assert settings.batch_size == cfg.batch_size
        assert settings.gradient_accumulation_steps == cfg.get("gradient_accumulation_steps", 1)


# ---------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("path", CONFIGS_WITH_OPTIMIZER, ids=_ids(CONFIGS_WITH_OPTIMIZER))
def test_optimizer_resolves_and_its_keywords_reach_the_base_optimizer(path):
    opt = OmegaConf.to_container(_load(path).optimizer, resolve=True)
    component = _get_component_from_path(opt.pop("_component_"))
    assert isinstance(component, type) and issubclass(component, torch.optim.Optimizer)
    if opt.get("optimizer_class") is not None or issubclass(
        component, (OffloadOptimizer, CPUOffloadOptimizer)
    ):
        # The wrappers take **kwargs, so tune validate cannot see a typo there: bind the rest
        # to the base optimizer instead.
        base = resolve_optimizer_class(opt.get("optimizer_class", "torch.optim.AdamW"))
        own = {n for n, p in inspect.signature(component).parameters.items() if p.kind is not p.VAR_KEYWORD}
        kwargs = {k: v for k, v in opt.items() if k not in own}
        inspect.signature(base).bind([], **kwargs)
        assert isinstance(opt.get("offload_gradients", False), bool)
        assert isinstance(opt.get("minimal_size", 4096), int) and opt.get("minimal_size", 4096) >= 0
    else:
        inspect.signature(component).bind([], **opt)


@pytest.mark.parametrize(
    "path", OFFLOAD_CONFIGS + PAGED_CONFIGS, ids=_ids(OFFLOAD_CONFIGS + PAGED_CONFIGS)
)
def test_offload_and_paged_optimizers_do_not_step_in_backward(path):
    cfg = _load(path)
    assert cfg.get("optimizer_in_bwd", False) is False


@pytest.mark.parametrize("path", OFFLOAD_CONFIGS, ids=_ids(OFFLOAD_CONFIGS))
def test_offload_config_respects_its_optimizer_limits(path):
    cfg = _load(path)
    if cfg.optimizer._component_ == "torchtune_offload.CPUOffloadOptimizer":
        assert cfg.get("clip_grad_norm") is None, "torchao's CPUOffloadOptimizer cannot clip"
        if cfg.optimizer.get("offload_gradients", False):
            assert cfg.gradient_accumulation_steps == 1, (
                "torchao's CPUOffloadOptimizer cannot accumulate with offload_gradients=True"
            )
        assert cfg.get("device", "cuda") in ("cuda", "xpu"), "torchao's offload needs CUDA/XPU"
    else:
        # The engine supports both; just make sure the values are sane.
        assert cfg.gradient_accumulation_steps >= 1
        assert cfg.get("clip_grad_norm") is None or float(cfg.clip_grad_norm) > 0


@pytest.mark.parametrize("path", OFFLOAD_CONFIGS, ids=_ids(OFFLOAD_CONFIGS))
def test_full_offload_configs_that_accumulate_add_the_sums_on_the_gpu(path):
    """The measured choice (docs/accumulation.md): the full fine-tunes' gradient sums are added on
    the GPU (18% faster on the H100 8B run); the adapters' small sums, and configs without a later
    micro-batch, keep the option's default."""
    cfg = _load(path)
    accumulates = cfg.optimizer.get("offload_gradients", False) and cfg.gradient_accumulation_steps > 1
    engine = cfg.optimizer._component_ == "torchtune_offload.OffloadOptimizer"
    adapters = "lora_" in cfg.model._component_.rsplit(".", 1)[-1]  # LoRA and QLoRA builders
    expected = "device" if engine and accumulates and not adapters else "host"
    assert cfg.optimizer.get("grad_sum_on", "host") == expected


# ---------------------------------------------------------------- per-model table


@pytest.mark.parametrize("family,size", list(MODELS), ids=[f"{f}-{s}" for f, s in MODELS])
def test_model_has_every_variant(family, size):
    present = {p.name for p in (CONFIG_DIR / family).glob(f"{size}_*.yaml")}
    expected = {f"{size}_{v}.yaml" for v in VARIANTS}
    assert expected <= present, f"missing: {sorted(expected - present)}"


@pytest.mark.parametrize("family,size,variant", TABLE, ids=[f"{f}-{s}-{v}" for f, s, v in TABLE])
def test_variant_config_matches_the_table(family, size, variant):
    path = _table_path(family, size, variant)
    cfg = _load(path)
    recipe, component, offload_gradients = VARIANTS[variant]
    slug, _ = MODELS[(family, size)]

    assert cfg.optimizer._component_ == component
    if offload_gradients is None:
        assert "optimizer_class" not in cfg.optimizer
    else:
        assert cfg.optimizer.optimizer_class == "torch.optim.AdamW"
        assert cfg.optimizer.offload_gradients is offload_gradients
    if variant == "lora_offload":
        # The LoRA recipe knows no optimizer_in_bwd key (it always steps after backward).
        assert "optimizer_in_bwd" not in cfg
    else:
        assert "optimizer_in_bwd" in cfg and cfg.optimizer_in_bwd is False
    assert {r for r, _ in LAUNCH_RE.findall(_header(path))} == {f"recipes/{recipe}"}
    assert cfg.output_dir == f"/tmp/torchtune_offload/{slug}/{variant}"

    # torchtune single-device conventions.
    assert cfg.dataset._component_ == "torchtune.datasets.alpaca_dataset"
    assert cfg.dataset.packed is False and cfg.seed is None and cfg.shuffle is True
    assert cfg.epochs == 1 and cfg.max_steps_per_epoch is None
    assert cfg.compile is False and cfg.device == "cuda" and cfg.dtype == "bf16"
    assert cfg.enable_activation_checkpointing is True
    assert cfg.enable_activation_offloading is False
    assert cfg.metric_logger._component_ == "torchtune.training.metric_logging.DiskLogger"
    assert cfg.metric_logger.log_dir == f"{cfg.output_dir}/logs"
    assert cfg.log_every_n_steps == 1 and cfg.log_peak_memory_stats is True
    assert cfg.profiler.enabled is False
    assert cfg.checkpointer.output_dir == cfg.output_dir
    assert len(cfg.checkpointer.checkpoint_files) >= 1

    header = _header(path)
    assert "tune download " in header
    assert "metric_logger._component_=torchtune.training.metric_logging.WandBLogger" in header
    assert "metric_logger.project=torchtune-offload" in header
    if offload_gradients is None:
        assert "unified memory" in header and "NVML" in header
    if (family, size) == ("llama3_2", "1B"):
        assert "python -m torchtune_offload.assets --real-arch llama3_2_1b" in header
        assert "checkpointer.checkpoint_dir=/tmp/llama3_2_1b_random" in header

    if variant == "lora_offload":
        assert ".lora_" in cfg.model._component_
        assert "save_adapter_weights_only" in cfg
        assert "lr_scheduler" in cfg  # as torchtune's LoRA configs (the recipe runs without one too)
        for key in ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output",
                    "lora_rank", "lora_alpha", "lora_dropout"):
            assert key in cfg.model, key
    else:
        assert ".lora_" not in cfg.model._component_
        # A torch LR scheduler needs a torch Optimizer; torchao's class is not one.
        assert "lr_scheduler" not in cfg


@pytest.mark.parametrize("family,size", list(MODELS), ids=[f"{f}-{s}" for f, s in MODELS])
def test_variants_of_a_model_share_base_settings(family, size):
    cfgs = {v: _load(_table_path(family, size, v)) for v in VARIANTS}
    ref = cfgs["full_offload_engine"]

    def same(key, variants):
        values = {v: OmegaConf.select(cfgs[v], key) for v in variants}
        values = {v: OmegaConf.to_container(x) if isinstance(x, DictConfig) else x
                  for v, x in values.items()}
        assert len({repr(x) for x in values.values()}) == 1, f"{key} differs: {values}"

    for key in ("batch_size", "tokenizer", "checkpointer._component_",
                "checkpointer.checkpoint_dir", "checkpointer.checkpoint_files",
                "checkpointer.model_type", "dataset", "loss", "dtype",
                "enable_activation_checkpointing", "enable_activation_offloading"):
        same(key, VARIANTS)
    assert ref.tokenizer.max_seq_len is not None, "pin max_seq_len so variants see equal lengths"
    for key in ("model", "optimizer.lr", "optimizer.weight_decay"):
        same(key, FULL_VARIANTS)
    same("gradient_accumulation_steps", [v for v in VARIANTS if v not in AO_FORCED_ACCUM])
    same("clip_grad_norm", [v for v in VARIANTS if v not in AO_FORCED_CLIP])
    assert ref.gradient_accumulation_steps > 1, "the engine config should exercise accumulation"
    assert ref.clip_grad_norm is not None, "the engine config should exercise clipping"


@pytest.mark.parametrize("family,size", list(MODELS), ids=[f"{f}-{s}" for f, s in MODELS])
def test_lora_matrices_are_all_offloaded(family, size):
    cfg = _load(_table_path(family, size, "lora_offload"))
    _, tied = MODELS[(family, size)]
    if tied:
        # torchtune's Llama 3.2 LoRA builders refuse LoRA on the tied output projection.
        assert cfg.model.apply_lora_to_output is False
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    adapter = {n: p.numel() for n, p in model.named_parameters() if "lora_" in n}
    assert adapter, "the LoRA builder produced no adapter parameters"
    smallest = min(adapter, key=adapter.get)
    minimal_size = cfg.optimizer.get("minimal_size", 4096)
    assert adapter[smallest] >= minimal_size, (
        f"{smallest} has {adapter[smallest]} elements < minimal_size={minimal_size}: it would "
        "step on the GPU instead of being offloaded"
    )


@pytest.mark.parametrize("family,size", list(MODELS), ids=[f"{f}-{s}" for f, s in MODELS])
def test_lora_optimizer_and_scheduler_build_and_step_on_cpu(family, size):
    # OffloadOptimizer runs on CPU too, so the LoRA config's optimizer and scheduler blocks can be
    # instantiated as the recipe does and take a real step.
    cfg = _load(_table_path(family, size, "lora_offload"))
    big = torch.nn.Parameter(torch.ones(64, 128))  # 8192 elements: offloaded
    small = torch.nn.Parameter(torch.ones(16))  # below minimal_size: stays
    opt = config.instantiate(cfg.optimizer, [("big", big), ("small", small)])
    sched = config.instantiate(cfg.lr_scheduler, opt, num_training_steps=10)
    warmup = cfg.lr_scheduler.num_warmup_steps
    peak = float(cfg.optimizer.lr)
    assert opt.param_groups[0]["lr"] == 0.0  # the warmup starts at zero, as the recipe sees it
    before = big.detach().clone()
    for _ in range(2):  # the recipe's order: backward, step, scheduler step, zero_grad
        (big.sum() + small.sum()).backward()  # a real backward: offload_gradients uses grad hooks
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(2 * peak / warmup)
    assert not torch.equal(big.detach(), before)  # the second step ran at lr = peak / warmup
    assert not torch.equal(small.detach(), torch.ones(16))  # the on-device one stepped too
