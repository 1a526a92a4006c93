"""Will it fit? ``python -m torchtune_offload.plan --config <yaml> [key=value ...]`` predicts the peak
device and host memory of a run for each optimizer variant, from one training step traced on fake
tensors and the recipes' own host-memory calculation; with ``--machine``, each variant's seconds per
step and tok/s from the same step's work and a machine's rates (:mod:`torchtune_offload.plan.speed`)."""

from torchtune_offload.plan.planner import VariantPlan, plan_speed, plan_variant
from torchtune_offload.plan.report import format_plans
from torchtune_offload.plan.speed import Machine, Speed, StepWork, load_machine, predict
from torchtune_offload.plan.trace import StepTrace, trace_training_step

__all__ = ["Machine", "Speed", "StepTrace", "StepWork", "VariantPlan", "format_plans", "load_machine", "plan_speed",
           "plan_variant", "predict", "trace_training_step"]
