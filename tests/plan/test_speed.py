"""The speed model: machine keys checked, its arithmetic on a known case, the calibration against the
recorded H100 runs, the probe on the CPU, and the planner's --machine path."""

import json
import re
import warnings
from dataclasses import replace
from pathlib import Path

import bitsandbytes as bnb
import bitsandbytes.optim.optimizer as bnb_optimizer
import pytest
import torch
from omegaconf import OmegaConf
from torchtune.models.llama3_1 import llama3_1_8b
from torchtune.models.llama3_2 import llama3_2_1b, llama3_2_3b

from tests.plan.test_planner import _plan_cli
from tests.recipe_harness import tiny_asset_overrides
from torchtune_offload.cli.main import main as tune_offload
from torchtune_offload.models import tiny_llama
from torchtune_offload.models.narrow import narrow_llama
from torchtune_offload.optim import fused_step
from torchtune_offload.optim.handoff import handoff_groups
from torchtune_offload.plan import planner
from torchtune_offload.plan import probe as probe_module
from torchtune_offload.plan.__main__ import main as plan_main
from torchtune_offload.plan.launch import COUNT_WIDTH, narrowed_ops_per_micro_batch
from torchtune_offload.plan.recorded_runs import (LLAMA3_1_8B, LLAMA3_2_1B, LLAMA3_2_3B, TENSORS, TOLERANCE, calibrate,
                                                  calibration_table, known_gaps, recorded_runs)
from torchtune_offload.plan.speed import (MACHINE_KEYS, OVERLAP_HIDDEN_SHARE, Machine, StepWork,
                                          bitsandbytes_syncs_per_step, device_syncs, load_machine, predict,
                                          preset_about, preset_names, sums_elsewhere_block)
from torchtune_offload.recipe import describe_optimizer

REPO = Path(__file__).resolve().parents[2]
#: Round rates, so each part of a step is a number of seconds one can work out by hand.
ROUND = {"gpu_bf16_tflops": 1.0, "pcie_h2d_gbs": 1.0, "pcie_d2h_gbs": 1.0, "host_copy_gbs": 6.0,
         "host_adamw_bf16_mparams": 1000.0, "host_adamw8bit_mparams": 2000.0, "host_adamw_master_mparams": 400.0,
         "host_cores": 4, "device_sync_us": 500.0, "launch_us_per_op": 10.0, "handoff_us": 100.0}


def test_a_machine_names_every_missing_unknown_and_bad_key_at_once():
    data = {**ROUND, "pcie_h2d_gbs": 0, "host_cores": "many", "gpu_tflops": 3.0}
    del data["host_copy_gbs"], data["pcie_d2h_gbs"]
    with pytest.raises(ValueError) as err:
        Machine.from_dict(data, name="mine.json")
    message = str(err.value)
    for part in ("mine.json", "missing pcie_d2h_gbs, host_copy_gbs", "unknown gpu_tflops", "pcie_h2d_gbs=0",
                 "host_cores='many'", "tune-offload probe", "h100_recorded"):
        assert part in message, (part, message)
    assert Machine.from_dict(ROUND, name="round").as_dict() == {k: float(v) for k, v in ROUND.items()}


def test_a_machine_with_a_fraction_of_a_core_is_refused_and_a_whole_float_is_not():
    with pytest.raises(ValueError, match=r"host_cores=2\.5 is not a whole number of cores"):
        Machine.from_dict({**ROUND, "host_cores": 2.5}, name="mine.json")
    # What the probe writes: a float that is a whole number.
    assert Machine.from_dict({**ROUND, "host_cores": 16.0}, name="mine.json").host_cores == 16.0


def test_machine_files_and_presets(tmp_path):
    for name in preset_names():
        about = preset_about(name)
        assert load_machine(name).name == name and about["sources"] and about["description"]
        # Only the recorded H100 comes from measurements; every desktop figure is an estimate.
        assert about["estimate"] is (name != "h100_recorded")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(ROUND))
    assert load_machine(path).gpu_bf16_tflops == 1.0
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_machine(path)
    with pytest.raises(ValueError, match="neither a preset"):
        load_machine(tmp_path / "absent.json")


def test_a_machine_may_give_its_gpu_memory_and_every_preset_does(tmp_path):
    assert Machine.from_dict(ROUND, name="round").device_memory_gib is None
    mine = Machine.from_dict({**ROUND, "device_memory_gib": 15.6}, name="mine.json")
    assert mine.device_memory_gib == 15.6 and mine.as_dict() == {**ROUND, "device_memory_gib": 15.6}
    with pytest.raises(ValueError, match="device_memory_gib=0 is not a positive number"):
        Machine.from_dict({**ROUND, "device_memory_gib": 0}, name="mine.json")
    sizes = {name: load_machine(name).device_memory_gib for name in preset_names()}
    assert sizes["h100_recorded"] == 80.0 and sizes["rtx4070tisuper_ddr5"] == 16.0
    assert all(sizes[name] == 24.0 for name in ("rtx4090_ddr4", "rtx3090_ddr5")), sizes
    assert all(any(s.startswith("device_memory_gib: ") for s in preset_about(name)["sources"]) for name in sizes)


def test_the_machine_is_the_planners_device_budget_unless_the_flag_says_otherwise(tiny_assets, tmp_path):
    # Before, --machine rtx4070tisuper_ddr5 on a machine without that GPU left the budget unknown.
    common = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda", "dtype=bf16",
              "--host-gib", "64", "--no-fine-tunes", "--variants", "adamw", "--machine", "rtx4070tisuper_ddr5"]
    stdout, _ = _plan_cli(tmp_path, *common)
    assert "budget 16.0 GiB (rtx4070tisuper_ddr5's device_memory_gib; --device-gib to change it)" in stdout
    assert json.loads((tmp_path / "plan.json").read_text())["device_budget"] == 16 * 2**30
    # The answer under the table, and in the JSON: the one variant planned fits and is the fastest.
    assert "Fastest that fits both budgets (device 16.0 GiB, host 64.0 GiB)" in stdout
    assert "\n- adamw: " in stdout and "- with AdamW's full-precision steps" not in stdout
    assert json.loads((tmp_path / "plan.json").read_text())["fastest"] == {"overall": "adamw", "exact": "adamw"}
    stdout, _ = _plan_cli(tmp_path, *common, "--device-gib", "1")
    assert "budget 1.0 GiB; " in stdout
    assert json.loads((tmp_path / "plan.json").read_text())["device_budget"] == 2**30


