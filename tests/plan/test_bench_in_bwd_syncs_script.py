"""scripts/bench/bench_in_bwd_syncs.py counts bitsandbytes' device synchronizations, which the speed model
counts as ``StepWork.device_syncs`` (plan/speed.py: ``bitsandbytes_syncs_per_step``). If bitsandbytes
stops synchronizing after each parameter, this fails and the model's term must be looked at again."""

import re

from tests import zygote
from torchtune_offload.plan.recorded_runs import LLAMA3_1_8B, LLAMA3_2_1B, TENSORS
from torchtune_offload.plan.speed import bitsandbytes_syncs_per_step


def test_in_backward_steps_synchronize_twice_a_parameter_inside_backward():
    out = zygote.run_script("bench/bench_in_bwd_syncs.py", "--models", "1B,8B", "--steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, torch .+, bitsandbytes [0-9.]+; PagedAdamW8bit", out.stdout, flags=re.M)
    rows = re.findall(r"^\| (llama[0-9_]+ [0-9]+B) \| ([0-9]+) \| ([0-9]+) \| ([0-9]+) \| ([0-9]+) \|$", out.stdout,
                      flags=re.M)
    # 1B: 16 layers of 9 tensors, the tied embedding and the final norm; 8B: 32 layers, and an output.
    assert [(r[0], int(r[1])) for r in rows] == [("llama3_2 1B", 146), ("llama3_1 8B", 291)]
    # The calibration's recorded runs count the same tensors.
    assert [TENSORS[LLAMA3_2_1B], TENSORS[LLAMA3_1_8B]] == [146, 291]
    for _, tensors, in_backward, after, host_us in rows:
        # One per parameter's update, and one more per step() of a paged optimizer: every parameter's own.
        assert int(in_backward) == 2 * int(tensors)
        assert int(after) == int(tensors) + 1
        # The speed model's count is bitsandbytes' own.
        assert int(in_backward) == bitsandbytes_syncs_per_step(tensors=int(tensors), paged=True, in_backward=True)
        assert int(after) == bitsandbytes_syncs_per_step(tensors=int(tensors), paged=True, in_backward=False)
        assert int(host_us) > 0


def test_an_unknown_model_is_refused_naming_the_choices():
    out = zygote.run_script("bench/bench_in_bwd_syncs.py", "--models", "70B")
    assert out.returncode == 2 and "--models: unknown 70B; use some of 1B, 3B, 8B" in out.stderr
