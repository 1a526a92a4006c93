"""The golden-loss runs, replayed in a child process whose CPU kernels are pinned.

``golden_losses.json`` holds the losses and gradient norms that nine representative recipe runs
log; ``tests/recipe/test_golden_losses.py`` replays them and requires the same numbers, bit for bit.
torch, MKL and oneDNN each pick their kernels for the CPU they find when they load, and a 16-lane
AVX-512 reduction adds in another order than an 8-lane AVX2 one: losses recorded on an AVX-512 CPU
differ in the last bits on an AVX2-only one. So the recording and every replay run in a fresh
process with ``PINNED_ENV`` in its environment, read by these libraries before their first use:

- ``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorised kernels take their AVX2 build, which any
  x86-64 CPU with AVX2 runs (Intel since Haswell, AMD since Excavator), with or without AVX-512.
- ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility on its SSE2 branch, the one
  branch MKL keeps alike on Intel and AMD CPUs (its others are Intel's only; an AMD CPU gets a
  branch of its own). ``MKL_ENABLE_INSTRUCTIONS=AVX2`` is not enough: MKL ignores it on AMD, and
  on an Intel CPU its AVX2 matmuls differ from those MKL runs on AMD (measured with one MKL build,
  2024.0 Update 2, on the Zen 4 of the recording and on an Intel Xeon with AVX-512 and AMX: 14 of
  18 of these runs' matmul shapes gave other bits with it, none with ``MKL_CBWR=COMPATIBLE``).
  These runs' matmuls are tiny: at about twice the time a call on the SSE2 branch, they take a
  second or two longer in all.
- ``MKL_DYNAMIC=FALSE``: MKL keeps the thread count it is given (Intel's condition for results
  that repeat on other machines); two threads, as recorded, since a reduction may split
  differently on another count.
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels (these fp32 runs use none today; a bf16 run would).

And the runs' AdamW is torch's fused CPU step (``FUSED`` below): its square roots are the vector
unit's, correctly rounded everywhere, where torch.sqrt goes to MKL's vector math, whose bits
follow the CPU even under ``MKL_CBWR=COMPATIBLE``.

Checked beyond the recording's CPU: ``scripts/golden_on_emulated_cpus.sh`` replays every run under
QEMU emulating AVX2-only CPUs (an Intel Haswell and an AMD EPYC-Milan: cpuid without AVX-512, so
torch, MKL and oneDNN choose as on such a desktop). With torch.sqrt in the step, 12 of the 13
replays differed from step 2 or later, the first differing operation being ``aten.sqrt`` in
AdamW (found by hashing every operator's output, natively and emulated); with the fused step all
13 are bit-identical. What is left to chance: QEMU computes approximate instructions (rcpps,
rsqrtps) exactly, as no real CPU does, so real AVX2 silicon has not confirmed it; a kernel with such
an instruction, or an MKL that breaks its promise, would show here first.

Record anew only when a change is meant to alter the numbers, and say so in its commit:

    python -m tests.recipe.golden_runs --record

The test's child (not for direct use): ``python -m tests.recipe.golden_runs --replay ASSETS OUT_JSON CASE...``
with ``CASE`` a run's name, ``+overlap`` appended for its overlapped replay.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from omegaconf import OmegaConf

from tests.recipe_harness import REPO, load_recipe_module, tiny_asset_overrides, working_tree_env
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.recipe import read_disk_log

RECORDING_PATH = Path(__file__).with_name("golden_losses.json")
#: The environment of the recording and of every replay, whatever CPU runs them (why: above).
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "MKL_DYNAMIC": "FALSE",
              "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: What ``torch.backends.cpu.get_cpu_capability()`` reports where the pinning took: a CPU without
#: AVX2 falls back to torch's default kernels and cannot replay the recording.
PINNED_CAPABILITY = "AVX2"
THREADS = 2

OFFLOAD = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW"]
#: torch's fused CPU AdamW takes its square roots with the vector unit's sqrt, which rounds
#: correctly on every CPU. Its per-parameter path calls torch.sqrt, which this torch build hands to
#: MKL's vector math library: not correctly rounded, and its bits follow the branch MKL takes for
#: the CPU (with MKL_CBWR=COMPATIBLE too). Under QEMU emulating an AVX2-only Haswell or EPYC-Milan,
#: 12 of the 13 replays then differed from the Zen 4 recording from the first optimizer step, the
#: first differing operation being aten.sqrt; with the fused step all matched.
FUSED = ["optimizer.fused=True"]
FULL = ["max_steps_per_epoch=5", "batch_size=4", "gradient_accumulation_steps=3", "clip_grad_norm=0.5", *FUSED]
LORA = ["max_steps_per_epoch=12", "batch_size=4", "gradient_accumulation_steps=2", "clip_grad_norm=0.5", *FUSED]
#: Each run: its recipe kind and its overrides of the tiny config.
RUNS: Dict[str, Tuple[str, List[str]]] = {
    "full_adamw": ("full", FULL),
    "full_offload": ("full", FULL + OFFLOAD + ["optimizer.minimal_size=1024"]),
    "full_offload_grads": ("full", FULL + OFFLOAD + ["optimizer.minimal_size=1024", "optimizer.offload_gradients=True"]),
    "full_in_bwd": ("full", ["max_steps_per_epoch=5", "batch_size=4", "optimizer_in_bwd=True", "clip_grad_norm=null",
                             *FUSED]),
    "full_resume_2ep": ("full", ["epochs=2", "max_steps_per_epoch=4", "batch_size=4", "gradient_accumulation_steps=2",
                                 "clip_grad_norm=0.5", *OFFLOAD, "optimizer.minimal_size=1024", *FUSED]),
    "lora_adamw": ("lora", LORA),
    "lora_offload": ("lora", LORA + OFFLOAD + ["optimizer.minimal_size=256"]),
    "lora_offload_grads": ("lora", LORA + OFFLOAD + ["optimizer.minimal_size=256", "optimizer.offload_gradients=True"]),
    "dist_1proc": ("distributed", ["max_steps_per_epoch=3", "epochs=2", "gradient_accumulation_steps=2",
                                   "clip_grad_norm=1.0", "batch_size=8", "fsdp_shard_policy=[layers,embeddings]",
                                   "enable_activation_checkpointing=True", *FUSED]),
}
#: Overlapped host steps run the same operations at other moments: the serial runs' recordings hold.
OVERLAPPED = ("full_offload", "full_offload_grads", "full_resume_2ep", "lora_offload_grads")
RECIPES = {
    "full": ("full_finetune_single_device", "FullFinetuneRecipeSingleDevice", "full.yaml"),
    "lora": ("lora_finetune_single_device", "LoRAFinetuneRecipeSingleDevice", "lora.yaml"),
    "distributed": ("full_finetune_distributed", "FullFinetuneRecipeDistributed", "full_distributed.yaml"),
}
_OVERLAP_SUFFIX = "+overlap"


def case_id(name: str, overlap: bool) -> str:
    """The name a replay's result goes under: the run's, with ``+overlap`` for its overlapped replay."""
    return name + _OVERLAP_SUFFIX if overlap else name


def _replay_here(case: str, assets: Path, output_dir: Path) -> List[Dict[str, float]]:
    """One run in this process: the loss and grad_norm of each logged step."""
    name = case.removesuffix(_OVERLAP_SUFFIX)
    kind, overrides = RUNS[name]
    if case != name:
        overrides = [*overrides, "optimizer.overlap=True"]
    module, cls, config = RECIPES[kind]
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO / "configs" / "tiny" / config),
        OmegaConf.from_dotlist([f"output_dir={output_dir}", *tiny_asset_overrides(assets), *overrides]),
    )
    recipe = getattr(load_recipe_module(module), cls)(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()
    return [{k: row[k] for k in ("loss", "grad_norm") if k in row} for row in read_disk_log(output_dir)]


def _replay_child(assets: Path, out: Path, cases: Sequence[str]) -> None:
    """The child's work: every case, one after another; a failing case records its traceback."""
    torch.set_num_threads(THREADS)
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="golden_runs_") as work:
        for i, case in enumerate(cases):
            try:
                results[case] = {"rows": _replay_here(case, assets, Path(work) / str(i))}
            except Exception:
                results[case] = {"error": traceback.format_exc()}
    replay = {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "runs": results}
    out.write_text(json.dumps(replay, indent=1))


