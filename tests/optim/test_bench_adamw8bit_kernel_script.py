"""scripts/bench/bench_adamw8bit_kernel.py times the fused 8-bit pass and its ablations beside torch's fused bf16
AdamW."""

import re
import runpy
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.recipe_harness import working_tree_env
from torchtune_offload.optim import adamw8bit, fused_step

REPO = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(REPO / "scripts" / "bench" / "bench_adamw8bit_kernel.py"),
                        run_name="bench_adamw8bit_kernel")


def test_every_ablation_still_finds_its_text_in_the_pass():
    source = adamw8bit.SOURCE.read_text()
    for replacements in SCRIPT["ABLATIONS"].values():
        ablated = SCRIPT["ablated_source"](source, replacements)
        assert (ablated == source) == (not replacements)


def test_a_text_the_pass_lost_stops_the_script_by_name():
    with pytest.raises(SystemExit, match="update ABLATIONS"):
        SCRIPT["ablated_source"]("int main(void) { return 0; }", [("quantize_block_avx512(m", "")])


needs_cc = pytest.mark.skipif(fused_step.c_compiler() is None, reason="needs a C compiler")


@pytest.fixture
def avx512_path(tmp_path):
    """Skips where the pass's AVX-512 path, which the ablations edit, does not build (no AVX-512 with
    VBMI): the script stops there by design (the next test), and --builds times what does build."""
    try:
        SCRIPT["build"](adamw8bit.SOURCE.read_text(), str(tmp_path), "probe")
    except SystemExit as stop:
        pytest.skip(f"the AVX-512 path does not build on this CPU: {stop}")


@needs_cc
def test_without_the_avx512_path_the_script_stops_by_name_and_points_to_builds(tmp_path, monkeypatch):
    # As on a CPU without AVX-512: -march=native then enables none of it.
    build_library = fused_step.build_library
    monkeypatch.setattr(fused_step, "build_library",
                        lambda source, *, flags=(): build_library(source, flags=(*flags, "-mno-avx512f")))
    with pytest.raises(SystemExit, match="AVX-512 path does not build here .*nothing to take apart; --builds"):
        SCRIPT["build"](adamw8bit.SOURCE.read_text(), str(tmp_path), "probe")


@needs_cc
def test_script_prints_the_pass_its_ablations_and_torch_in_one_table(avx512_path):
    out = zygote.run_script("bench/bench_adamw8bit_kernel.py", "--params", "65536", "--rounds", "10")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 1 thread, torch .+; 0\.1M bf16 parameters in one tensor; median of 10 rounds$",
                     out.stdout, flags=re.M)
    rows = dict(re.findall(r"^\| ([^|]+?) \| (\d+) \| [0-9.]+ \| [0-9.]+x \|$", out.stdout, flags=re.M))
    assert list(rows) == ["torch fused AdamW, bf16 states", *SCRIPT["ABLATIONS"]]
    assert all(int(rate) > 0 for rate in rows.values())
    instructions = re.findall(r"^\| (v[^|]+?) \| [0-9.]+ \| [0-9.]+ \|$", out.stdout, flags=re.M)
    assert instructions == list(SCRIPT["INSTRUCTIONS"]) or "instruction table: n/a" in out.stdout


@needs_cc
def test_builds_mode_times_the_pass_as_each_instruction_set_builds_it():
    cmd = [sys.executable, "scripts/bench/bench_adamw8bit_kernel.py", "--params", "65536", "--rounds", "10", "--builds"]
    env = working_tree_env(ATEN_CPU_CAPABILITY="default")  # torch's step as a CPU without AVX2 runs it
    out = zygote.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 1 thread, torch .+ \(DEFAULT kernels\); 0\.1M bf16 parameters", out.stdout, flags=re.M)
    timed = re.findall(r"^\| ([^|]+?) \| (\d+) \| [0-9.]+ \| [0-9.]+x \|$", out.stdout, flags=re.M)
    missing = re.findall(r"^\| ([^|]+?) \| n/a: it does not build here", out.stdout, flags=re.M)
    assert [name for name, _ in timed][0] == "torch fused AdamW, bf16 states"
    assert sorted([name for name, _ in timed][1:] + missing) == sorted(SCRIPT["BUILDS"])
    assert "the pass, built for this CPU" in dict(timed) and all(int(rate) > 0 for _, rate in timed)
    assert "instruction" not in out.stdout
