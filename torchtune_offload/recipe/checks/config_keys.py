"""The top-level keys each recipe's config may hold.

Kept apart from the config check (:mod:`.config`) so that the checks of a component's options
(:mod:`.component_options`, :mod:`.optimizer_rules`) can tell a top-level key given under a
component (``optimizer.gradient_accumulation_steps``) from a misspelt option.
"""

__all__ = ["RECIPE_KEYS", "TOP_LEVEL_KEYS", "top_level_hint"]

# Keys of torchtune 0.6.1's single-device configs, which our recipes accept unchanged.
_SINGLE_DEVICE_KEYS = {
    "batch_size", "checkpointer", "clip_grad_norm", "collate_fn", "compile", "cudnn_deterministic_mode",
    "dataset", "device", "dtype", "enable_activation_checkpointing", "enable_activation_offloading",
    "epochs", "gradient_accumulation_steps", "log_every_n_steps", "log_peak_memory_stats", "loss",
    "lr_scheduler", "max_steps_per_epoch", "metric_logger", "model", "optimizer", "output_dir",
    "profiler", "resume_from_checkpoint", "seed", "shuffle", "tokenizer", "overwrite_checkpoints",
}
# Resumable checkpoints at any step (recipe/checkpoints/step_checkpoints.py, recipe/checkpoints/distributed_checkpoints.py).
_STEP_CHECKPOINT_KEYS = ("save_every_n_steps", "keep_last_n_checkpoints")
RECIPE_KEYS = {
    "full": _SINGLE_DEVICE_KEYS | {"optimizer_in_bwd", "host_memory_check", *_STEP_CHECKPOINT_KEYS},
    "lora": _SINGLE_DEVICE_KEYS | {"save_adapter_weights_only", "low_cpu_ram", "host_memory_check",
                                   *_STEP_CHECKPOINT_KEYS},
    "distributed": _SINGLE_DEVICE_KEYS | {
        "optimizer_in_bwd", "fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_shard_policy",
        "custom_sharded_layers", "tensor_parallel_dim", "tensor_parallel_plan", "ac_mode", "ac_option",
        "enable_async_checkpointing", "host_memory_check", *_STEP_CHECKPOINT_KEYS,
    },
}
#: Every recipe's top-level keys.
TOP_LEVEL_KEYS = frozenset().union(*RECIPE_KEYS.values())


def top_level_hint(node: str, key: str) -> str:
    """The hint for a component's unknown option ``key`` that is a top-level key, else ''."""
    if key not in TOP_LEVEL_KEYS:
        return ""
    return f"It is a top-level key of the config: give {key}=... (not {node}.{key})."
