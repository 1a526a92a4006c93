"""The planner's answer to "which setting is fastest on my machine": the fastest variant that fits
both budgets, and the fastest whose steps are AdamW's full-precision ones on the config."""

from torchtune_offload.plan.fastest import expected_tokens_per_second, fastest_block, fastest_fitting, math_change
from torchtune_offload.plan.planner import GIB, VariantPlan
from torchtune_offload.plan.speed import Speed

CONFIG = {"optimizer": {"_component_": "torchtune_offload.OffloadOptimizer", "optimizer_class": "torch.optim.AdamW"},
          "clip_grad_norm": 1.0, "gradient_accumulation_steps": 4}


def _speed(tokens_per_second: float, gaps=()) -> Speed:
    return Speed(step_seconds=8192 / tokens_per_second, tokens_per_second=tokens_per_second, bound="GPU compute",
                 parts={}, known_gaps=tuple(gaps))


def _plan(name: str, *, device: float = 10, host: float = 40, load: float = None, problem: str = None):
    return VariantPlan(name=name, description="", problem=problem, device_bytes=int(device * GIB),
                       host_bytes=int(host * GIB), load_bytes=None if load is None else int(load * GIB))


def test_what_changes_the_math_of_a_step():
    assert math_change(CONFIG, config=CONFIG) is None
    eight = {**CONFIG, "optimizer": {**CONFIG["optimizer"], "optimizer_class": "torchtune_offload.AdamW8bit",
                                     "device_weights": "fp8"}}
    assert math_change(eight, config=CONFIG) == "8-bit optimizer states and FP8 layer weights"
    in_bwd = {"optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW8bit"}, "clip_grad_norm": None,
              "gradient_accumulation_steps": 1, "optimizer_in_bwd": True}
    assert math_change(in_bwd, config=CONFIG) == ("8-bit optimizer states and clip_grad_norm=None instead of 1.0 "
                                                  "and gradient_accumulation_steps=1 instead of 4")
    # Wider states or masters are not less precise than plain AdamW's: not a change to warn of.
    for wider in ({"_component_": "bitsandbytes.optim.PagedAdamW"},
                  {**CONFIG["optimizer"], "master_dtype": "fp32", "grad_sum_dtype": "fp32"}):
        assert math_change({**CONFIG, "optimizer": wider}, config=CONFIG) is None


def test_the_fastest_that_fits_ranks_by_what_runs_of_its_kind_made_of_their_predictions():
    plans = [_plan("fast_gap"), _plan("exact"), _plan("eight_bit"), _plan("too_big", device=30),
             _plan("fp8_load", device=8, load=25), _plan("host_heavy", host=90), _plan("refused", problem="no")]
    speeds = {"fast_gap": _speed(3000, [("per-micro-batch host cost", 0.4, 0.6)]), "exact": _speed(2000),
              "eight_bit": _speed(2500), "too_big": _speed(9000), "fp8_load": _speed(9000),
              "host_heavy": _speed(9000), "refused": None}
    changes = {"eight_bit": "8-bit optimizer states"}
    assert expected_tokens_per_second(speeds["fast_gap"]) == 1500  # 3000 x the gap's middle, 0.5
    best = fastest_fitting(plans, speeds, device_budget=24 * GIB, host_budget=64 * GIB, math_changes=changes)
    assert (best.overall, best.exact) == ("eight_bit", "exact")
    lines = fastest_block(plans, speeds, device_budget=24 * GIB, host_budget=64 * GIB, math_changes=changes)
    assert lines[1].startswith("Fastest that fits both budgets (device 24.0 GiB, host 64.0 GiB)")
    assert lines[2] == ("- eight_bit: 2500 tok/s predicted, 3.28 s a step; its steps differ from AdamW's "
                        "full-precision steps on the config: 8-bit optimizer states")
    assert lines[3] == ("- with AdamW's full-precision steps on the config's clipping and accumulation: exact: "
                        "2000 tok/s predicted, 4.1 s a step")
    # A known gap is shown with the figure it ranks by.
    lines = fastest_block(plans[:1], speeds, device_budget=24 * GIB, host_budget=64 * GIB, math_changes={})
    assert lines[2:] == ["- fast_gap: 3000 tok/s predicted, 2.73 s a step (about 1500 by what recorded runs of its "
                         "kind made of such predictions)"]


def test_nothing_fits_or_nothing_exact_fits_is_said():
    plans, speeds = [_plan("eight_bit"), _plan("exact", host=90)], {"eight_bit": _speed(100), "exact": _speed(200)}
    changes = {"eight_bit": "8-bit optimizer states"}
    lines = fastest_block(plans, speeds, device_budget=24 * GIB, host_budget=64 * GIB, math_changes=changes)
    assert lines[-1] == "- with AdamW's full-precision steps on the config's clipping and accumulation: none fits"
    assert fastest_block(plans, speeds, device_budget=None, host_budget=64 * GIB, math_changes=changes) == [
        "", "No planned variant fits both budgets (device ? GiB, host 64.0 GiB)."]
