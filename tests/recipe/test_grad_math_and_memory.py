"""Unit tests of gradient stepping, the loss scale, memory figures and the DiskLogger reader."""


import re
import sys
import time
import types

import pytest
import torch
from omegaconf import OmegaConf
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import config, training
from torchtune.training.metric_logging import DiskLogger, WandBLogger

from torchtune_offload import OffloadOptimizer
from torchtune_offload.recipe import (
    HoldingOptimizer,
    InBackwardOptimizers,
    MemoryMonitor,
    OptimizerKind,
    RunOptimizer,
    loss_scale,
    read_disk_log,
    sum_over_ranks,
    use_expandable_segments,
)
from torchtune_offload.recipe.checks.config import check_recipe_config
from torchtune_offload.recipe.checks.fit import check_lora_model_fits_device, check_weights_fit_device
from torchtune_offload.recipe.reports.memory import GIB
from torchtune_offload.recipe.reports.run_report import (
    NVML_NOTE,
    compare_runs,
    median_tokens_per_second,
    run_figures,
    run_summary,
    summarise_in_wandb,
)
from tests.conftest import REPO_ROOT as REPO


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model(torch.randn(8, 16)).pow(2).sum().mul(10).backward()
    return model


def _plain_sgd(model, clip):
    return RunOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), params=model.parameters(),
                        clip_grad_norm=clip, kind=OptimizerKind.PLAIN)


def _offload_sgd(model, clip):
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.SGD", lr=0.1, minimal_size=64)
    return HoldingOptimizer(opt, model=model, clip_grad_norm=clip)


# A plain optimizer is clipped on the model's .grad; one that holds its gradients clips them itself.
@pytest.mark.parametrize("make_optimizer", [_plain_sgd, _offload_sgd], ids=["plain", "holds-gradients"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_stepper_clips_as_torch_does_then_steps_and_zeroes(make_optimizer, clip):
    model = _model_with_grads()
    twin = _model_with_grads()  # the same seed: the same weights and gradients
    stepper = make_optimizer(model, clip)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    norm = stepper.step()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), clip if clip is not None else float("inf"))
    twin_opt.step()
    torch.testing.assert_close(norm, expected)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
        assert p.grad is None


def test_optimizers_stepping_in_backward_leave_nothing_to_step():
    model = _model_with_grads()

    class Wrapper:  # stands in for torchtune's in-backward wrapper: step() must not touch it
        optim_map = {}

    stepper = InBackwardOptimizers(Wrapper())
    assert stepper.step() is None
    assert all(p.grad is not None for p in model.parameters())


def test_loss_scale_and_sum_without_a_process_group():
    tokens = torch.tensor(40)
    assert sum_over_ranks(tokens) is tokens
    torch.testing.assert_close(loss_scale(num_tokens=tokens), torch.tensor(1 / 40))
    torch.testing.assert_close(loss_scale(num_tokens=torch.tensor(0)), torch.tensor(1.0))  # no division by 0


def test_memory_monitor_on_cpu_reports_host_and_optimizer_figures():
    model = _model_with_grads()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=64)
    opt.step()  # creates the AdamW state
    monitor = MemoryMonitor(torch.device("cpu"), optimizer=opt)
    try:
        stats = monitor.stats(reset=True)
    finally:
        monitor.close()
    assert not any(k.startswith("peak_memory") or k.startswith("nvml") for k in stats)  # no device figures on CPU
    assert 0 < stats["host_rss"] <= stats["host_rss_peak"]
    report = opt.memory_report()
    assert stats["optimizer_host"] == report.host_bytes / GIB > 0
    assert stats["optimizer_pinned"] == 0  # nothing is pinned without an accelerator
    assert stats["optimizer_device_saved"] == report.device_bytes_saved / GIB


