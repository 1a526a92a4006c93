#!/usr/bin/env python
"""Per-rank memory of FSDP2 shard policies, measured on CPU with gloo.

Usage (from the repository root)::

    python scripts/bench/fsdp_memory_table.py                      # tiny, mid, mid-tied; 1 and 2 ranks
    python scripts/bench/fsdp_memory_table.py --models mid --world-sizes 2 --steps 10 --seq-len 256

For each model, shard policy (``layers``; ``layers`` + ``embeddings``) and world size, the script
spawns that many gloo ranks (``torch.multiprocessing``, MASTER_ADDR=127.0.0.1), shards the model
with :func:`torchtune_offload.distributed.shard_model`, and trains it with AdamW on random tokens
(the same per-rank batch at every world size): ``--warmup`` steps, ``--steps`` timed steps, then
``--profiled-steps`` steps under the memory profiler. It prints a markdown table, one row per rank.
Columns, in MiB:

- params / grads / optimizer: bytes of this rank's shards (``DTensor.to_local()``): the sharded
  parameters, the sharded gradients after backward, and AdamW's state. Exact, not estimated.
- gathered peak: the most parameter bytes FSDP2 held all-gathered at once during the timed steps,
  and which units they belonged to. Recorded at FSDP2's own state changes (a unit's parameter
  group switching to and from its unsharded tensors), so it is what FSDP did, not a model of it.
- forward / backward / optimizer-step peak: the most bytes the CPU allocator had handed out at once
  in each phase of the profiled steps, counting every allocation made since profiling began, from
  ``torch.profiler`` with ``profile_memory=True`` (each CPU allocation carries the allocator's
  running total of what it handed out while profiling). They hold activations, gathered
  parameters, full and sharded gradients, communication buffers (including those FSDP2 keeps from
  one step into the next, hence more than one profiled step) and the optimizer's temporaries.
- peak: params + optimizer + buffers + the highest of the three: the rank's peak of tensor memory.
  (Process RSS would add Python, library and allocator overheads; tracemalloc sees none of
  torch's memory.)
- s/step: mean over the timed steps; on CPU and gloo, not a GPU figure.

Models: ``tiny`` is configs/tiny's Llama3 (vocab 512, dim 64, 2 layers); ``mid`` a random-init
Llama3 with vocab 32000, dim 512, 4 layers (torchtune's llama3 builder); ``mid-tied`` the same with
tied input/output embeddings (llama3_2 builder), where the embeddings policy leaves the shared
matrix in the root (see torchtune_offload/distributed/policies.py).
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from torchtune_offload.bench.arguments import check_output_file, positive_int
from torchtune_offload.bench.machine import cpu_name

MIB = 2**20
POLICIES = {"layers": ["layers"], "layers+embeddings": ["layers", "embeddings"]}
MODELS = {
    "tiny": dict(builder="torchtune_offload.models.tiny_llama", kwargs={}),
    "mid": dict(
        builder="torchtune.models.llama3.llama3",
        kwargs=dict(vocab_size=32_000, num_layers=4, num_heads=8, num_kv_heads=4, embed_dim=512,
                    intermediate_dim=1376, max_seq_len=1024),
    ),
    "mid-tied": dict(
        builder="torchtune.models.llama3_2.llama3_2",
        kwargs=dict(vocab_size=32_000, num_layers=4, num_heads=8, num_kv_heads=4, embed_dim=512,
                    intermediate_dim=1376, max_seq_len=1024, tie_word_embeddings=True),
    ),
}

# One explicit map of every command-line option.
_OPTIONS: Dict[str, Dict[str, Any]] = {
    "--models": dict(nargs="+", choices=sorted(MODELS), default=["tiny", "mid", "mid-tied"],
                     help="models to measure (default: all)"),
    "--policies": dict(nargs="+", choices=list(POLICIES), default=list(POLICIES),
                       help="shard policies (default: both)"),
    "--world-sizes": dict(nargs="+", type=positive_int, default=[1, 2], help="numbers of ranks (default 1 2)"),
    "--batch-size": dict(type=positive_int, default=2, help="sequences per rank and step (default 2)"),
    "--seq-len": dict(type=positive_int, default=128, help="tokens per sequence (default 128)"),
    "--warmup": dict(type=int, default=2, help="untimed steps first; AdamW creates its state (default 2)"),
    "--steps": dict(type=positive_int, default=10, help="timed steps after warm-up (default 10)"),
    "--profiled-steps": dict(type=positive_int, default=3,
                             help="steps under the memory profiler after the timed ones; peaks are "
                                  "their maximum (default 3)"),
    "--reshard-after-forward": dict(type=int, choices=[0, 1], default=1,
                                    help="fully_shard's reshard_after_forward (default 1)"),
    "--json": dict(type=Path, default=None, help="also write the rows to this JSON file (a new one, unless --force)"),
    "--force": dict(action="store_true", help="replace an existing --json file"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, spec in _OPTIONS.items():
        parser.add_argument(flag, **spec)
    args = parser.parse_args(argv)
    if args.json is not None:  # before the runs, whose rows a bad path would lose
        check_output_file(parser, args.json, flag="--json", force=args.force)
    return args


# --------------------------------------------------------------------------- in each rank


class GatheredTracker:
    """Follows FSDP2's parameter groups into and out of their unsharded state."""

    def __init__(self) -> None:
        self.live: Dict[str, int] = {}
        self.peak = 0
        self.at_peak: List[str] = []
        self.enabled = False

    def install(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        tracker = self
        to_unsharded = FSDPParamGroup._to_unsharded
        to_sharded = FSDPParamGroup._to_sharded
        to_post = FSDPParamGroup._to_sharded_post_forward

        def unsharded(group):
            to_unsharded(group)
            tracker._gathered(group)

        def sharded(group):
            to_sharded(group)
            tracker.live.pop(_label(group), None)

        def post_forward(group):
            to_post(group)
            tracker.live.pop(_label(group), None)

        FSDPParamGroup._to_unsharded = unsharded
        FSDPParamGroup._to_sharded = sharded
        FSDPParamGroup._to_sharded_post_forward = post_forward

    def _gathered(self, group) -> None:
        if not self.enabled:
            return
        self.live[_label(group)] = sum(
            p.unsharded_param.numel() * p.unsharded_param.element_size() for p in group.fsdp_params
        )
        total = sum(self.live.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = sorted(self.live)


def _label(group) -> str:
    return group._module_fqn or "root"


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _profiled_peaks(prof) -> Dict[str, int]:
    """Peak of the CPU allocator's running total in each ``record_function`` phase, and overall."""
    from torch._C._profiler import _EventType

    allocations, phases = [], {name: [] for name in _PHASES}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.total_allocated))
        elif event.name in _PHASES:
            phases[event.name].append((event.start_time_ns, event.end_time_ns))
    peaks = {"step": max((a for _, a in allocations), default=0)}
    for name, spans in phases.items():
        peaks[name] = max((a for t, a in allocations if any(s <= t <= e for s, e in spans)), default=0)
    return peaks


