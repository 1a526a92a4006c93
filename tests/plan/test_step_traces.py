"""The plan's distinct training steps, traced side by side in forked workers: the same traces as
one process traces, each step once, and a step that fails in a worker left to the plan."""

import dataclasses
import json
import os
import re
import runpy
import sys
import time

from omegaconf import OmegaConf

from tests import zygote
from tests.plan.test_planner import CONFIG, REPO
from tests.recipe_harness import tiny_asset_overrides, working_tree_env
from torchtune_offload.plan.planner import step_requests
import torchtune_offload.plan.step_traces as step_traces
from torchtune_offload.plan.step_traces import StepRequest, trace_steps

VARIANTS = ["config", "adamw", "offload", "offload_grads", "offload_grads_overlap"]


def _requests(tiny_assets, tmp_path):
    overrides = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda"]
    return step_requests(CONFIG, overrides, VARIANTS, recipe="full", seq_len=None, with_fine_tunes=True)


def _figures(trace):
    # How long it took is all that may differ.
    without = trace.without_optimizer and dataclasses.replace(trace.without_optimizer, seconds=0.0)
    return dataclasses.replace(trace, seconds=0.0, without_optimizer=without)


def test_workers_trace_each_distinct_step_once_as_one_process_would(tiny_assets, tmp_path):
    requests = _requests(tiny_assets, tmp_path)
    keys = {r.key for r in requests}
    # Five variants and two more fine-tunes (LoRA, QLoRA) share five steps: gradients kept with
    # torch's AdamW stepping, kept without a traced optimizer, freed; and the two adapters'.
    assert len(requests) == len(VARIANTS) + 2 and len(keys) == 5
    traces = {}
    # The tiny QLoRA model cannot be built (too few weights to quantise): the plan says so, the
    # workers leave it out.
    qlora = next(r.key for r in requests if r.cfg.model.get("quantize_base"))
    assert trace_steps(requests, traces, jobs=2) == len(keys) - 1
    assert traces.keys() == keys - {qlora}
    for request in {r.key: r for r in requests if r.key != qlora}.values():
        assert _figures(traces[request.key]) == _figures(request.trace())
    assert trace_steps(requests, traces, jobs=2) == 0  # the rest in the cache already, and one left


def _log_workers(monkeypatch, path):
    """Has each forked worker write its step's key to ``path`` first; returns a reader of them."""
    worker = step_traces._trace_in_worker

    def logging_worker(request, conn):
        with open(path, "a") as f:
            f.write(repr(request.key) + "\n")
        worker(request, conn)

    monkeypatch.setattr(step_traces, "_trace_in_worker", logging_worker)
    return lambda: path.read_text().splitlines()


def test_the_step_without_an_optimizer_comes_with_the_step_with_it(tiny_assets, tmp_path, monkeypatch):
    """Gradients kept with torch's AdamW stepping, and kept without a traced optimizer (the
    offload variant): one worker traces the first and gives both."""
    requests = [r for r in _requests(tiny_assets, tmp_path) if not r.cfg.model.get("quantize_base")]
    with_adamw = next(r for r in requests if r.key_without_optimizer is not None)
    without = next(r for r in requests if r.key == with_adamw.key_without_optimizer)
    sent = _log_workers(monkeypatch, tmp_path / "sent")
    traces = {}
    assert trace_steps(requests, traces, jobs=2) == len({r.key for r in requests}) == 4
    assert repr(without.key) not in sent()
    assert _figures(traces[without.key]) == _figures(without.trace())


def test_a_step_two_failed_steps_were_to_give_is_traced_once(tiny_assets, tmp_path, monkeypatch):
    """Two steps with an optimizer (other options) share the step without it: where neither gives
    it, it is traced on its own, once."""
    requests = [r for r in _requests(tiny_assets, tmp_path) if not r.cfg.model.get("quantize_base")]
    with_adamw = next(r for r in requests if r.key_without_optimizer is not None)

    class Broken(StepRequest):
        def traces(self):
            raise RuntimeError("untraceable")

    fields = {f.name: getattr(with_adamw, f.name) for f in dataclasses.fields(StepRequest)}
    broken = [Broken(**{**fields, "key": with_adamw.key + (n,)}) for n in range(2)]
    sent = _log_workers(monkeypatch, tmp_path / "sent")
    others = [r for r in requests if r.key != with_adamw.key]
    traces = {}
    assert trace_steps([*broken, *others], traces, jobs=2) == len({r.key for r in others})
    assert sent().count(repr(with_adamw.key_without_optimizer)) == 1