def test_the_planner_refuses_a_bad_machine_before_tracing(tmp_path, capsys):
    bad = tmp_path / "machine.json"
    bad.write_text(json.dumps({k: v for k, v in ROUND.items() if k != "pcie_d2h_gbs"}))
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--config", str(REPO / "configs/tiny/full.yaml"), "--machine", str(bad)])
    assert exit_.value.code == 2
    assert "missing pcie_d2h_gbs" in capsys.readouterr().err


def test_the_arithmetic_of_a_known_step():
    machine = Machine.from_dict(ROUND, name="round")
    # 1e9 parameters, 1000 tokens, activation checkpointing: 8e12 FLOPs at 1 TFLOP/s, 2 s forward
    # and 6 s backward; 2 GB of bf16 gradients or weights cross PCIe in 2 s; the host step 1 s.
    work = StepWork(params=10**9, trainable=10**9, tokens=1000)
    on_device = predict(work, machine)
    assert on_device.step_seconds == pytest.approx(8) and on_device.tokens_per_second == pytest.approx(125)
    assert on_device.bound == "GPU compute"
    # Serial host engine: the GPU, then the copies down, the steps and the copies up as one pipeline (2 s).
    host = predict(replace(work, update="host"), machine)
    assert host.step_seconds == pytest.approx(10)
    assert host.parts == pytest.approx({"gpu": 8, "launch": 0, "pcie": 4, "host_step": 1, "host_sums": 0, "syncs": 0})
    # Overlapped: the 2 s pipeline hides behind the share of the 6 s backward.
    overlap = predict(replace(work, update="host", overlap=True), machine, samples_per_micro_batch=1)
    assert overlap.step_seconds == pytest.approx(8 + max(0.0, 2 - OVERLAP_HIDDEN_SHARE * 6))
    assert overlap.hides_at_batch == 1
    # With clipping the steps wait for the last backward's norms: nothing hides, at any batch.
    clipped = predict(replace(work, update="host", overlap=True, clipping=True), machine, samples_per_micro_batch=1)
    assert clipped.step_seconds == pytest.approx(8 + 2) and clipped.hides_at_batch is None
    # On a 0.5 GB/s bus the pipeline takes 4 s: two 1000-token samples' backwards (0.35 x 12 s) hide
    # it; with 250-token samples (the same 1000 tokens in 4), eight.
    slow = Machine.from_dict({**ROUND, "pcie_h2d_gbs": 0.5, "pcie_d2h_gbs": 0.5}, name="slow")
    assert predict(replace(work, update="host", overlap=True), slow, samples_per_micro_batch=1).hides_at_batch == 2
    assert predict(replace(work, update="host"), slow, samples_per_micro_batch=4).hides_at_batch == 8
    # The device update's states (8 s each way at 0.5 GB/s) hide the same way; the device and torchao have none.
    assert predict(replace(work, update="device_update"), slow, samples_per_micro_batch=1).hides_at_batch == 4
    assert predict(work, slow, samples_per_micro_batch=1).hides_at_batch is None
    # Three micro-batches with offload_gradients: 24 s of GPU work, gradients down three times, and
    # two sums of 8 GB (the 2-byte gradient written into the staging chunks by the DMA engine and read
    # from them, the sum read and written) at 6 GB/s: 4/3 s each.
    grads = predict(replace(work, update="host", offload_gradients=True, micro_batches=3), machine)
    assert grads.step_seconds == pytest.approx(24 + 8 / 3 + 2)
    assert grads.parts["pcie"] == pytest.approx(8) and grads.parts["host_sums"] == pytest.approx(8 / 3)
    assert grads.tokens_per_second == pytest.approx(3000 / (28 + 2 / 3))
    # The device update moves 4 bytes of state per parameter up and down: 4 s each way.
    assert predict(replace(work, update="device_update"), machine).step_seconds == pytest.approx(16)
    # torchao: the GPU, the copy down, the step, the copy up, one after the other.
    assert predict(replace(work, update="torchao"), machine).step_seconds == pytest.approx(13)
    # The 8-bit host step at 2000 Mparam/s; the fused fp32-master pass at its own 400.
    assert predict(replace(work, update="host", eight_bit=True), machine).parts["host_step"] == pytest.approx(0.5)
    assert predict(replace(work, update="host", master_fp32=True), machine).parts["host_step"] == pytest.approx(2.5)
    # Clipping host gradients in a pass of its own reads and writes 2 bytes a parameter (4 GB at 6 GB/s)
    # where the step cannot take the factor: torch's AdamW, and the serial path (which scales in place);
    # the overlapped AdamW8bit and fp32-master passes multiply as they read. Gradients clipped on the
    # device (serial, without offload_gradients) cost the host nothing.
    def host_step(**kw):
        return predict(replace(work, update="host", clipping=True, **kw), machine).parts["host_step"]

    assert host_step(overlap=True, offload_gradients=True) == pytest.approx(1 + 4 / 6)
    assert host_step(overlap=True) == pytest.approx(1 + 4 / 6)  # the window's gradients go to the host
    assert host_step(overlap=True, offload_gradients=True, eight_bit=True) == pytest.approx(0.5)
    assert host_step(overlap=True, master_fp32=True) == pytest.approx(2.5)
    assert host_step(offload_gradients=True, eight_bit=True) == pytest.approx(0.5 + 4 / 6)
    # fp32 gradient sums (4 bytes; host sums, so offload_gradients): narrowed to the bf16 parameter
    # before a step without masters (6 bytes), scaled for clipping in their own dtype (8); the master
    # pass reads them as they are (30 bytes against the 28 its rate is measured on), and AdamW8bit
    # takes the factor only on a sum of its parameter's dtype.
    assert host_step(overlap=True, offload_gradients=True, grad_sum_size=4) == pytest.approx(1 + (6 + 8) / 6)
    assert host_step(overlap=True, offload_gradients=True, master_fp32=True, grad_sum_size=4) == \
        pytest.approx(2.5 * 30 / 28)
    assert host_step(overlap=True, offload_gradients=True, eight_bit=True, grad_sum_size=4) == \
        pytest.approx(0.5 + (6 + 8) / 6)
    sums = predict(replace(work, update="host", offload_gradients=True, micro_batches=3, grad_sum_size=4), machine)
    assert sums.parts["host_sums"] == pytest.approx(2 * 12 / 6)  # staged 2 + 2, sum read and written 4 + 4
    # AdamW8bit over fp32 masters, at its rate over their bytes against the bf16 step's (28 / 14);
    # the gradient is scaled (in its own dtype, 4 bytes) and widened into a kept fp32 buffer (2 read, 4
    # written) first.
    assert host_step(overlap=True, eight_bit=True, master_fp32=True) == pytest.approx(1 + (4 + 6) / 6)
    # fp32 masters the fused pass does not step (amsgrad, fused_master_step: False, no C compiler): torch's
    # fp32 AdamW at the bf16 step's rate over their bytes (28 / 14), on the gradient widened into a kept
    # fp32 buffer (2 read, 4 written) and scaled in a pass of its own (4), the weight rounded after (4 + 2).
    assert host_step(overlap=True, master_fp32=True, fused_master=False) == pytest.approx(2 + (6 + 4 + 6) / 6)
    # With fp32 sums nothing is widened, and the scaling reads and writes 4-byte sums.
    assert host_step(overlap=True, offload_gradients=True, master_fp32=True, fused_master=False,
                     grad_sum_size=4) == \
        pytest.approx(2 + (8 + 6) / 6)
    assert host_step(overlap=True, master_fp32=True, fused_master=True) == pytest.approx(2.5)
    assert host_step() == pytest.approx(1)
    # Paged state beyond the device: 1 GB out and back in every step.
    paged = predict(replace(work, paged_excess_bytes=10**9), machine)
    assert paged.step_seconds == pytest.approx(10)
    # An optimizer that synchronizes the device 4000 times a step: the GPU waits 500 us at each.
    synced = predict(replace(work, device_syncs=4000), machine)
    assert synced.step_seconds == pytest.approx(10) and synced.parts["syncs"] == pytest.approx(2)
    assert predict(replace(work, device_syncs=40000), machine).bound == "device synchronizations"
    with pytest.raises(ValueError, match="device_syncs"):
        StepWork(params=1, trainable=1, tokens=1, update="host", device_syncs=1)
    # Without checkpointing 6 FLOPs per parameter and token; LoRA's frozen weights get no weight gradient.
    assert predict(replace(work, activation_checkpointing=False), machine).step_seconds == pytest.approx(6)
    assert predict(replace(work, activation_checkpointing=False, trainable=1), machine).step_seconds == \
        pytest.approx(4, rel=1e-6)
    with pytest.raises(ValueError, match="update"):
        StepWork(params=1, trainable=1, tokens=1, update="gpu")