def test_memory_monitor_without_an_offload_optimizer():
    params = [torch.nn.Parameter(torch.ones(2))]
    plain = RunOptimizer(torch.optim.SGD(params, lr=1), params=params, clip_grad_norm=None, kind=OptimizerKind.PLAIN)
    monitor = MemoryMonitor(torch.device("cpu"), optimizer=plain)
    stats = monitor.stats(reset=False)
    monitor.close()
    assert set(stats) == {"host_rss", "host_rss_peak"}


def test_memory_monitor_logs_the_allocators_stalls_as_their_growth_between_log_lines(monkeypatch):
    """Retries, driver allocations and frees, all-stream synchronizations: counted by the caching
    allocator from the start; each log line gets what happened since the previous one."""
    counters = iter([
        {"num_alloc_retries": 0, "num_device_alloc": 10, "num_device_free": 2, "num_sync_all_streams": 1},
        {"num_alloc_retries": 3, "num_device_alloc": 14, "num_device_free": 2, "num_sync_all_streams": 4},
        {"num_alloc_retries": 3, "num_device_alloc": 15, "num_device_free": 5, "num_sync_all_streams": 4},
    ])
    resets = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda device: dict(next(counters)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda device: GIB)
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda device: 2 * GIB)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda device: resets.append(device))
    monitor = MemoryMonitor(torch.device("meta"))
    events = ("alloc_retries", "device_allocs", "device_frees", "sync_all_streams")
    first, peeked, second = (monitor.stats(reset=r) for r in (True, False, True))
    monitor.close()
    assert [first[k] for k in events] == [0, 10, 2, 1]  # since the process started
    assert [peeked[k] for k in events] == [3, 4, 0, 3]  # a read without reset moves nothing
    assert [second[k] for k in events] == [3, 5, 3, 3]
    assert first["peak_memory_reserved"] == 2.0 and len(resets) == 2


def _log_run(log_dir, losses, filename=None):
    logger = DiskLogger(log_dir=str(log_dir), **({"filename": filename} if filename else {}))
    for step, loss in enumerate(losses, start=1):
        logger.log_dict({"loss": loss, "tokens_per_second": 100.0 * step, "host_rss_peak": 0.5}, step=step)
    logger.close()


def test_read_disk_log_reads_what_torchtunes_disk_logger_writes(tmp_path):
    _log_run(tmp_path / "logs", [2.5, 2.25, 1.0000000000000002], filename="run.txt")
    rows = read_disk_log(tmp_path / "logs" / "run.txt")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == [2.5, 2.25, 1.0000000000000002]  # full precision
    assert rows[1]["tokens_per_second"] == 200.0


def test_read_disk_log_of_an_output_dir_takes_the_newest_file(tmp_path):
    _log_run(tmp_path / "logs", [9.0], filename="log_1.txt")
    _log_run(tmp_path / "logs", [3.0, 2.0], filename="log_2.txt")
    assert [r["loss"] for r in read_disk_log(tmp_path)] == [3.0, 2.0]
    with pytest.raises(FileNotFoundError, match="no DiskLogger file"):
        read_disk_log(tmp_path / "elsewhere")


def _log_steps(log_file, steps):
    logger = DiskLogger(log_dir=str(log_file.parent), filename=log_file.name)
    for step, loss in steps.items():
        logger.log_dict({"loss": loss, "tokens_per_second": 100.0}, step=step)
    logger.close()
    time.sleep(0.01)  # the files are ordered by modification time


