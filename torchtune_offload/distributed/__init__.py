"""FSDP2 sharding: shard policies and ``shard_model``, the chunked loss, host threads per rank, a rank's exit."""

from torchtune_offload.distributed.host_threads import host_threads_per_rank, set_host_threads
from torchtune_offload.distributed.loss import RowChunkedLoss
from torchtune_offload.distributed.policies import (
    BUILTIN,
    DEFAULT_POLICY,
    AnyOf,
    ModuleClass,
    NamePattern,
    Policy,
    ShardPlan,
    any_of,
    describe,
    embeddings,
    layers,
    parse_shard_policy,
    plan_shard,
    policy_problems,
    shard_model,
    shard_policy_of,
)
from torchtune_offload.distributed.rank_exit import exit_without_finalizing

__all__ = [
    "BUILTIN",
    "DEFAULT_POLICY",
    "AnyOf",
    "ModuleClass",
    "NamePattern",
    "Policy",
    "RowChunkedLoss",
    "ShardPlan",
    "any_of",
    "describe",
    "embeddings",
    "exit_without_finalizing",
    "host_threads_per_rank",
    "layers",
    "parse_shard_policy",
    "plan_shard",
    "policy_problems",
    "set_host_threads",
    "shard_model",
    "shard_policy_of",
]