def test_a_launching_thread_slower_than_the_gpus_work_bounds_the_passes():
    machine = Machine.from_dict(ROUND, name="round")
    # The known step's passes: 8 s of GPU work a micro-batch (2 forward, 6 backward).
    work = StepWork(params=10**9, trainable=10**9, tokens=1000, micro_batches=2)
    assert predict(work, machine).step_seconds == pytest.approx(16)
    # Operators and hand-offs launched faster than the GPU works: nothing changes but the part.
    quick = predict(replace(work, ops_per_micro_batch=100_000, handoffs_per_micro_batch=10_000), machine)
    assert quick.step_seconds == pytest.approx(16) and quick.bound == "GPU compute"
    assert quick.parts["launch"] == pytest.approx(2 * (100_000 * 10e-6 + 10_000 * 100e-6))  # 2 x 2 s
    # 1,000,000 operators at 10 us: 10 s a micro-batch, so the GPU waits for the launches.
    slow = predict(replace(work, ops_per_micro_batch=1_000_000), machine)
    assert slow.step_seconds == pytest.approx(20) and slow.bound == "launching thread"
    assert slow.parts["gpu"] == pytest.approx(16) and slow.parts["launch"] == pytest.approx(20)
    # The engine's hand-offs add to it: 20,000 at 100 us, 2 s more a micro-batch.
    hooked = predict(replace(work, update="host", overlap=True, ops_per_micro_batch=1_000_000,
                             handoffs_per_micro_batch=20_000), machine)
    assert hooked.parts["launch"] == pytest.approx(24)
    # The stretched backward (6 x 12/8 s) hides the overlapped host pipeline (2 s) as the GPU's would.
    assert hooked.step_seconds == pytest.approx(24 + max(0.0, 2 - OVERLAP_HIDDEN_SHARE * 9))
    # A batch whose GPU work is smaller than its launches is hidden behind by the launches: at 0.5
    # GB/s the pipeline (4 s) needs two samples' backwards of GPU work (0.35 x 12 s), or one sample
    # whose passes take 16 s of launching (backward 12 s); 14 s (backward 10.5 s) is not enough.
    slow_bus = Machine.from_dict({**ROUND, "pcie_h2d_gbs": 0.5, "pcie_d2h_gbs": 0.5}, name="slow")
    one = replace(work, update="host", overlap=True, micro_batches=1)
    assert predict(one, slow_bus, samples_per_micro_batch=1).hides_at_batch == 2
    assert predict(replace(one, ops_per_micro_batch=1_400_000), slow_bus, samples_per_micro_batch=1).hides_at_batch == 2
    assert predict(replace(one, ops_per_micro_batch=1_600_000), slow_bus, samples_per_micro_batch=1).hides_at_batch == 1
    with pytest.raises(ValueError, match="ops_per_micro_batch and handoffs_per_micro_batch"):
        StepWork(params=1, trainable=1, tokens=1, handoffs_per_micro_batch=-1)


