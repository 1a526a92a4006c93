"""Will it fit? ``python -m torchtune_offload.plan --config <yaml> [key=value ...]`` predicts the peak
device and host memory of a run for each optimizer variant, from one training step traced on fake
tensors and the recipes' own host-memory calculation."""

from torchtune_offload.plan.planner import VariantPlan, format_plans, plan_variant
from torchtune_offload.plan.trace import StepTrace, trace_training_step

__all__ = ["StepTrace", "VariantPlan", "format_plans", "plan_variant", "trace_training_step"]