def test_an_output_dir_of_a_resumed_run_reads_across_its_log_files(tmp_path):
    """kill -9 at step 5 with a checkpoint at step 3, then two resumes (the first killed before it
    logged): the steps the resumed run logged again replace the first file's."""
    logs = tmp_path / "logs"
    _log_steps(logs / "log_1.txt", {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.5, 5: 1.25})
    _log_steps(logs / "log_2.txt", {})
    _log_steps(logs / "log_3.txt", {4: 1.0, 5: 0.5, 6: 0.25})
    assert [(r["step"], r["loss"]) for r in read_disk_log(tmp_path)] == [
        (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0), (5, 0.5), (6, 0.25)]
    assert [r["step"] for r in read_disk_log(logs / "log_3.txt")] == [4, 5, 6]  # a file is read as it is
    assert read_disk_log(logs) == read_disk_log(tmp_path)  # the logs folder given for the output_dir
    # The run started afresh in the same output_dir (with --force, say) is read alone.
    _log_steps(logs / "log_4.txt", {1: 9.0, 2: 8.0})
    assert [r["loss"] for r in read_disk_log(tmp_path)] == [9.0, 8.0]


def test_a_named_log_file_that_a_resumed_run_appended_to_reads_as_one_run(tmp_path):
    """DiskLogger appends to a file the config names (metric_logger.filename), and to the same
    log_<second>.txt for two runs started within one second: the step going back splits them."""
    logger = DiskLogger(log_dir=str(tmp_path), filename="run.txt")
    for step, loss in ((1, 4.0), (2, 3.0), (3, 2.0), (2, 1.0), (3, 0.5), (4, 0.25)):  # resumed from step 1
        logger.log_dict({"loss": loss}, step=step)
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_disk_log(tmp_path / "run.txt")] == [
        (1, 4.0), (2, 1.0), (3, 0.5), (4, 0.25)]
    with open(tmp_path / "run.txt", "a") as f:  # then a new run from step 1 in the same file
        f.write("Step 1 | loss:7.0 \n")
    assert read_disk_log(tmp_path / "run.txt") == [{"step": 1, "loss": 7.0}]