_PHASES = ("forward", "backward", "optimizer")


def _measure(model_name: str, policy_name: str, opts: Dict[str, Any], tracker: GatheredTracker) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchtune.config._utils import _get_component_from_path

    from torchtune_offload.distributed import BUILTIN, shard_model

    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = _get_component_from_path(spec["builder"])(**spec["kwargs"])
    num_params = sum(p.numel() for p in model.parameters())
    vocab = model.tok_embeddings.num_embeddings
    plan = shard_model(
        model, policy=[BUILTIN[p] for p in POLICIES[policy_name]],
        reshard_after_forward=bool(opts["reshard_after_forward"]),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, vocab, (opts["batch_size"], opts["seq_len"] + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    grad_bytes = [0]

    def step():
        with torch.profiler.record_function("forward"):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1))
        with torch.profiler.record_function("backward"):
            loss.backward()
        grad_bytes[0] = _local_bytes(p.grad for p in model.parameters())
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(opts["warmup"]):
        step()
    tracker.live.clear()
    tracker.peak, tracker.at_peak, tracker.enabled = 0, [], True
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(opts["steps"]):
        step()
    seconds = (time.perf_counter() - t0) / max(opts["steps"], 1)
    tracker.enabled = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(opts["profiled_steps"]):
            step()
    params = _local_bytes(model.parameters())
    buffers = _local_bytes(model.buffers())
    state = _local_bytes(v for s in optimizer.state.values() for v in s.values())
    peaks = _profiled_peaks(prof)
    return dict(
        model=model_name, num_params=num_params, policy=policy_name, world=dist.get_world_size(),
        rank=dist.get_rank(), units=len(plan.units) + 1, skipped=sorted(plan.skipped),
        params=params, grads=grad_bytes[0], optimizer=state, buffers=buffers,
        gathered_peak=tracker.peak, gathered_units=tracker.at_peak, forward_peak=peaks["forward"],
        backward_peak=peaks["backward"], optimizer_peak=peaks["optimizer"], step_peak=peaks["step"],
        peak=params + state + buffers + peaks["step"], seconds=seconds,
    )


def _worker(rank: int, world: int, port: int, opts: Dict[str, Any], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    from torchtune_offload.distributed import set_host_threads

    set_host_threads()
    dist.init_process_group("gloo")
    tracker = GatheredTracker()
    tracker.install()
    rows = []
    try:
        for model_name in opts["models"]:
            for policy_name in opts["policies"]:
                rows.append(_measure(model_name, policy_name, opts, tracker))
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ the table


def _device() -> str:
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores; gloo; torch {torch.__version__}"


def table(rows: List[Dict[str, Any]]) -> str:
    def mib(x: int) -> str:
        return f"{x / MIB:.2f}" if x < 10 * MIB else f"{x / MIB:.1f}"

    head = ("| model (params) | policy | ranks | rank | units | params | grads | optimizer | "
            "gathered peak (units) | forward peak | backward peak | optimizer-step peak | **peak** | s/step |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        units = ", ".join(r["gathered_units"])
        lines.append(
            f"| {r['model']} ({r['num_params'] / 1e6:.2f}M) | {r['policy']} | {r['world']} | {r['rank']} | "
            f"{r['units']} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])} | "
            f"{mib(r['gathered_peak'])} ({units}) | {mib(r['forward_peak'])} | {mib(r['backward_peak'])} | "
            f"{mib(r['optimizer_peak'])} | "
            f"**{mib(r['peak'])}** | "
            f"{r['seconds']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k not in ("json", "force")}
    import torch.multiprocessing as mp

    rows: List[Dict[str, Any]] = []
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(world, _free_port(), opts, out), nprocs=world, join=True)
            per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
        rows.extend(row for group in zip(*per_rank) for row in group)
    order = {(m, p): i for i, (m, p) in enumerate((m, p) for m in args.models for p in args.policies)}
    rows.sort(key=lambda r: (order[(r["model"], r["policy"])], r["world"], r["rank"]))
    print(f"Device: {_device()}. Per-rank batch {args.batch_size} x {args.seq_len} tokens, fp32, AdamW, "
          f"reshard_after_forward={bool(args.reshard_after_forward)}; MiB.\n")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
