"""The planner's report: each variant's verdict against the budgets, the moment of the run that
decides it (the step, or the load of FP8 device weights), and the advice built on it."""

import pytest

from torchtune_offload.plan.planner import GIB, VariantPlan
from torchtune_offload.plan.report import device_verdict, format_fine_tunes, format_plans, update_on_advice


def _fp8(name="config"):
    """An FP8 plan whose step fits 13 GiB but whose bf16 load needs 15."""
    return VariantPlan(name=name, description="FP8 weights", device_bytes=12 * GIB, host_bytes=40 * GIB,
                       load_bytes=15 * GIB)


@pytest.mark.parametrize("budget_gib, verdict", [(16, "yes"), (14, "no (load)"), (11, "no")])
def test_a_load_above_the_budget_does_not_fit_though_the_step_does(budget_gib, verdict):
    assert device_verdict(_fp8(), budget_gib * GIB) == verdict
    table = format_plans([_fp8()], device="cuda", device_budget=budget_gib * GIB, host_budget=64 * GIB,
                         config_path="c.yaml", seq_len_note="batch 1 x 2048 tokens")
    row = next(line for line in table.splitlines() if line.startswith("| config |"))
    assert row.split(" | ")[3] == verdict
    fine = format_fine_tunes([_fp8("full")], device_budget=budget_gib * GIB, host_budget=64 * GIB, optimizer="x")
    fits = "fits" if verdict == "yes" else "does not fit"
    assert fine.splitlines()[-1] == f"On a {budget_gib:.1f} GiB device: full {fits}."


def test_a_plan_without_a_load_figure_is_judged_by_its_step():
    plan = VariantPlan(name="offload", description="", device_bytes=12 * GIB, host_bytes=GIB)
    assert plan.device_need == 12 * GIB
    assert device_verdict(plan, 12 * GIB) == "yes" and device_verdict(plan, None) == "?"
    assert device_verdict(VariantPlan(name="x", description="", problem="refused"), 12 * GIB) == "-"


def test_the_advice_on_where_the_update_runs_counts_the_load():
    """The host engine's variant keeps a config's FP8 device weights (a device update refuses them):
    where their load does not fit, the advice does not call that variant fitting."""
    device = VariantPlan(name="offload_device_update", description="", device_bytes=13 * GIB, host_bytes=30 * GIB)
    host = VariantPlan(name="offload_grads", description="", device_bytes=10 * GIB, host_bytes=40 * GIB,
                       load_bytes=15 * GIB)
    advice = update_on_advice([device, host], device_budget=14 * GIB, host_budget=64 * GIB)
    assert "the better choice" in advice and "which fits" not in advice
    assert "which fits" in update_on_advice([device, host], device_budget=16 * GIB, host_budget=64 * GIB)


def test_a_cpu_run_gets_no_update_on_advice_and_says_why_it_has_no_speed():
    # update_on=device moves the update to an accelerator; a CPU run has none, and the speed model is a GPU's.
    device = VariantPlan(name="offload_device_update", description="", device_bytes=13 * GIB, host_bytes=30 * GIB)
    host = VariantPlan(name="offload_grads", description="", device_bytes=10 * GIB, host_bytes=40 * GIB)
    common = dict(device_budget=16 * GIB, host_budget=64 * GIB, config_path="c.yaml", seq_len_note="batch 1 x 8")
    on_gpu = format_plans([device, host], device="cuda", **common, speeds={}, machine="m")
    assert "Where the update runs:" in on_gpu and "No speed for a CPU run" not in on_gpu
    on_cpu = format_plans([device, host], device="cpu", **common, speeds={}, machine="m")
    assert "Where the update runs:" not in on_cpu
    assert "Speed on m (docs/planner.md#how-fast). No speed for a CPU run: the model predicts a GPU's step" in on_cpu


def test_a_note_every_variant_has_is_said_once_and_the_host_budget_says_where_it_is_from():
    shared, own = "checkpoint files not found", "device_weights: the model loads in bf16 first"
    plans = [VariantPlan(name="offload", description="", device_bytes=GIB, host_bytes=GIB, notes=[shared]),
             VariantPlan(name="refused", description="", problem="clip_grad_norm is set"),
             VariantPlan(name="fp8", description="", device_bytes=GIB, host_bytes=GIB, notes=[own, shared])]
    text = format_plans(plans, device="cuda", device_budget=24 * GIB, host_budget=64 * GIB, config_path="c.yaml",
                        seq_len_note="batch 1", host_budget_note="what this machine has available")
    assert "host budget 64.0 GiB (what this machine has available)." in text
    assert text.count(shared) == 1
    assert text.split("Notes on every variant below:\n")[1].startswith(f"  note: {shared}\n\noffload:")
    assert text.split("\nfp8:\n")[1].splitlines()[2] == f"  note: {own}"
    # One variant planned: its notes stay with it.
    alone = format_plans(plans[:1], device="cuda", device_budget=24 * GIB, host_budget=64 * GIB,
                         config_path="c.yaml", seq_len_note="batch 1")
    assert "Notes on every variant" not in alone and alone.endswith(f"  note: {shared}")
    assert "host budget 64.0 GiB." in alone