def test_the_launch_probe_measures_operators_and_hand_offs_here():
    costs = probe_module.launch_costs(device=torch.device("cpu"), model="1B", repeats=2)
    assert costs.ops == narrowed_ops_per_micro_batch("1B") and costs.us_per_op > 0 and costs.handoff_us >= 0.1
    # One hand-off per layer, and one per bucket of the other parameters: the tied embedding before
    # the layers, the last norm after them.
    model = narrow_llama("1B", width=COUNT_WIDTH)
    names = [n for n, _ in model.named_parameters()]
    assert costs.handoffs == len(set(handoff_groups(names, [p.numel() * 2 for p in model.parameters()]))) == 16 + 2
    assert probe_module.launch_note(costs, model="1B").startswith(
        f"launch_us_per_op, handoff_us: the narrowed 1B's micro-batch, {costs.ops} operators, and under the engine "
        f"{costs.handoffs} hand-offs")


def test_the_recorded_runs_count_their_models_operators_and_the_hooks_they_ran():
    for run in recorded_runs():
        work = run.work
        assert work.ops_per_micro_batch == narrowed_ops_per_micro_batch({LLAMA3_2_1B: "1B", LLAMA3_2_3B: "3B",
                                                                         LLAMA3_1_8B: "8B"}[work.params])
        hooked = work.update == "host" and (work.offload_gradients or work.overlap)
        assert work.handoffs_per_micro_batch == (TENSORS[work.params] if hooked else 0), run.name


def test_sums_added_on_the_device_cost_the_link_both_ways_and_the_hosts_memory_twice():
    machine = Machine.from_dict(ROUND, name="round")
    work = StepWork(params=10**9, trainable=10**9, tokens=1000, update="host", offload_gradients=True, micro_batches=3)
    # Each later micro-batch's 2 GB sum goes up and comes back down (2 s each way at 1 GB/s, at
    # once), the host's memory read and written (4 GB at 6 GB/s): 2 s a sum, on the link.
    device = predict(replace(work, sums_on_device=True), machine)
    assert device.parts["host_sums"] == pytest.approx(2 * 2)
    assert device.parts["pcie"] == pytest.approx(2 + 2 + 2 * (2 + 2))
    assert device.step_seconds == pytest.approx(24 + 4 + 2)
    # On a 10 GB/s link the host's memory sets the pace: 4 GB at 6 GB/s against the host ring's 8 GB.
    fast = Machine.from_dict({**ROUND, "pcie_h2d_gbs": 10, "pcie_d2h_gbs": 10}, name="fast")
    assert predict(replace(work, sums_on_device=True), fast).parts["host_sums"] == pytest.approx(2 * 4 / 6)
    assert predict(work, fast).parts["host_sums"] == pytest.approx(2 * 8 / 6)
    # fp32 sums: 4 GB each way.
    wide = predict(replace(work, sums_on_device=True, grad_sum_size=4), fast)
    assert wide.parts["host_sums"] == pytest.approx(2 * 8 / 6)
    # Without accumulation nothing is summed, wherever.
    assert predict(replace(work, sums_on_device=True, micro_batches=1), fast).parts == \
        predict(replace(work, micro_batches=1), fast).parts


def test_a_step_that_sums_offloaded_gradients_is_also_predicted_summed_at_the_other_place():
    machine = Machine.from_dict(ROUND, name="round")
    work = StepWork(params=10**9, trainable=10**9, tokens=1000, update="host", offload_gradients=True, micro_batches=3)
    host, device = predict(work, machine), predict(replace(work, sums_on_device=True), machine)
    # Each names the other, with the other's own prediction (the figures of the test above).
    assert host.sums_elsewhere == ("device", pytest.approx(device.tokens_per_second))
    assert device.sums_elsewhere == ("host", pytest.approx(host.tokens_per_second))
    assert device.step_seconds == pytest.approx(24 + 4 + 2) and host.step_seconds == pytest.approx(24 + 8 / 3 + 2)
    # Nothing summed, or not summed by the host engine: no other place.
    for other in (replace(work, micro_batches=1), replace(work, offload_gradients=False), replace(work, update="device"),
                  replace(work, update="device_update"), replace(work, update="torchao")):
        assert predict(other, machine).sums_elsewhere is None
        assert predict(other, machine).summary()["sums_elsewhere"] is None
    assert host.summary()["sums_elsewhere"] == {"grad_sum_on": "device", "tokens_per_second": pytest.approx(
        device.tokens_per_second, rel=1e-3)}
    # The planner names the other place only where it is predicted at least 5% faster: here the host
    # ring (28.67 s against 30 s a step, 4.6% faster) is not named; on a 10 GB/s link the device is.
    assert sums_elsewhere_block({"config": device}) == []
    assert sums_elsewhere_block({"config": host}) == []
    fast = Machine.from_dict({**ROUND, "pcie_h2d_gbs": 10, "pcie_d2h_gbs": 10}, name="fast")
    faster = predict(replace(work, micro_batches=30), fast)
    (blank, header, line), = [sums_elsewhere_block({"config": faster, "adamw": predict(replace(work, update="device"), fast)})]
    assert blank == "" and "grad_sum_on" not in header and "docs/accumulation.md" in header
    assert line.startswith("- config: optimizer.grad_sum_on=device: ") and "128 MiB more on the device" in line
    assert f"against {faster.tokens_per_second:.0f}," in line
    # On the H100 preset the 8B accumulation run of the recorded runs: the device, as the runs measured.
    h100 = load_machine("h100_recorded")
    run = next(r for r in recorded_runs() if r.measured_tokens_per_second == 747)
    (line,) = sums_elsewhere_block({"config": predict(run.work, h100)})[2:]
    assert line.startswith("- config: optimizer.grad_sum_on=device: 2331 tok/s predicted against 1747")


