"""``compile: True`` with every engine mode: the tiny full recipe, each layer compiled as torchtune
compiles it, logs the losses and gradient norms of plain AdamW compiled the same way, to the bit,
and the engine adds no graph break and no graph.

Each run starts from a reset of dynamo (``torch._dynamo.reset()``): within one process dynamo
remembers the shapes a frame was called with and compiles the next run's first graphs for dynamic
shapes, whose kernels round differently, so only runs that each start afresh are comparable.
"""

from typing import Dict, List, Tuple

import pytest
import torch
from torch._dynamo.utils import counters

from tests.recipe.cpu_setup import cpu_recipe_setup
from tests.recipe.test_recipes import FULL_OFFLOAD, run_recipe

# Accumulation, a clip that bites at every step (the gradient norm is about 3), overlap's windows:
# where a forward wait inside a compiled layer changed the losses.
COMPILED = ["max_steps_per_epoch=4", "batch_size=4", "gradient_accumulation_steps=2", "clip_grad_norm=0.05",
            "compile=True"]
ADAMW8BIT = "optimizer.optimizer_class=torchtune_offload.AdamW8bit"
#: Each engine mode against the run whose losses it must log: plain AdamW, or AdamW8bit alone.
MODES: Dict[str, Tuple[str, List[str]]] = {
    "offload": ("plain", FULL_OFFLOAD),
    "offload_gradients": ("plain", [*FULL_OFFLOAD, "optimizer.offload_gradients=True"]),
    "overlap": ("plain", [*FULL_OFFLOAD, "optimizer.overlap=True"]),
    "offload_gradients, overlap": ("plain", [*FULL_OFFLOAD, "optimizer.offload_gradients=True",
                                             "optimizer.overlap=True"]),
    "offload_gradients, overlap, device sums": ("plain", [*FULL_OFFLOAD, "optimizer.offload_gradients=True",
                                                          "optimizer.overlap=True", "optimizer.grad_sum_on=device"]),
    "offload_gradients, overlap, hand-off per parameter": ("plain", [*FULL_OFFLOAD, "optimizer.offload_gradients=True",
                                                                     "optimizer.overlap=True",
                                                                     "optimizer.handoff=parameter"]),
    "update_on: device, overlap": ("plain", [*FULL_OFFLOAD, "optimizer.update_on=device", "optimizer.overlap=True"]),
    "fp32 masters, overlap": ("plain", [*FULL_OFFLOAD, "optimizer.master_dtype=fp32", "optimizer.overlap=True"]),
    "AdamW8bit base, offload_gradients, overlap": ("AdamW8bit", [*FULL_OFFLOAD, ADAMW8BIT,
                                                                 "optimizer.offload_gradients=True",
                                                                 "optimizer.overlap=True"]),
}
REFERENCES = {"plain": [], "AdamW8bit": ["optimizer._component_=torchtune_offload.AdamW8bit"]}

_cpu_setup = pytest.fixture(autouse=True, scope="module")(cpu_recipe_setup)


@pytest.fixture(scope="module")
def compiled_runs(tiny_assets, tmp_path_factory):
    """Memoised compiled runs by name: (losses, gradient norms, graph breaks, graphs compiled, the
    optimizer's name as the log gives it)."""
    cache: Dict[str, tuple] = {}

    def get(name: str, overrides: List[str]) -> tuple:
        if name not in cache:
            torch._dynamo.reset()
            counters.clear()
            run = run_recipe("full", tiny_assets, tmp_path_factory.mktemp("compiled"), *COMPILED, *overrides)
            cache[name] = ([float(x) for x in run.losses], [row["grad_norm"] for row in run.log],
                           sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                           run.recipe._optimizer.name)
        return cache[name]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_engine_logs_the_compiled_references_losses(compiled_runs, mode):
    reference, overrides = MODES[mode]
    ref_losses, ref_norms, ref_breaks, ref_graphs, _ = compiled_runs(reference, REFERENCES[reference])
    losses, norms, breaks, graphs, name = compiled_runs(mode, overrides)
    assert ("handoff=parameter" in name) == ("per parameter" in mode), name  # the run is the mode it names
    assert ref_breaks == 0 and ref_graphs > 0
    assert losses == ref_losses and norms == ref_norms
    # The forward waits run outside the compiled layers: no break, no extra graph.
    assert breaks == 0 and graphs == ref_graphs


def test_compiled_fp8_device_weights_add_no_graph_and_stay_near_the_eager_run(compiled_runs, tiny_assets, tmp_path):
    """FP8 device weights change the forward's math, so no other run logs their losses; compiled,
    they add no break or graph to the compiled layers, and their losses stay within float32
    rounding of the eager run's (compiled kernels round differently, as the engine does not)."""
    fp8 = [*FULL_OFFLOAD, "optimizer.offload_gradients=True", "optimizer.overlap=True", "optimizer.device_weights=fp8"]
    _, _, _, plain_graphs, _ = compiled_runs("plain", [])
    losses, _, breaks, graphs, _ = compiled_runs("fp8", fp8)
    assert breaks == 0 and graphs == plain_graphs
    eager = run_recipe("full", tiny_assets, tmp_path, *[o for o in COMPILED if o != "compile=True"], *fp8)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager.losses), rtol=1e-6, atol=0)