def replay_pinned(cases: Sequence[str], assets: Path, out: Path) -> Dict[str, Any]:
    """Replays ``cases`` in a child process with ``PINNED_ENV`` in its environment.

    Args:
        cases: run names, each as :func:`case_id` gives it.
        assets: the tiny assets (``python -m torchtune_offload.assets --output-dir``).
        out: where the child writes what it replayed (JSON).

    Returns:
        ``{"capability": the kernels torch ran, "torch": its version, "runs": {case: {"rows": [...]}
        or {"error": traceback}}}``.

    Raises:
        RuntimeError: if the child itself fails (it records a failing run and goes on).
    """
    env = working_tree_env(TIKTOKEN_CACHE_DIR="", **PINNED_ENV)
    cmd = [sys.executable, "-m", "tests.recipe.golden_runs", "--replay", str(assets), str(out), *cases]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the golden-run child failed (exit {done.returncode}):\n{done.stderr[-5000:]}")
    return json.loads(out.read_text())


def _record() -> None:
    """Replays every serial run pinned, on fresh tiny assets, and writes golden_losses.json."""
    with tempfile.TemporaryDirectory(prefix="golden_record_") as work:
        assets = Path(work) / "assets"
        subprocess.run([sys.executable, "-m", "torchtune_offload.assets", "--output-dir", str(assets)], cwd=REPO,
                       env=working_tree_env(TIKTOKEN_CACHE_DIR=""), check=True, capture_output=True)
        replay = replay_pinned(list(RUNS), assets, Path(work) / "replay.json")
    failed = {case: r["error"] for case, r in replay["runs"].items() if "error" in r}
    if failed:
        raise SystemExit("not recorded; these runs failed:\n" + "\n".join(f"{k}:\n{v}" for k, v in failed.items()))
    if replay["capability"] != PINNED_CAPABILITY:
        raise SystemExit(f"not recorded: torch ran its {replay['capability']} kernels, not {PINNED_CAPABILITY} "
                         "(this CPU has no AVX2)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    recording = {
        "recorded_from": f"{commit.stdout.strip() or 'unknown commit'} (and its working tree), torch "
                         f"{replay['torch']}, {THREADS} threads, the environment in pinned_env, on {cpu_name()} "
                         f"(torch's own choice of kernels there: {torch.backends.cpu.get_cpu_capability()})",
        "torch": replay["torch"],
        "pinned_env": PINNED_ENV,
        # Strings: the exact decimal form of each float, as Python prints it.
        "runs": {name: [{k: repr(v) for k, v in row.items()} for row in replay["runs"][name]["rows"]] for name in RUNS},
    }
    RECORDING_PATH.write_text(json.dumps(recording, indent=1) + "\n")
    print(f"wrote {RECORDING_PATH.relative_to(REPO)}: {recording['recorded_from']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help="record golden_losses.json anew")
    mode.add_argument("--replay", nargs="+", metavar="ARG", help="ASSETS OUT_JSON CASE...: the test's child")
    args = parser.parse_args()
    if args.record:
        _record()
        return
    if len(args.replay) < 3:
        parser.error("--replay takes ASSETS OUT_JSON and at least one CASE")
    assets, out, *cases = args.replay
    unknown = [c for c in cases if c.removesuffix(_OVERLAP_SUFFIX) not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {sorted(RUNS)}")
    _replay_child(Path(assets), Path(out), cases)


if __name__ == "__main__":
    main()