def test_one_job_traces_nothing_ahead_and_a_failed_step_is_left_to_the_plan(tiny_assets, tmp_path):
    requests = _requests(tiny_assets, tmp_path)
    traces = {}
    assert trace_steps(requests, traces, jobs=1) == 0 and not traces

    class Broken(StepRequest):
        def trace(self):
            raise RuntimeError("untraceable")

    broken = Broken(**{f.name: getattr(requests[0], f.name) for f in dataclasses.fields(StepRequest)})
    others = [r for r in requests if r.key != broken.key and not r.cfg.model.get("quantize_base")]
    traced = trace_steps([broken, *others], traces, jobs=2)
    assert broken.key not in traces and traced == len({r.key for r in others}) == len(traces) == 3


def _plan(tiny_assets, tmp_path, jobs):
    out = tmp_path / f"plan-{jobs}.json"
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", CONFIG, "--force", "--json",
                       str(out),
                       "--jobs", jobs, *tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
                       "--device-gib", "1", "--host-gib", "64"],
                      cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True, text=True,
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every distinct step but one: the tiny QLoRA model cannot be built (the plan says so in its row).
    counts = re.search(r"traced (\d+) of (\d+) in workers", proc.stderr)
    assert (counts is not None) is (jobs == "2")
    if counts:
        assert int(counts[1]) == int(counts[2]) - 1 >= 4
    plans = json.loads(out.read_text())
    return {p["name"]: (p["device_bytes"], p["device_parts"], p["problem"]) for p in plans["plans"] + plans["fine_tunes"]}


def test_the_cli_plans_the_same_with_one_job_or_two(tiny_assets, tmp_path):
    one, two = _plan(tiny_assets, tmp_path, "1"), _plan(tiny_assets, tmp_path, "2")
    assert one == two and len(one) == 20  # 17 variants and the 3 fine-tunes


def test_jobs_below_one_are_refused(tmp_path):
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", CONFIG, "--jobs", "0"],
                      cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--jobs 0: must be at least 1" in proc.stderr


def test_a_worker_that_gives_no_result_in_time_is_stopped_and_the_rest_left_to_the_plan(tiny_assets, tmp_path,
                                                                                       capsys):
    requests = [r for r in _requests(tiny_assets, tmp_path) if not r.cfg.model.get("quantize_base")]

    class Stuck(StepRequest):
        def trace(self):
            time.sleep(120)

    stuck = Stuck(**{f.name: getattr(requests[0], f.name) for f in dataclasses.fields(StepRequest)})
    traces = {}
    start = time.perf_counter()
    trace_steps([stuck, *[r for r in requests if r.key != stuck.key]], traces, jobs=2, timeout_s=5)
    assert time.perf_counter() - start < 60  # the stuck worker was stopped, not waited for
    assert stuck.key not in traces
    assert "took more than 5 s in a worker; it is traced in this process" in capsys.readouterr().err


def test_a_worker_that_dies_is_seen_at_once(tiny_assets, tmp_path):
    requests = [r for r in _requests(tiny_assets, tmp_path) if not r.cfg.model.get("quantize_base")]

    class Dies(StepRequest):
        def trace(self):
            os._exit(9)  # as an out-of-memory kill would end it: nothing sent

    dies = Dies(**{f.name: getattr(requests[0], f.name) for f in dataclasses.fields(StepRequest)})
    traces = {}
    start = time.perf_counter()
    traced = trace_steps([dies, *[r for r in requests if r.key != dies.key]], traces, jobs=2, timeout_s=200)
    assert time.perf_counter() - start < 60 and dies.key not in traces and traced == len(traces) == 3


def test_the_layers_check_sees_the_plans_steps(capsys, monkeypatch):
    """scripts/plan_layers_check.py replaces the tracer the plan's steps call: it must see them."""
    monkeypatch.setattr(step_traces, "trace_training_step", step_traces.trace_training_step)  # put back after
    main = runpy.run_path(str(REPO / "scripts" / "plan_layers_check.py"), run_name="plan_layers_check")["main"]
    assert main([CONFIG]) == 0
    # Gradients kept; freed per parameter (in-backward steps, torchao's offloader); freed per layer
    # (the engine's hand-off groups); and one step without its optimizer.
    out = capsys.readouterr().out
    assert "4 steps, 0 differ" in out and "free_gradients=per group" in out


def test_the_layers_check_checks_a_step_derived_without_its_optimizer(capsys, monkeypatch, tmp_path):
    """On a GPU config torch's AdamW steps on the device and the plan takes the steps without a
    traced optimizer from its trace: the check traces those whole too."""
    monkeypatch.setattr(step_traces, "trace_training_step", step_traces.trace_training_step)  # put back after
    config = tmp_path / "full.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.merge(OmegaConf.load(REPO / CONFIG), {"device": "cuda"})))
    main = runpy.run_path(str(REPO / "scripts" / "plan_layers_check.py"), run_name="plan_layers_check")["main"]
    assert main([str(config)]) == 0
    out = capsys.readouterr().out
    assert "optimizer step=derived without it" in out and re.search(r"\d+ steps, 0 differ", out)