@pytest.mark.parametrize("run", recorded_runs(), ids=lambda r: f"{r.source.split(':')[0][15:40]}-{r.name}")
def test_each_recorded_h100_run_is_within_20_percent_or_a_named_gap(run):
    speed = predict(run.work, load_machine("h100_recorded"), samples_per_micro_batch=run.samples_per_micro_batch)
    error = speed.tokens_per_second / run.measured_tokens_per_second - 1
    assert run.source.startswith("gpu_results.md, ")
    if run.gap is None:
        assert abs(error) <= TOLERANCE, (run.name, run.source, f"{error:+.1%}")
    else:
        # A gap the model has come to fit is no longer a gap: its cause must leave the list.
        assert abs(error) > TOLERANCE, (run.name, run.source, f"{error:+.1%}", run.gap)


def test_the_calibration_covers_the_recorded_runs_and_the_docs_show_it():
    runs = calibrate()
    sections = {run.source for run, _, _ in runs}
    for part in ("llama3_2 1B, whole GPU", "1B, GPU limited to 24 GiB", "3B, GPU limited to 24 GiB",
                 "llama3_1 8B", "bench_overlap", "with overlap", "update on the device"):
        assert any(part in s for s in sections), part
    assert "8B" in next(r.source for r, _, _ in runs if r.name.endswith("accumulation 4, clip 1.0") and
                        r.measured_tokens_per_second == 2043)
    # The page shows the table and its list of gaps as they are, and nothing more: the section runs
    # from the table's header to the first blank line after the list.
    page = (REPO / "docs/planner.md").read_text()
    start = page.index("| run | section of gpu_results.md |")
    end = page.index("\n\n", page.index("\n- ", page.index("Known gaps:", start)))
    assert page[start:end] == calibration_table()