def test_a_sweeps_output_dir_given_for_a_run_names_the_runs_inside(tmp_path):
    for variant in ("offload", "adamw"):
        _log_run(tmp_path / "sweep" / variant / "logs", [2.0], filename="log_1.txt")
    (tmp_path / "sweep" / "results.md").write_text("")
    with pytest.raises(FileNotFoundError) as err:
        read_disk_log(tmp_path / "sweep")
    assert str(err.value) == (f"no DiskLogger file (logs/log_*.txt) under {tmp_path / 'sweep'}; it holds runs in "
                              f"{tmp_path / 'sweep' / 'adamw'}, {tmp_path / 'sweep' / 'offload'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="under .*empty: did the run start"):
        read_disk_log(tmp_path / "empty")


def test_compare_runs_puts_runs_side_by_side(tmp_path):
    _log_run(tmp_path / "a" / "logs", [3.0, 2.0, 1.0], filename="log_1.txt")
    _log_run(tmp_path / "b" / "logs", [3.0, 2.5, 1.5], filename="log_1.txt")
    text = compare_runs({"plain": tmp_path / "a", "offload": tmp_path / "b"})
    assert "largest loss difference from plain: 0.5" in text
    assert "host_rss_peak" in text and "250" in text  # median tok/s after the first step


def test_a_finished_runs_summary_gives_its_median_speed_and_peaks(tmp_path):
    _log_run(tmp_path / "logs", [3.0, 2.0, 1.0], filename="log_1.txt")
    line = run_summary(read_disk_log(tmp_path))
    # 200 and 300 tok/s after the first step's 100; host_rss_peak logged as 0.5 at every step.
    assert line.startswith("Finished: 250.0 tok/s (median of the logged steps after the first); peak memory, GiB: "
                           "host_rss_peak 0.50."), line
    assert run_summary([]).startswith("Finished: no step was logged")


def test_compare_runs_matches_steps_and_shows_a_figure_a_run_never_logged_as_a_dash(tmp_path):
    """A run logging every step beside one logging every second step (or resumed mid-run): losses
    are compared at the steps both logged, not row by row; optimizer memory a plain run never
    reports is '-', not 0."""
    losses = {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5}
    every = DiskLogger(log_dir=str(tmp_path / "a" / "logs"), filename="log_1.txt")
    for step, loss in losses.items():
        every.log_dict({"loss": loss, "tokens_per_second": 100.0}, step=step)
    every.close()
    second = DiskLogger(log_dir=str(tmp_path / "b" / "logs"), filename="log_1.txt")
    for step in (2, 4):
        second.log_dict({"loss": losses[step], "tokens_per_second": 100.0, "optimizer_host": 1.5}, step=step)
    second.close()
    text = compare_runs({"plain": tmp_path / "a", "offload": tmp_path / "b"})
    assert "largest loss difference from plain: 0" in text.splitlines()
    table = text.split("Summary")[1].splitlines()
    plain_row = next(line for line in table if line.strip().startswith("plain"))
    offload_row = next(line for line in table if line.strip().startswith("offload"))
    assert plain_row.split()[-1] == "-" and offload_row.split()[-1] == "1.5000"


def test_compare_runs_of_one_run_without_shared_steps_and_of_a_diverged_run(tmp_path):
    _log_run(tmp_path / "a" / "logs", [3.0, 2.0], filename="log_1.txt")
    one = compare_runs({"only": tmp_path / "a"})
    assert "largest loss difference" not in one and "(the steps every run logged)" not in one
    later = DiskLogger(log_dir=str(tmp_path / "b" / "logs"), filename="log_1.txt")
    later.log_dict({"loss": 1.0, "tokens_per_second_per_gpu": 80.0}, step=7)  # torchtune's own name
    later.log_dict({"loss": float("nan"), "tokens_per_second_per_gpu": 90.0}, step=8)  # diverged
    later.close()
    text = compare_runs({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert "no step was logged by every run" in text
    assert next(line for line in text.splitlines() if line.strip().startswith("b:")).endswith("!")
    assert next(line for line in text.split("Summary")[1].splitlines() if line.strip().startswith("b ")).split()[1] \
        == "90"


def test_compare_widens_for_long_names_names_where_a_run_diverged_and_says_what_nvml_counts(tmp_path):
    long = "offload_grads_overlap_device_sums"
    ok = DiskLogger(log_dir=str(tmp_path / "a" / "logs"), filename="log_1.txt")
    gone = DiskLogger(log_dir=str(tmp_path / "b" / "logs"), filename="log_1.txt")
    for step in (1, 2, 3):
        ok.log_dict({"loss": 3.0, "tokens_per_second": 10.0, "nvml_device_used_peak": 2.0, "optimizer_pinned": 0.25},
                    step=step)
        gone.log_dict({"loss": 3.0, "grad_norm": float("inf") if step == 2 else 1.0, "tokens_per_second": 10.0},
                      step=step)
    ok.close()
    gone.close()
    text = compare_runs({long: tmp_path / "a", "b": tmp_path / "b"})
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("step  "))
    assert header.split() == ["step", long, "b"] and len(header) == len(next(l for l in lines if l.startswith("   1")))
    summary = text.split("Summary")[1].splitlines()
    assert next(l for l in summary if l.strip().startswith(long)).split()[-1] == "0.2500"  # optimizer_pinned
    assert "b diverged: grad_norm inf at step 2" in lines and f"{long} diverged" not in text
    assert lines[-1] == NVML_NOTE
    assert NVML_NOTE not in compare_runs({"b": tmp_path / "b"})  # shown only beside the figure


def test_an_output_dir_a_run_logged_to_wandb_only_says_so(tmp_path):
    (tmp_path / "run" / "logs" / "wandb").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"logged to W&B only \(logs/wandb\). Compare it in W&B, or run it "
                       r"again with metric_logger._component_=torchtune.training.metric_logging.DiskLogger"):
        read_disk_log(tmp_path / "run")


def test_a_wandb_runs_summary_gets_the_median_speed_and_the_peaks_over_the_run(monkeypatch, tmp_path):
    rows = [{"step": 1, "loss": 3.0, "tokens_per_second": 10.0, "host_rss_peak": 2.0},
            {"step": 2, "loss": 2.0, "tokens_per_second": 30.0, "host_rss_peak": 1.5},
            {"step": 3, "loss": 1.0, "tokens_per_second": 20.0, "host_rss_peak": 1.0}]
    assert run_figures(rows) == {"tokens_per_second_median": 25.0, "host_rss_peak_gib": 2.0}
    run = types.SimpleNamespace(summary={})
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=run))
    summarise_in_wandb(DiskLogger(log_dir=str(tmp_path)), rows)  # not a W&B run: nothing to do
    assert run.summary == {}
    summarise_in_wandb(WandBLogger.__new__(WandBLogger), rows)
    assert run.summary == run_figures(rows)
    # Logged with W&B only, a run's closing line does not point at compare, which reads DiskLogger files.
    assert run_summary(rows, disk_log=False).endswith("host_rss_peak 2.00.")
    assert "tune-offload compare" in run_summary(rows)


