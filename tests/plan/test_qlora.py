"""The planner on QLoRA models (NF4 base weights), the full/LoRA/QLoRA block, and the one-line refusals."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.distributed._tools.mem_tracker import MemTracker
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from tests import zygote
from tests.recipe_harness import tiny_asset_overrides, working_tree_env
from torchtune_offload.plan.fine_tunes import DEFAULT_ADAPTERS, configured_fine_tune, fine_tunes
from torchtune_offload.plan.planner import VariantPlan, load_config
from torchtune_offload.plan.report import format_fine_tunes
from torchtune_offload.plan.trace import build_meta_model, trace_training_step
from torchtune_offload.recipe import build_loss, check_recipe_config, instantiate_model

REPO = Path(__file__).resolve().parents[2]
LORA_1B = "configs/llama3_2/1B_lora_offload.yaml"
MID_QLORA = ["model._component_=torchtune_offload.models.qlora_llama3_2_mid", "device=cpu", "batch_size=1"]


class _NoHook:
    def remove(self) -> None:
        pass


def _real_step_peak(cfg, settings, *, seq_len: int) -> dict:
    """MemTracker following one real forward and backward per micro-batch (up to two), real tensors."""
    torch.manual_seed(0)
    model = instantiate_model(cfg.model, settings)
    set_trainable_params(model, get_adapter_params(model))
    loss_fn = build_loss(cfg.loss, model, settings, verbose=False)
    for p in model.parameters():  # the config's offload_gradients: each gradient leaves once produced
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tracker = MemTracker()
    for p in model.parameters():  # torch refuses gradient hooks on the frozen NF4 weights
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(model)
    vocab = model.tok_embeddings.num_embeddings
    with tracker:
        for micro_batch in range(min(settings.gradient_accumulation_steps, 2)):
            if micro_batch:
                tracker.reset_mod_stats()
            tokens = torch.randint(0, vocab, (settings.batch_size, seq_len))
            labels = torch.randint(0, vocab, (settings.batch_size, seq_len))
            loss_fn(model(tokens), labels).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {getattr(k, "value", k): v for k, v in peak.items()}


def test_the_traced_qlora_step_matches_memtracker_on_real_tensors():
    # The mid-size Llama 3.2 with NF4 base weights, bf16, activation checkpointing, offload_gradients.
    cfg = load_config(LORA_1B, MID_QLORA)
    settings = replace(check_recipe_config(cfg, recipe="lora"), compile=False)
    model = build_meta_model(cfg, settings)
    assert any(isinstance(p, NF4Tensor) for p in model.parameters())
    # One length: plain MemTracker keeps every module's peak at every operator, which takes a
    # minute of CPU here; the length where activations and the weights' dequantisation compare.
    for seq_len in (64,):
        real = _real_step_peak(cfg, settings, seq_len=seq_len)
        fake = trace_training_step(cfg, settings, seq_len=seq_len,
                                   mark_trainable=lambda m: set_trainable_params(m, get_adapter_params(m)),
                                   free_gradients=True)
        # The NF4 storage (4-bit codes, scales, code book) is counted byte for byte.
        assert fake.by_kind["Parameter"] == real["Parameter"]
        error = (fake.peak_bytes - real["Total"]) / real["Total"]
        print(f"mid-size QLoRA, batch 1 x {seq_len}: traced on fake tensors {fake.peak_bytes / 2**20:.2f} MiB, "
              f"MemTracker on real tensors {real['Total'] / 2**20:.2f} MiB ({100 * error:+.2f}%)")
        assert abs(error) <= 0.10, (seq_len, fake, real)


def _plan_cli(tmp_path, config, *args):
    out = tmp_path / "plan.json"
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", config, "--force", "--json",
                       str(out),
                           *args], cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True,
                          text=True, timeout=600)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


def test_a_qlora_config_plans_and_says_which_fine_tune_fits(tmp_path):
    proc, plan = _plan_cli(tmp_path, LORA_1B, *MID_QLORA, "device=cuda", "--variants", "config",
                           "--device-gib", "0.6", "--host-gib", "64", "--seq-len", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {p["name"]: p for p in plan["fine_tunes"]}
    assert list(rows) == ["full", "LoRA", "QLoRA"]
    assert all(p["problem"] is None for p in rows.values()), rows
    assert rows["QLoRA"]["description"] == "torchtune_offload.models.qlora_llama3_2_mid (configured)"
    assert rows["QLoRA"]["device_bytes"] == plan["plans"][0]["device_bytes"]
    # NF4 stores the base linears in about a quarter of bf16's bytes.
    lora, qlora = (rows[n]["device_parts"]["step peak: parameter"] for n in ("LoRA", "QLoRA"))
    assert qlora < lora
    # Each row's verdict follows its figure (which fine-tunes a budget splits: the unit test below).
    budget = plan["device_budget"]
    fit = [n for n, p in rows.items() if p["device_bytes"] <= budget]
    missed = [n for n, p in rows.items() if p["device_bytes"] > budget]
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("On a 0.6 GiB device:"))
    assert verdict == "On a 0.6 GiB device: " + "; ".join(
        part for part in (f"{', '.join(fit)} fit{'s' if len(fit) == 1 else ''}" if fit else "",
                          f"{', '.join(missed)} do{'es' if len(missed) == 1 else ''} not fit" if missed else "")
        if part) + ".", proc.stdout
    assert "| fine-tune | device peak GiB | fits device |" in proc.stdout


def test_the_fine_tunes_follow_torchtunes_builder_names():
    cfg = OmegaConf.load("configs/llama3_1/8B_lora_offload.yaml")
    cfg.model._component_ = "torchtune.models.llama3_1.qlora_llama3_1_8b"
    assert configured_fine_tune(cfg.model) == "QLoRA"
    full, lora, qlora = fine_tunes(cfg.model)
    assert full.model == {"_component_": "torchtune.models.llama3_1.llama3_1_8b"} and full.recipe == "full"
    assert lora.model["_component_"] == "torchtune.models.llama3_1.lora_llama3_1_8b"
    assert lora.model["lora_rank"] == cfg.model.lora_rank and lora.recipe == "lora"
    assert qlora.model["_component_"] == "torchtune.models.llama3_1.qlora_llama3_1_8b"
    # A full model's config gets the shipped LoRA configs' adapters; a model without a qlora_
    # builder gets QLoRA as its lora_ builder with quantize_base.
    _, tiny_lora, tiny_qlora = fine_tunes(OmegaConf.load("configs/tiny/full.yaml").model)
    assert tiny_lora.model == {"_component_": "torchtune_offload.models.lora_tiny_llama", **DEFAULT_ADAPTERS}
    assert tiny_qlora.model == {**tiny_lora.model, "quantize_base": True}
    lone = fine_tunes(OmegaConf.create({"_component_": "tests.plan.untraceable_models.refusing_decoder"}))
    assert [f.problem is None for f in lone] == [True, False, False]
    assert "no builder tests.plan.untraceable_models.lora_refusing_decoder" in lone[1].problem


def _assert_one_line_refusal(proc, component: str, words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model._component_={component}: "), last
    assert words in last, last


def test_an_unknown_tensor_subclass_is_refused_in_one_line(tiny_assets, tmp_path):
    component = "tests.plan.untraceable_models.tiny_llama_with_tagged_embedding"
    proc, _ = _plan_cli(tmp_path, "configs/tiny/full.yaml", *tiny_asset_overrides(tiny_assets),
                        f"output_dir={tmp_path}", f"model._component_={component}", "--variants", "config")
    _assert_one_line_refusal(proc, component, "tok_embeddings.weight is a tests.plan.untraceable_models.TaggedTensor")


def test_an_unknown_builder_and_an_untraceable_forward_are_refused_in_one_line(tiny_assets, tmp_path):
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "--variants", "config"]
    component = "torchtune.models.llama3_1.no_such_builder"
    proc, _ = _plan_cli(tmp_path, "configs/tiny/full.yaml", *overrides, f"model._component_={component}")
    _assert_one_line_refusal(proc, component, "cannot be built")
    component = "tests.plan.untraceable_models.refusing_decoder"
    proc, _ = _plan_cli(tmp_path, "configs/tiny/full.yaml", *overrides, f"model._component_={component}")
    _assert_one_line_refusal(proc, component, "NotImplementedError: no kernel for this operator on fake tensors")


def test_the_verdict_names_what_fits_what_does_not_and_what_could_not_be_planned():
    gib = 1024**3
    plans = [VariantPlan("full", "a", device_bytes=14 * gib, host_bytes=25 * gib),
             VariantPlan("LoRA", "b", device_bytes=17 * gib, host_bytes=gib),
             VariantPlan("QLoRA", "-", problem="no builder m.qlora_x")]
    text = format_fine_tunes(plans, device_budget=16 * gib, host_budget=23 * gib, optimizer="AdamW")
    assert "| full | 14.00 | yes | 25.00 | no | a |" in text and "| QLoRA | - | - | - | - | no builder m.qlora_x |" in text
    assert "On a 16.0 GiB device: full fits; LoRA does not fit; QLoRA could not be planned." in text
    assert "Host memory (23.0 GiB budget): full needs 25.00 GiB, more than it has." in text