def test_the_probe_measures_the_host_here_and_names_the_gpu_keys_to_take_from_a_preset(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    small = {"copy_bytes": 1 << 20, "step_params": 1 << 16, "pcie_bytes": 1 << 20}
    measured, missing, notes = probe_module.probe(sizes=small)
    assert notes == [] and missing == list(probe_module.GPU_KEYS) == [
        "gpu_bf16_tflops", "pcie_h2d_gbs", "pcie_d2h_gbs", "device_sync_us", "launch_us_per_op", "handoff_us"]
    assert set(measured) == set(MACHINE_KEYS) - set(missing)
    assert all(v > 0 for v in measured.values()) and measured["host_cores"] == probe_module.host_cores()
    # The verb writes what it measured; the planner then names the keys still missing.
    monkeypatch.setattr(probe_module, "FULL_SIZES", small)
    out = tmp_path / "machine.json"
    assert tune_offload(["probe", "--output", str(out)]) == 0
    with pytest.raises(ValueError, match="missing gpu_bf16_tflops, pcie_h2d_gbs, pcie_d2h_gbs, device_sync_us, "
                                         "launch_us_per_op, handoff_us"):
        load_machine(out)
    out.write_text(json.dumps({**json.loads(out.read_text()), **{k: 1.0 for k in missing}}))
    assert load_machine(out).host_cores == measured["host_cores"]


def test_the_probe_takes_the_gpu_keys_from_a_preset_where_asked_and_writes_a_whole_machine(monkeypatch, tmp_path,
                                                                                            capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(probe_module, "FULL_SIZES", {"copy_bytes": 1 << 20, "step_params": 1 << 16,
                                                     "pcie_bytes": 1 << 20})
    out = tmp_path / "machine.json"
    assert tune_offload(["probe", "--output", str(out), "--gpu-from", "rtx4090_ddr5"]) == 0
    report = capsys.readouterr().out
    machine, preset = load_machine(out).as_dict(), load_machine("rtx4090_ddr5").as_dict()
    gpu_keys = list(probe_module.GPU_KEYS)
    for key in gpu_keys:
        assert machine[key] == preset[key] and f"{key} = {preset[key]} (from the preset rtx4090_ddr5)" in report
    # The host keys are this machine's own, the file's keys in their order, and the preset's
    # figures called estimates.
    assert all(f"{key} = {machine[key]}\n" in report for key in MACHINE_KEYS if key not in gpu_keys)
    # The preset's GPU memory too (optional, last): the planner's device budget for the file.
    assert list(json.loads(out.read_text())) == [*MACHINE_KEYS, "device_memory_gib"]
    assert machine["device_memory_gib"] == 24.0 and "device_memory_gib = 24.0 (from the preset rtx4090_ddr5)" in report
    assert "The preset rtx4090_ddr5's figures are estimates" in report
    assert f"wrote {out}\n" in report + "\n" and "No CUDA device" not in report


def test_the_probe_refuses_an_unknown_preset_before_measuring_and_says_when_one_is_not_needed(monkeypatch, tmp_path,
                                                                                             capsys):
    def measured_everything(sizes=None):
        return probe_module.Probed(dict(load_machine("h100_recorded").as_dict()), [], [])

    monkeypatch.setattr(probe_module, "probe", lambda sizes=None: pytest.fail("measured before refusing"))
    with pytest.raises(ValueError, match="--gpu-from rtx9090: not a preset; the presets are h100_recorded, "):
        probe_module.run_probe(None, gpu_from="rtx9090")
    assert tune_offload(["probe", "--gpu-from", "rtx9090"]) == 2
    assert "--gpu-from rtx9090: not a preset; the presets are h100_recorded, " in capsys.readouterr().err
    # Where CUDA measured every key, the preset is not used, and the report says so.
    monkeypatch.setattr(probe_module, "probe", measured_everything)
    report = probe_module.run_probe(tmp_path / "m.json", gpu_from="rtx4090_ddr5")
    assert "--gpu-from rtx4090_ddr5: not used, every key was measured here." in report
    assert load_machine(tmp_path / "m.json").as_dict() == load_machine("h100_recorded").as_dict()


def test_the_step_rate_probe_runs_a_small_llama_step():
    rate = probe_module.step_tflops(device=torch.device("cpu"), num_layers=1, width=64, batches=(1, 2), seq_len=16,
                                    vocab=128, repeats=1)
    # On the CPU every op finishes before it returns: each batch is "launch-bound", so both were timed.
    assert rate.tflops > 0 and rate.batch == 2 and rate.launch_bound
    assert "a lower bound" in probe_module.step_note(rate, seq_len=16)


def test_the_step_probe_grows_the_batch_until_the_device_bounds_the_step():
    flops = 8e12  # a sample's FLOPs: one second a sample is 8 TFLOPS
    # (launch_s, wall_s) per batch: the device waits for the CPU at batches 2 and 4, works beyond it at 8.
    timings = {2: (0.20, 0.22), 4: (0.21, 0.25), 8: (0.22, 0.40), 16: (0.23, 0.80)}
    timed = []

    def time_batch(batch):
        timed.append(batch)
        return timings[batch]

    rate = probe_module.first_device_bound(time_batch, batches=(2, 4, 8, 16), flops_per_sample=flops)
    assert timed == [2, 4, 8] and rate.batch == 8 and not rate.launch_bound
    assert rate.tflops == pytest.approx(8 * 8 / 0.40)
    assert "lower bound" not in probe_module.step_note(rate, seq_len=2048)

    def out_of_memory_at_8(batch):
        if batch == 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return timings[batch]

    rate = probe_module.first_device_bound(out_of_memory_at_8, batches=(2, 4, 8), flops_per_sample=flops)
    assert rate.batch == 4 and rate.launch_bound and rate.tflops == pytest.approx(8 * 4 / 0.25)
    with pytest.raises(torch.OutOfMemoryError):
        probe_module.first_device_bound(out_of_memory_at_8, batches=(8,), flops_per_sample=flops)
    # Launch-bound at every batch: the last one's rate, said to be a lower bound.
    rate = probe_module.first_device_bound(lambda batch: timings[batch], batches=(2, 4), flops_per_sample=flops)
    assert rate.batch == 4 and rate.launch_bound and "lower bound" in probe_module.step_note(rate, seq_len=2048)
    with pytest.raises(ValueError, match="batches is empty"):
        probe_module.first_device_bound(time_batch, batches=(), flops_per_sample=flops)


def test_the_planner_adds_speed_to_each_variant(tiny_assets, tmp_path):
    stdout, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                              "dtype=bf16", "--device-gib", "1", "--host-gib", "64", "--no-fine-tunes",
                              "--variants", "adamw,offload,offload_grads_overlap,torchao,paged_adamw8bit,"
                              "paged_adamw8bit_in_bwd", "--machine", "h100_recorded")
    assert "Speed on h100_recorded" in stdout and "| s/step | tok/s | bound | overlap hides at batch |" in stdout
    machine = load_machine("h100_recorded")
    for name, plan in plans.items():
        speed = plan["speed"]
        assert set(speed) >= {"step_seconds", "tokens_per_second", "bound"}, name
        expected = predict(StepWork(**plan["work"]), machine, samples_per_micro_batch=plan["batch_size"])
        assert speed["tokens_per_second"] == pytest.approx(expected.tokens_per_second, rel=1e-3)
    assert plans["adamw"]["work"]["update"] == "device" and plans["torchao"]["work"]["update"] == "torchao"
    assert plans["offload_grads_overlap"]["work"]["overlap"] and plans["offload"]["work"]["update"] == "host"
    assert plans["adamw"]["speed"]["tokens_per_second"] > plans["offload"]["speed"]["tokens_per_second"]
    # bitsandbytes synchronizes after each tensor's update, and a paged optimizer at the end of each
    # step(): once a step after backward, once a tensor in it. torch's optimizers and ours never.
    tensors = plans["paged_adamw8bit"]["work"]["device_syncs"] - 1
    assert tensors > 1 and plans["paged_adamw8bit_in_bwd"]["work"]["device_syncs"] == 2 * tensors
    assert [plans[v]["work"]["device_syncs"] for v in ("adamw", "offload", "torchao")] == [0, 0, 0]
    # Every variant's passes dispatch the same operators (the trace's count); only this project's
    # engine hands gradients over in backward (with offload_gradients or overlap): per layer, and per
    # bucket of the other parameters.
    assert len({plan["work"]["ops_per_micro_batch"] for plan in plans.values()}) == 1
    assert plans["adamw"]["work"]["ops_per_micro_batch"] > 100
    layers = len(tiny_llama().layers)
    for name, plan in plans.items():
        engine = name == "offload_grads_overlap"
        assert plan["work"]["handoffs_per_micro_batch"] == (layers + 2 if engine else 0), name
    assert plans["offload_grads_overlap"]["speed"]["hides_at_batch"] >= 1
    # Where overlap would hide the offload variants' work; nothing to hide for the others.
    assert plans["offload"]["speed"]["hides_at_batch"] >= 1
    assert plans["adamw"]["speed"]["hides_at_batch"] is None and plans["torchao"]["speed"]["hides_at_batch"] is None
    assert plans["paged_adamw8bit"]["speed"]["hides_at_batch"] is None
    # Beside each prediction, the known gaps of its kind of step, with what the recorded runs made of it.
    for name, plan in plans.items():
        expected = [{"label": label, "measured_over_predicted": [pytest.approx(lo, rel=1e-3), pytest.approx(hi, rel=1e-3)]}
                    for label, lo, hi in known_gaps(StepWork(**plan["work"]))]
        assert plan["speed"]["known_gaps"] == expected, name
    assert [g["label"] for g in plans["torchao"]["speed"]["known_gaps"]] == ["torchao"]
    assert plans["adamw"]["speed"]["known_gaps"] == [] and plans["paged_adamw8bit_in_bwd"]["speed"]["known_gaps"] == []
    assert "Known gaps of the speed model" in stdout and "\n- torchao: torchao: 0." in stdout
    # Without accumulation nothing is summed: no other place to name.
    assert all(plan["speed"]["sums_elsewhere"] is None for plan in plans.values())
    assert "Where later micro-batches are summed" not in stdout


def test_the_planner_names_the_faster_place_to_sum_the_micro_batches(tiny_assets, tmp_path):
    # A host whose memory is slow beside a fast link: the sums are faster on the device (4 bytes of
    # host memory a parameter against the ring's 8).
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({**ROUND, "pcie_h2d_gbs": 1000.0, "pcie_d2h_gbs": 1000.0, "host_copy_gbs": 0.01}))
    stdout, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                              "dtype=bf16", "gradient_accumulation_steps=4", "--device-gib", "1", "--host-gib", "64",
                              "--no-fine-tunes", "--variants", "adamw,offload_grads_overlap", "--machine", str(machine))
    grads = plans["offload_grads_overlap"]["speed"]
    assert plans["adamw"]["speed"]["sums_elsewhere"] is None
    assert grads["sums_elsewhere"]["grad_sum_on"] == "device"
    assert grads["sums_elsewhere"]["tokens_per_second"] > 1.05 * grads["tokens_per_second"]
    assert "Where later micro-batches are summed" in stdout
    (line,) = [x for x in stdout.splitlines() if x.startswith("- offload_grads_overlap: optimizer.grad_sum_on=device: ")]
    other, this = re.fullmatch(r".*: (\d+) tok/s predicted against (\d+), for at most 128 MiB more on the device",
                               line).groups()
    assert float(other) == pytest.approx(grads["sums_elsewhere"]["tokens_per_second"], rel=1e-3)
    assert float(this) == pytest.approx(grads["tokens_per_second"], rel=1e-3)