def test_the_median_speed_leaves_out_the_warm_up_and_the_profiled_steps():
    """A profiled step runs slower: a sweep or a comparison with the profiler on would otherwise
    report it. Where every step after the first was profiled, those are what there is."""
    rows = [{"step": 1, "tokens_per_second": 10.0}, {"step": 2, "tokens_per_second": 100.0},
            {"step": 3, "tokens_per_second": 40.0, "profiled": 1.0},
            {"step": 4, "tokens_per_second": 30.0, "profiled": 1.0}, {"step": 5, "tokens_per_second": 110.0}]
    assert median_tokens_per_second(rows) == 105.0
    assert median_tokens_per_second(rows[:1] + rows[2:4]) == 35.0
    assert median_tokens_per_second(rows[:1]) == 10.0


@pytest.mark.parametrize("device, offloads, env, expected", [
    ("cuda", True, None, ["expandable_segments:True"]),
    ("cuda", True, "max_split_size_mb:128", []),  # the user's own setting is left alone
    ("cuda", False, None, []),  # plain optimizers keep torch's default
    ("cpu", True, None, []),
])
def test_offload_runs_get_expandable_segments_unless_the_user_chose(monkeypatch, device, offloads, env, expected):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    if env is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    note = use_expandable_segments(torch.device(device), offloads=offloads)
    assert calls == expected
    assert (note is not None) == bool(expected)
    if note:
        assert "PYTORCH_CUDA_ALLOC_CONF" in note


def test_nvml_peak_is_the_highest_use_the_sampler_saw_since_the_last_reset(monkeypatch):
    """The NVML figure (another process's memory, fragmentation and the CUDA context included) is
    polled on a thread of its own: the peak between log lines, reset to what is in use now. A
    fake NVML stands in for the driver; the device is found by its UUID, with NVML's GPU- prefix."""
    used, handles = [5 * GIB], []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: handles.append(uuid) or "handle",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=used[0]),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="1234-abcd"))
    monitor = MemoryMonitor(torch.device("cuda"))
    sampler = monitor._nvml
    assert sampler is not None and handles == ["GPU-1234-abcd"]
    deadline = time.monotonic() + 10
    while sampler._peak < 5 * GIB and time.monotonic() < deadline:  # until the thread has polled it
        time.sleep(0.005)
    used[0] = 1 * GIB  # the peak has passed: the sampler saw it, the reads below do not
    first, second = monitor.stats(reset=True), monitor.stats(reset=True)
    monitor.close()
    assert first["nvml_device_used_peak"] == 5.0 and second["nvml_device_used_peak"] == 1.0
    assert not sampler._thread.is_alive()


