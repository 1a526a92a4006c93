"""The launching thread beside the engine's host work: how much a host pass on other threads slows it.

Usage: python scripts/bench/bench_launching_beside_host_work.py [--model 8B] [--micro-batches 12]
       [--elements 33554432]

The training thread runs micro-batches of llama3_1 8B narrowed to width 64 (``models.narrow``, as
``bench_launching_thread.py`` does: negligible arithmetic, one intra-op thread, so a micro-batch
costs what the thread launching its operators spends), while another thread runs the engine's host
gradient addition (``host_add.add_``, an fp32 sum of a bf16 gradient of ``--elements`` elements)
over and over: on no thread, on all cores but one, and on every core, as the engine's host passes
run on a GPU machine (torch's intra-op threads, every core by default). Each of these runs twice, in
fresh processes, with OpenMP's default wait policy (threads spin a while after each pass) and with
``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once): OpenMP reads it when it starts. Prints the
micro-batch's median milliseconds and its ratio to the run without host work, naming the CPU.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.distributed.host_threads import host_threads_per_rank
from torchtune_offload.models.narrow import NARROW_MODELS, VOCAB_SIZE, checkpointed_llama, chosen_models
from torchtune_offload.optim import host_add

WIDTH, TOKENS, WARMUP = 64, 16, 3
#: The wait policies compared, by the value of OMP_WAIT_POLICY (None: unset, OpenMP's default).
POLICIES = (None, "PASSIVE")


def host_threads_compared(cores: int) -> List[int]:
    """The host pass's thread counts: none, all cores but one (at least one), every core."""
    return sorted({0, max(1, cores - 1), cores})


def measure(*, model: str, micro_batches: int, elements: int, thread_counts: List[int]) -> Dict[int, float]:
    """The training thread's median seconds per micro-batch while a host addition on each of
    ``thread_counts`` threads (0: none) repeats on another thread, by thread count."""
    torch.set_num_threads(1)
    net = checkpointed_llama(model, width=WIDTH, max_seq_len=TOKENS)
    tokens = torch.randint(0, VOCAB_SIZE, (1, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    dst = torch.zeros(elements)
    src = torch.ones(elements, dtype=torch.bfloat16)

    def micro_batch() -> None:
        logits = net(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        net.zero_grad(set_to_none=True)

    def beside(host_threads: int) -> float:
        stop = threading.Event()

        def host_work() -> None:
            while not stop.is_set():
                host_add.add_(dst, src, threads=host_threads)

        worker = threading.Thread(target=host_work, daemon=True) if host_threads else None
        if worker is not None:
            worker.start()
        try:
            seconds = []
            for _ in range(micro_batches):
                start = time.perf_counter()
                micro_batch()
                seconds.append(time.perf_counter() - start)
        finally:
            stop.set()
            if worker is not None:
                worker.join()
        return statistics.median(seconds)

    for _ in range(WARMUP):
        micro_batch()
    return {threads: beside(threads) for threads in thread_counts}


def run_policy(policy: Optional[str], args: argparse.Namespace) -> Dict[int, float]:
    """:func:`measure` in a fresh process with OMP_WAIT_POLICY=``policy``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--micro-batches", str(args.micro_batches),
           "--elements", str(args.elements)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the run with OMP_WAIT_POLICY={policy or 'unset'} failed:\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def table(results: Dict[Optional[str], Dict[int, float]], *, header: str) -> str:
    lines = [header, "", "| host addition beside the micro-batches | "
             + " | ".join(f"OMP_WAIT_POLICY={p or 'unset'}: ms | x none" for p in results) + " |",
             "|---|" + "---:|---:|" * len(results)]
    counts = next(iter(results.values()))
    for threads in counts:
        what = "none" if threads == 0 else f"on {threads} thread{'s' if threads > 1 else ''}"
        cells = [f"{r[threads] * 1e3:.1f} | {r[threads] / r[0]:.2f}" for r in results.values()]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8B", help="one of " + ", ".join(NARROW_MODELS))
    parser.add_argument("--micro-batches", type=int, default=12, help="timed micro-batches a run (default 12)")
    parser.add_argument("--elements", type=int, default=32 << 20,
                        help="elements of the host addition (default 33554432: a 128 MiB fp32 sum)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        chosen_models(args.model)
    except ValueError as err:
        parser.error(str(err))
    for key in ("micro_batches", "elements"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    cores = host_threads_per_rank()  # this process's cores (one rank)
    if args.child:
        print(json.dumps(measure(model=args.model, micro_batches=args.micro_batches, elements=args.elements,
                                 thread_counts=host_threads_compared(cores))))
        return
    if not host_add.available():
        sys.exit("the host addition's C pass could not be built here (see the warning), so there is nothing to time")
    results = {}
    for policy in POLICIES:
        print(f"timing with OMP_WAIT_POLICY={policy or 'unset'} ...", file=sys.stderr, flush=True)
        results[policy] = run_policy(policy, args)
    header = (f"{cpu_name()}, {cores} cores, torch {torch.__version__}; {NARROW_MODELS[args.model][0]} at width "
              f"{WIDTH}, one intra-op thread, micro-batches of 1 x {TOKENS} tokens (median of {args.micro_batches}); "
              f"host addition: an fp32 sum of a bf16 gradient of {args.elements} elements, repeated")
    print(table(results, header=header))


if __name__ == "__main__":
    main()
