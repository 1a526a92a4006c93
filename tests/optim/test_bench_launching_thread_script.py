"""scripts/bench/bench_launching_thread.py: every mode side by side with plain AdamW, in one table."""

import importlib.util
import json
import re
import threading

import pytest
import torch

from tests import zygote
from tests.recipe_harness import REPO
from torchtune_offload.models.narrow import checkpointed_llama
from torchtune_offload.optim import fp8_weights


def test_prints_each_mode_against_plain_adamw_with_ops_and_handoffs(tmp_path):
    out = zygote.run_script("bench/bench_launching_thread.py", "--model", "1B", "--rounds", "2", "--steps", "1",
                            "--accum", "2", "--modes", "overlap,torchao",
                            "--per-parameter", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 1 intra-op thread, torch .+; llama3_2 1B at width 64, bf16, activation checkpointing, "
                     r"eager; 2 micro-batches of 1 x 16 tokens a step, clip 1.0; optimizers as on a GPU machine "
                     r"\(plain AdamW foreach, the engine's host AdamW fused\); 2 interleaved rounds", out.stdout,
                     flags=re.M)
    rows = dict(re.findall(r"^\| ([^|]+) \| ([0-9.]+) \| ", out.stdout, flags=re.M))
    assert set(rows) == {"plain AdamW", "offload_gradients, overlap", "offload_gradients, overlap, hand-off per parameter"}
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results["plain AdamW"]["ratio"] == 1.0 and len(results["plain AdamW"]["ratios"]) == 2
    assert results["plain AdamW"]["handoffs"] is None and results["plain AdamW"]["ops"] > 1000
    # llama3_2 1B: 16 layers and the embedding (tied to the output) and the final norm, two backwards
    # a step; per parameter, each of its 146 tensors (the output shares the embedding's) once a backward.
    assert 2 * 16 < results["offload_gradients, overlap"]["handoffs"] <= 2 * (16 + 4)
    assert results["offload_gradients, overlap, hand-off per parameter"]["handoffs"] == 2 * 146
    # The hook is called once a gradient either way; the table gives both counts.
    assert results["plain AdamW"]["hook_calls"] is None
    for name in ("offload_gradients, overlap", "offload_gradients, overlap, hand-off per parameter"):
        assert results[name]["hook_calls"] == 2 * 146, name
        assert re.search(rf"^\| {name} \|.* \| {2 * 146} \| {results[name]['handoffs']} \|$", out.stdout, flags=re.M)
    # torchao's wrapper runs on CUDA and XPU only: named, with the reason, not dropped.
    assert re.search(r"^\| torchao's CPUOffloadOptimizer \| does not run here: .*CUDA", out.stdout, flags=re.M)


@pytest.mark.parametrize("args, message", [
    (["--modes", "overlap,fast"], "--modes: unknown fast; choose from host-ring, device-sums, overlap"),
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--cpu-defaults", "--device", "cuda"], "--cpu-defaults: only with --device cpu"),
])
def test_bad_arguments_are_refused_naming_the_fix(args, message):
    out = zygote.run_script("bench/bench_launching_thread.py", *args)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.parametrize("cpu_defaults", [False, True])
def test_optimizers_are_built_as_on_a_gpu_machine_unless_asked_for_the_cpus_defaults(cpu_defaults):
    """As on a GPU machine: plain AdamW's multi-tensor loop and the engine's host AdamW on the fused
    kernel (AdamW8bit keeps its own step); with ``--cpu-defaults`` torch's and the engine's CPU choices."""
    script = _script()
    base = checkpointed_llama("1B", width=64, max_seq_len=16)
    made = {key: script.Trainee(key, base, accum=1, compiled=False, device=torch.device("cpu"),
                                cpu_defaults=cpu_defaults) for key in (script.PLAIN, "host-ring", "8bit")}
    try:
        assert made[script.PLAIN].run.optimizer.param_groups[0]["foreach"] is (None if cpu_defaults else True)
        slot = made["host-ring"].run.optimizer._table.offloaded[0]
        assert slot.optimizer.param_groups[0]["fused"] is (None if cpu_defaults else True)
        assert "fused" not in made["8bit"].run.optimizer._table.offloaded[0].optimizer.param_groups[0]
    finally:
        for trainee in made.values():
            trainee.close()


def _script():
    spec = importlib.util.spec_from_file_location("bench_launching_thread",
                                                  REPO / "scripts/bench/bench_launching_thread.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compiled", [False, True])
def test_design_functions_are_timed_on_any_thread_and_put_back_after(compiled):
    script = _script()
    originals = {name: getattr(owner, name) for owner, name, _ in script.DESIGN_FUNCTIONS}
    spans = []
    q, scale = fp8_weights.quantize(torch.randn(4, 8), per_row=True)
    with script._design_functions_timed(spans, compiled=compiled):
        # A compiled layer traces the widening into its graph: it stays unwrapped (a wrapped
        # global would make dynamo recompile), the quantization after the host step is timed.
        assert (fp8_weights.dequantize is originals["dequantize"]) == compiled
        assert fp8_weights.DeviceWeights._quantize is not originals["_quantize"]
        widened = []
        worker = threading.Thread(target=lambda: widened.append(fp8_weights.dequantize(q, scale, torch.bfloat16)))
        worker.start()
        worker.join()
    assert torch.equal(widened[0], originals["dequantize"](q, scale, torch.bfloat16))
    assert len(spans) == (0 if compiled else 1) and all(s >= 0 for s in spans)
    assert {name: getattr(owner, name) for owner, name, _ in script.DESIGN_FUNCTIONS} == originals