def test_a_gaps_kind_of_step_is_that_of_the_recorded_runs_that_show_it():
    """The planner warns of a gap on exactly the steps of the kind the recorded runs showing it are:
    each such run is of its gap's kind, and no run that the model fits is."""
    for run in recorded_runs():
        labels = [label for label, _, _ in known_gaps(run.work)]
        shown = run.gap is not None and run.gap.applies is not None
        assert labels == ([run.gap.label] if shown else []), (run.name, run.source)
    micro = next(r for r in recorded_runs() if r.gap is not None and r.gap.label == "per-micro-batch host cost")
    (label, lo, hi), = known_gaps(micro.work)
    assert 0 < lo < hi < 1 - TOLERANCE  # the runs made well under the prediction
    # Adding the sums on the device is another kind of step, with a gap of its own (two runs).
    (label, lo, hi), = known_gaps(replace(micro.work, sums_on_device=True))
    assert label == "accumulation with the sums on the device" and 0 < lo < hi < 1 - TOLERANCE
    # Without accumulation neither applies.
    assert known_gaps(replace(micro.work, micro_batches=1)) == []
    assert known_gaps(replace(micro.work, micro_batches=1, sums_on_device=True)) == []


@pytest.mark.parametrize("name, paged", [("AdamW8bit", False), ("PagedAdamW8bit", True), ("PagedAdamW", True)])
def test_the_synchronizations_the_model_counts_are_bitsandbytes_own(monkeypatch, name, paged):
    calls = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", calls.append)
    # Three tensors with 8-bit states, and one under bitsandbytes' 4096 elements (32-bit states).
    params = [torch.nn.Parameter(torch.randn(8192)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(16))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer_class = getattr(bnb.optim, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers fall back to unpaged ones on the CPU, and say so
        optimizer_class(params, lr=1e-3).step()
        assert len(calls) == bitsandbytes_syncs_per_step(tensors=4, paged=paged, in_backward=False)
        calls.clear()
        # Stepping in backward (torchtune's optimizer_in_bwd): an optimizer of its own per parameter.
        for p in params:
            optimizer_class([p], lr=1e-3).step()
    assert len(calls) == bitsandbytes_syncs_per_step(tensors=4, paged=paged, in_backward=True)


def test_the_planner_counts_the_synchronizations_of_bitsandbytes_optimizers_only():
    after = {"tensors": 10, "in_backward": False}
    assert device_syncs(bnb.optim.AdamW8bit, {"lr": 1e-3}, **after) == 10
    assert device_syncs(bnb.optim.AdamW8bit, {"lr": 1e-3, "is_paged": True}, **after) == 11  # paged by option
    assert device_syncs(bnb.optim.PagedAdamW, {"lr": 1e-3}, **after) == 11
    assert device_syncs(bnb.optim.PagedAdamW8bit, {"lr": 1e-3}, tensors=10, in_backward=True) == 20
    # bitsandbytes' plain-torch LARS does not synchronize, nor does torch's AdamW.
    assert device_syncs(bnb.optim.PytorchLARS, {"lr": 1e-3}, **after) == 0
    assert device_syncs(torch.optim.AdamW, {"lr": 1e-3}, **after) == 0


def test_the_recorded_runs_count_their_models_parameter_tensors():
    with torch.device("meta"):
        for builder, params in ((llama3_2_1b, LLAMA3_2_1B), (llama3_2_3b, LLAMA3_2_3B), (llama3_1_8b, LLAMA3_1_8B)):
            model = builder()
            assert sum(p.numel() for p in model.parameters()) == params
            assert len(list(model.parameters())) == TENSORS[params], builder.__name__


def test_the_sync_probe_times_a_step_over_its_synchronizations(monkeypatch):
    # A clock that advances one second at each synchronization, and only then: a step over two
    # parameters synchronizes three times (after each update, and once more as a paged optimizer),
    # so one second per synchronization; divided by the tensors instead, it would read 1.5.
    class Clock:
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            return cls.now

    def sync(tensor: torch.Tensor) -> None:
        Clock.now += 1.0

    monkeypatch.setattr(probe_module, "time", Clock)
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", sync)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        us = probe_module.sync_call_us(device=torch.device("cpu"), tensors=2, numel=4096, repeats=2)
    assert us == pytest.approx(1e6)


@pytest.mark.gpu
def test_the_probe_measures_the_gpu_keys_where_cuda_is():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    measured, notes = probe_module.probe_gpu(pcie_bytes=1 << 26, step={"num_layers": 1, "width": 256,
                                                                        "batches": (1, 2), "seq_len": 256,
                                                                        "vocab": 1024}, repeats=2,
                                             sync_probe={"tensors": 8})
    assert len(notes) == 2 and notes[0].startswith("gpu_bf16_tflops: a training step of batch ")
    assert notes[1].startswith("launch_us_per_op, handoff_us: the narrowed 8B's micro-batch, ")
    assert set(measured) == set(probe_module.GPU_KEYS)
    assert all(v > 0 for v in measured.values())


def test_the_plan_knows_where_the_fused_master_pass_cannot_step(monkeypatch):
    masters = {"master_dtype": "fp32"}

    def fused(own, options, base="torch.optim.AdamW"):
        chosen = describe_optimizer(OmegaConf.create({"_component_": "torchtune_offload.OffloadOptimizer",
                                                      "optimizer_class": base, **own, **options}), in_backward=False)
        return planner._fused_master(chosen, dtype=torch.bfloat16)

    if fused_step.c_compiler() is not None:
        assert fused(masters, {"lr": 1e-5}) and fused({**masters, "grad_sum_dtype": "fp32", "offload_gradients": True}, {})
    assert not fused(masters, {"amsgrad": True})
    assert not fused({**masters, "fused_master_step": False}, {})
    assert not fused(masters, {}, base="torch.optim.SGD")
    monkeypatch.setattr(fused_step, "c_compiler", lambda: None)
    assert not fused(masters, {})


def test_the_plan_prices_a_master_step_that_amsgrad_keeps_out_of_the_fused_pass(tiny_assets, tmp_path):
    def master_work(*overrides):
        _, plans = _plan_cli(tmp_path, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                             "dtype=bf16", "--device-gib", "1", "--host-gib", "64", "--no-fine-tunes", "--variants",
                             "offload_master_overlap", "--machine", "h100_recorded", *overrides)
        return plans["offload_master_overlap"]

    fused, amsgrad = master_work(), master_work("optimizer.amsgrad=True")
    assert fused["work"]["master_fp32"] and amsgrad["work"]["master_fp32"]
    assert fused["work"]["fused_master"] is (fused_step.c_compiler() is not None)
    assert amsgrad["work"]["fused_master"] is False
    if fused["work"]["fused_master"]:
        # Priced slower (the tiny model's passes are the launching thread's, which hides either step).
        assert amsgrad["speed"]["parts"]["host_step"] > fused["speed"]["parts"]["host_step"]


def test_the_probe_refuses_an_output_it_would_lose_or_overwrite_before_measuring(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(probe_module, "probe", lambda sizes=None: pytest.fail("measured before refusing"))
    assert tune_offload(["probe", "--output", str(tmp_path)]) == 2
    assert "is a folder; give a file's path" in capsys.readouterr().err
    (tmp_path / "machine.json").write_text('{"edited": "by hand"}\n')
    assert tune_offload(["probe", "--output", str(tmp_path / "machine.json")]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err
    assert (tmp_path / "machine.json").read_text() == '{"edited": "by hand"}\n'
    monkeypatch.setattr(probe_module, "probe", lambda sizes=None: probe_module.Probed(
        dict(load_machine("h100_recorded").as_dict()), [], []))
    assert tune_offload(["probe", "--output", str(tmp_path / "machine.json"), "--force"]) == 0
    assert load_machine(tmp_path / "machine.json").as_dict() == load_machine("h100_recorded").as_dict()


def test_where_cuda_is_present_the_probe_writes_the_gpus_memory_rounded_down(monkeypatch):
    # The CUDA branch on the CPU: the GPU's rates given, its total_memory read as torch reports it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = {"gpu_bf16_tflops": 100.0, "pcie_h2d_gbs": 20.0, "pcie_d2h_gbs": 20.0, "device_sync_us": 100.0,
           "launch_us_per_op": 8.0, "handoff_us": 90.0}
    monkeypatch.setattr(probe_module, "probe_gpu", lambda **kwargs: (dict(gpu), ["a note"]))
    total = int(23.99 * 2**30)  # an RTX 4090's total_memory is about this
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": total})())
    measured, missing, notes = probe_module.probe(sizes={"copy_bytes": 1 << 20, "step_params": 1 << 16,
                                                          "pcie_bytes": 1 << 20})
    assert missing == [] and notes == ["a note"]
    assert measured["device_memory_gib"] == 23.9  # down: the budget it becomes must not pass the device
    assert list(measured) == [*MACHINE_KEYS, "device_memory_gib"]
    assert Machine.from_dict(measured, name="probed").device_memory_gib == 23.9