def test_without_nvml_the_monitor_says_so_and_logs_the_rest(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monitor = MemoryMonitor(torch.device("cuda"))
    assert monitor._nvml is None and "NVML device memory unavailable" in capsys.readouterr().out
    assert "nvml_device_used_peak" not in monitor.stats()
    monitor.close()


def test_weights_that_cannot_fit_the_devices_free_memory_are_refused_before_the_model_is_built(monkeypatch):
    """The recipe puts every weight on the device before its optimizer exists (FP8 images too are
    made from them): a device without room for them is named by size, not met by an
    out-of-memory error part-way through the load. Only CUDA runs are checked."""
    gib = GIB
    weights = {"a": torch.empty(3 * gib // 2, dtype=torch.uint8, device="meta"),
               "b": torch.empty(gib // 2, dtype=torch.uint8, device="meta")}  # 2 GiB of elements: 4 GiB in bf16
    asked = []

    def free_of(device):
        asked.append(device)
        return free, 16 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", free_of)
    cuda = torch.device("cuda", 0)
    free = 4 * gib
    check_weights_fit_device(weights, device=cuda, dtype=torch.bfloat16)  # exactly fits
    free = 4 * gib - 1  # one byte short
    with pytest.raises(ValueError, match=r"device=cuda:0: the model's weights are 4.00 GiB in torch.bfloat16.*"
                                         r"free of 16.00 GiB"):
        check_weights_fit_device(weights, device=cuda, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"optimizer.device_weights=fp8 too"):
        check_weights_fit_device(weights, device=cuda, dtype=torch.bfloat16, device_weights="fp8")
    check_weights_fit_device(weights, device=cuda, dtype=torch.uint8)  # 2 GiB in one byte each
    assert asked == [cuda] * 4
    check_weights_fit_device(weights, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert len(asked) == 4


def _tiny_lora_settings(*overrides):
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / "lora.yaml"),
                          OmegaConf.from_dotlist(["device=cuda", "dtype=bf16", *overrides]))
    return cfg, check_recipe_config(cfg, recipe="lora", device_present=False)


@pytest.mark.parametrize("quantize_base", [False, True])
def test_a_lora_model_that_cannot_fit_the_devices_free_memory_is_refused_before_the_weights_load(
        monkeypatch, quantize_base):
    """The LoRA recipe builds the whole model on the device: a device without room for it is named by
    the model's size there (NF4 base weights counted as what they hold, not as the checkpoint's
    bf16), not met by an out-of-memory error part-way through the build."""
    # Layers wide enough for NF4's blocks (torchao quantises 64 elements a block, 256 blocks a scaler block).
    cfg, settings = _tiny_lora_settings(f"model.quantize_base={quantize_base}", "model.embed_dim=256",
                                        "model.intermediate_dim=512")
    with training.set_default_dtype(torch.bfloat16):
        model = config.instantiate(cfg.model)  # the same model, real, on the CPU
    tensors = [*model.parameters(), *model.buffers()]
    plain = sum(t.numel() for t in tensors) * 2
    need = sum(sum(getattr(t, n).nbytes for n in t.__tensor_flatten__()[0]) if isinstance(t, NF4Tensor)
               else t.nbytes for t in tensors)
    assert (need < plain * 0.9) == quantize_base  # NF4 holds about a quarter of bf16 in the base layers
    asked = []

    def free_of(device):
        asked.append(device)
        return free, 16 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", free_of)
    free = need
    check_lora_model_fits_device(cfg.model, settings)  # exactly fits
    free = need - 1
    what = "its base weights in NF4" if quantize_base else "in torch.bfloat16"
    advice = "a smaller model" if quantize_base else "with QLoRA, which keeps the base layers' weights in NF4"
    with pytest.raises(ValueError, match=re.escape(f"device=cuda: the model is {need / GIB:.2f} GiB ({what}, "
                                                   f"adapters included)") + ".*" + re.escape(advice)):
        check_lora_model_fits_device(cfg.model, settings)
    assert asked == [torch.device("cuda")] * 2
    _, on_cpu = _tiny_lora_settings("device=cpu")
    check_lora_model_fits_device(cfg.model, on_cpu)
    assert len(asked) == 2
