"""The profile summary on a made-up trace whose every figure is known (a real CPU trace is read by
``tests/recipe/test_recipes.py``; device events come only from a GPU, so they are made up here)."""

import gzip
import json
import os
import runpy
from pathlib import Path

import pytest

from torchtune_offload.bench.trace_summary import find_trace, format_summary, summarize

REPO = Path(__file__).resolve().parents[2]
TRAIN, BACKWARD, HOST, GPU = (1, 100), (1, 300), (1, 200), (0, 7)
COPY_STREAM = (0, 20)
PYTHON = "(in no recorded op)"
#: Threads are named as the trace names them, with the engine range each spent longest in.
AUTOGRAD = "autograd [gradient hook]"


def _x(name, cat, thread, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "pid": thread[0], "tid": thread[1], "ts": ts, "dur": dur}


def _trace():
    """Two profiled steps of 1000 us each. In step 5 no kernel runs from 100 to 400 us (the thread
    that launches the kernels, as autograd's does on CUDA, is in the gradient hook, waiting on a
    stream from 200 on) and from 900 to 1000 us (in no op); in step 6 only from 1980 to 2000 us,
    shorter than the gap threshold. The training thread runs no op in either gap."""
    return {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 100, "args": {"name": "main"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 200, "args": {"name": "step worker"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 300, "args": {"name": "autograd"}},
        _x("ProfilerStep#5", "user_annotation", TRAIN, 0, 1000),
        _x("ProfilerStep#6", "user_annotation", TRAIN, 1000, 1000),
        _x("aten::mm", "cpu_op", TRAIN, 500, 20),
        _x("cudaLaunchKernel", "cuda_runtime", BACKWARD, 50, 5),
        _x("offload/gradient hook", "user_annotation", BACKWARD, 100, 300),
        _x("cudaStreamSynchronize", "cuda_runtime", BACKWARD, 200, 200),
        _x("cuLaunchKernelEx", "cuda_driver", BACKWARD, 480, 5),
        _x("gpu annotation", "gpu_user_annotation", GPU, 0, 2000),  # mirrored range, not work
        _x("cudaStreamSynchronize", "cuda_sync", GPU, 600, 10),  # on the device's row: not a host thread
        _x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", GPU, 0, 100),
        _x("vectorized_elementwise_kernel", "kernel", GPU, 400, 100),
        _x("nvjet_tst_128x256", "kernel", GPU, 500, 400),
        _x("nvjet_tst_128x256", "kernel", GPU, 1000, 980),
        _x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", COPY_STREAM, 150, 300),
        # Runs into step 6: what lies inside profiled steps counts, across both.
        _x("offload/host step", "user_annotation", HOST, 300, 1600),
        _x("offload/land", "user_annotation", HOST, 2500, 100),  # after the profiled steps
    ]}


def _write(path: Path, data, *, gz: bool) -> Path:
    if gz:
        with gzip.open(path, "wt") as f:
            json.dump(data, f)
    else:
        path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_every_figure_of_a_made_up_trace(tmp_path, gz):
    path = _write(tmp_path / ("t.json.gz" if gz else "t.json"), _trace(), gz=gz)
    summary = summarize(path, gap_ms=0.05)
    assert summary.steps == [(5, 0.001), (6, 0.001)]
    assert summary.span_s == pytest.approx(0.002)
    assert summary.training_thread == "main"
    assert summary.device_s == pytest.approx({
        "copies DtoH": 300e-6, "kernels: matmul and attention": 1480e-6, "kernels: other": 100e-6})
    assert summary.kernel_idle_s == pytest.approx(420e-6)  # 300 + 100 + 20
    assert summary.num_gaps == 2 and summary.gap_s == pytest.approx(400e-6)
    assert {(t, w): v for t, w, v in summary.idle_by_activity} == pytest.approx({
        ("main", PYTHON): 400e-6,
        (AUTOGRAD, "offload/gradient hook > cudaStreamSynchronize"): 200e-6,
        (AUTOGRAD, "offload/gradient hook"): 100e-6,
        (AUTOGRAD, PYTHON): 100e-6,
    })
    assert summary.idle_by_activity[0][:2] == ("main", PYTHON)  # longest first
    assert summary.longest_gaps == [
        pytest.approx((100e-6, 300e-6, f"main: {PYTHON}; {AUTOGRAD}: offload/gradient hook > cudaStreamSynchronize")),
        pytest.approx((900e-6, 100e-6, f"main: {PYTHON}; {AUTOGRAD}: {PYTHON}")),
    ]
    assert summary.ranges == {
        (AUTOGRAD, "offload/gradient hook"): (1, pytest.approx(300e-6)),
        ("step worker [host step]", "offload/host step"): (1, pytest.approx(1600e-6)),
    }

    text = format_summary(summary)
    assert "Profiled steps: #5 0.001 s, #6 0.001 s" in text
    assert "| kernels: matmul and attention | 0.0007 | 74.0% |" in text  # per step: 1480 / 2 us
    assert "| no kernel running | 0.0002 | 21.0% |" in text
    assert f"| {AUTOGRAD} | offload/gradient hook > cudaStreamSynchronize | 0.0001 |" in text
    assert "| step worker [host step] | offload/host step | 0.5 | 0.0008 |" in text


def test_without_step_markers_the_whole_trace_counts_and_the_launching_thread_trains(tmp_path):
    events = [e for e in _trace()["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    summary = summarize(_write(tmp_path / "t.json", {"traceEvents": events}, gz=False), gap_ms=0.05)
    assert summary.steps == [] and summary.span_s == pytest.approx(0.0026)  # from 0 to the last end
    assert summary.training_thread == AUTOGRAD  # the thread that called into CUDA most
    assert "No ProfilerStep markers" in format_summary(summary)


def test_a_folder_gives_its_newest_trace(tmp_path):
    old = _write(tmp_path / "a.pt.trace.json", _trace(), gz=False)
    (tmp_path / "iteration_9").mkdir()
    new = _write(tmp_path / "iteration_9" / "b.pt.trace.json.gz", _trace(), gz=True)
    os.utime(old, (1, 1))
    (tmp_path / "results.json").write_text("[]")  # a sweep's table, newer than the trace: not one
    assert find_trace(tmp_path) == new
    assert summarize(tmp_path).source == str(new)


def test_what_is_not_a_trace_is_refused_with_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="profiler.enabled=True"):
        summarize(tmp_path)
    with pytest.raises(ValueError, match="not a Chrome trace"):
        summarize(_write(tmp_path / "x.json", {"rows": []}, gz=False))
    with pytest.raises(ValueError, match="no events"):
        summarize(_write(tmp_path / "y.json", {"traceEvents": []}, gz=False))
    with pytest.raises(ValueError, match="gap_ms=-1"):
        summarize(tmp_path / "y.json", gap_ms=-1)


def test_the_script_prints_the_summary_and_refuses_a_path_without_a_trace(tmp_path, capsys):
    main = runpy.run_path(str(REPO / "scripts" / "profile_summary.py"), run_name="profile_summary")["main"]
    _write(tmp_path / "t.pt.trace.json", _trace(), gz=False)
    main([str(tmp_path), "--gap-ms", "0.05", "--longest", "1"])
    out = capsys.readouterr().out
    assert "| offload/gradient hook > cudaStreamSynchronize | 0.0001 |" in out
    assert out.count("| 0.0001 | 0.0003 |") == 1 and "| 0.0009 | 0.0001 |" not in out  # the longest gap only
    with pytest.raises(SystemExit, match="no profiler trace"):
        main([str(tmp_path / "missing")])


def test_ranges_that_overlap_without_nesting_and_repeated_step_numbers_are_read(tmp_path):
    """Clock rounding can start a child before its parent; a cycle restarted can repeat a step number."""
    events = [
        _x("ProfilerStep#3", "user_annotation", TRAIN, 0, 100),
        _x("ProfilerStep#3", "user_annotation", TRAIN, 100, 100),
        _x("aten::add_", "cpu_op", TRAIN, 9, 11),  # starts 1 us before the range it belongs in
        _x("offload/host step", "user_annotation", TRAIN, 10, 60),
        _x("elementwise_kernel", "kernel", GPU, 0, 5),
    ]
    summary = summarize(_write(tmp_path / "t.json", {"traceEvents": events}, gz=False), gap_ms=0.001)
    assert summary.steps == [(3, 0.0001), (3, 0.0001)]
    # 5-9 no op, 9-10 the add alone, 10-70 the host step (the add's rest inside it), 70-200 no op.
    assert dict((w, v) for _, w, v in summary.idle_by_activity) == pytest.approx(
        {PYTHON: 134e-6, "aten::add_": 1e-6, "offload/host step": 60e-6})


def test_a_trace_without_host_events_is_refused(tmp_path):
    events = [_x("elementwise_kernel", "kernel", GPU, 0, 5)]
    with pytest.raises(ValueError, match="no host events"):
        summarize(_write(tmp_path / "t.json", {"traceEvents": events}, gz=False))
