"""What a profiled step spent its time on: a torch profiler trace read into a few tables.

A recipe run with ``profiler.enabled=True`` writes a Chrome trace per profiled cycle
(``<output_dir>/profiling_outputs/iteration_<N>/*.pt.trace.json.gz``). Opening an 8B model's trace
in a viewer takes minutes and answers one question at a time; the questions this project asks of a
trace are always the same: how long the device computed, copied and stood idle in a step, what
the training thread was doing while no kernel ran, and how long each of the engine's ranges
(``offload/...``, :func:`torchtune_offload.optim.step_timings.profiled`) took on each thread.
:func:`summarize` answers them and :func:`format_summary` prints the answer as Markdown.
"""

import bisect
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

from torch.profiler import ProfilerActivity, profile

from torchtune_offload.optim.step_timings import PROFILE_PREFIX

#: Trace categories of device work; ``gpu_user_annotation`` (a CPU range mirrored) is not work.
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_NOT_HOST_WORK = _DEVICE_CATEGORIES | {"gpu_user_annotation", "ac2g", "Trace"}
#: Host calls into CUDA (cudaLaunchKernel; cuLaunchKernel for what cuBLASLt launches through the driver).
_LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
#: Kernel names of matrix products and attention (cuBLAS, cuBLASLt's nvjet, CUTLASS, flash attention).
_MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|flash|fmha|attention|sdpa", re.IGNORECASE)
_STEP = re.compile(r"ProfilerStep#(\d+)$")
#: A thread's activity outside every recorded op (Python code, or a blocking call torch does not record).
_PYTHON = "(in no recorded op)"

Interval = Tuple[float, float]


@dataclass(frozen=True)
class _Event:
    name: str
    category: str
    thread: Tuple[Any, Any]
    start: float  # microseconds, as the trace stores them
    end: float


@dataclass
class TraceSummary:
    """One trace's figures, in seconds summed over its profiled steps (see :func:`summarize`).

    Attributes:
        source: the file read.
        steps: ``(step number, wall seconds)`` of each profiled step (``ProfilerStep#N``), in order.
        span_s: the seconds the figures cover: the profiled steps, or the whole trace without them.
        training_thread: the name of the thread that ran the steps.
        device_s: device work by kind (the union over streams within each kind); empty without
            device events.
        kernel_idle_s: seconds in ``span_s`` in which no kernel ran on any stream.
        gap_s: the idle stretches of at least ``gap_ms`` (:func:`summarize`), summed.
        num_gaps: how many such stretches.
        idle_by_activity: ``(thread, activity, seconds)``: for the training thread and each thread
            that launched at least 5% of the kernels (on CUDA, backward launches from autograd's
            own thread), what it was in during those stretches (its innermost engine range, then
            its innermost recorded op), longest first.
        longest_gaps: ``(start s into the span, length s, each watched thread's activity at the
            gap's middle)``, longest first.
        ranges: per ``(thread, engine range)``, ``(count, seconds)``, by thread and then name.
    """

    source: str
    steps: List[Tuple[int, float]]
    span_s: float
    training_thread: str
    device_s: Dict[str, float] = field(default_factory=dict)
    kernel_idle_s: float = 0.0
    gap_s: float = 0.0
    num_gaps: int = 0
    idle_by_activity: List[Tuple[str, str, float]] = field(default_factory=list)
    longest_gaps: List[Tuple[float, float, str]] = field(default_factory=list)
    ranges: Dict[Tuple[str, str], Tuple[int, float]] = field(default_factory=dict)


def find_trace(path: Path) -> Path:
    """The trace at ``path``: the file itself, or the newest ``*.pt.trace.json[.gz]`` (the name
    torch's trace handler gives) anywhere under a folder, so a run's or a sweep's folder will do.

    Args:
        path: a trace file (any name), or a folder.

    Raises:
        FileNotFoundError: if there is none, naming the path and how traces are made.
    """
    path = Path(path)
    if path.is_file():
        return path
    patterns = ("*.pt.trace.json", "*.pt.trace.json.gz")
    found = [p for pattern in patterns for p in path.rglob(pattern)] if path.is_dir() else []
    if not found:
        raise FileNotFoundError(
            f"{path}: no profiler trace (*.pt.trace.json or *.pt.trace.json.gz) there. A recipe writes one "
            "under profiler.output_dir when run with profiler.enabled=True."
        )
    return max(found, key=lambda p: (p.stat().st_mtime, str(p)))


def load_events(path: Path) -> Tuple[List[_Event], Dict[Tuple[Any, Any], str]]:
    """The complete (``"ph": "X"``) events of a Chrome trace, and its threads' names.

    Args:
        path: a Chrome trace, gzipped where its name ends in ``.gz``.

    Raises:
        ValueError: if the file is not a trace (no ``traceEvents`` list).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list).")
    events, names = [], {}
    for e in raw:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "X" and "ts" in e:
            start = float(e["ts"])
            events.append(_Event(str(e.get("name", "")), str(e.get("cat", "")), (e.get("pid"), e.get("tid")),
                                 start, start + float(e.get("dur", 0.0))))
    return events, names


def _thread_name(names: Dict[Tuple[Any, Any], str], thread: Tuple[Any, Any]) -> str:
    return names.get(thread) or f"thread {thread[1]}"


def _thread_names(names: Dict[Tuple[Any, Any], str],
                  by_thread: Dict[Tuple[Any, Any], List[_Event]]) -> Dict[Tuple[Any, Any], str]:
    """Each thread's trace name, with the engine range it spent longest in: Python does not name
    its threads for the OS, so a trace calls them all after the process (``thread 8262 (python3)``)."""
    out = {}
    for thread, events in by_thread.items():
        spent: Dict[str, float] = defaultdict(float)
        for e in events:
            if e.name.startswith(PROFILE_PREFIX):
                spent[e.name[len(PROFILE_PREFIX):]] += e.end - e.start
        busiest = f" [{max(spent, key=spent.get)}]" if spent else ""
        out[thread] = _thread_name(names, thread) + busiest
    return out


def _union(intervals: Iterable[Interval]) -> List[Interval]:
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _clip(intervals: Iterable[Interval], window: Interval) -> List[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def _complement(busy: List[Interval], window: Interval) -> List[Interval]:
    """The stretches of ``window`` that no interval of ``busy`` (a union) covers."""
    idle, cursor = [], window[0]
    for s, e in busy:
        if s > cursor:
            idle.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < window[1]:
        idle.append((cursor, window[1]))
    return idle


def _device_kind(event: _Event) -> str:
    if event.category == "kernel":
        return "kernels: matmul and attention" if _MATMUL.search(event.name) else "kernels: other"
    if event.category == "gpu_memset":
        return "memset"
    for direction in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
        if direction in event.name:
            return f"copies {direction}"
    return "copies, other"


def _activity(stack: Sequence[_Event]) -> str:
    """A thread's activity: its innermost engine range, then its innermost op (``a > b``)."""
    innermost = stack[-1]
    if _STEP.match(innermost.name):
        return _PYTHON
    label = next((e.name for e in reversed(stack) if e.name.startswith(PROFILE_PREFIX)), None)
    if label is None or label == innermost.name:
        return innermost.name
    return f"{label} > {innermost.name}"


def _timeline(events: List[_Event]) -> List[Tuple[float, float, str]]:
    """A thread's events (nested ranges) cut into ``(start, end, activity)`` pieces that tile the
    time some event covers, in time order. Two ranges that overlap without one holding the other
    (clock rounding) are cut where the later one starts."""
    pieces: List[Tuple[float, float, str]] = []
    stack: List[_Event] = []
    cursor = 0.0

    def emit(until: float) -> None:
        if stack and until > cursor:
            pieces.append((cursor, until, _activity(stack)))

    for event in sorted(events, key=lambda e: (e.start, -e.end)):
        while stack and stack[-1].end <= event.start:
            emit(stack[-1].end)
            cursor = stack.pop().end
        emit(event.start)
        cursor = event.start
        while stack and stack[-1].end < event.end:
            stack.pop()
        stack.append(event)
    while stack:
        emit(stack[-1].end)
        cursor = stack.pop().end
    return pieces


def _overlaps(pieces: List[Tuple[float, float, str]], ends: List[float], interval: Interval) -> Dict[str, float]:
    """Per activity, the time of ``interval`` it covers; ``pieces`` are in time order, ``ends`` their ends."""
    spent: Dict[str, float] = defaultdict(float)
    for index in range(bisect.bisect_right(ends, interval[0]), len(pieces)):
        s, e, what = pieces[index]
        if s >= interval[1]:
            break
        spent[what] += min(e, interval[1]) - max(s, interval[0])
    return spent


def _watched(by_thread: Dict[Tuple[Any, Any], List[_Event]], training: Tuple[Any, Any]) -> List[Tuple[Any, Any]]:
    """The training thread, and every other thread that launched at least 5% of the kernels."""
    launches = {t: sum(e.category in _LAUNCH_CATEGORIES and "Launch" in e.name for e in events)
                for t, events in by_thread.items()}
    total = sum(launches.values())
    return [training] + [t for t in by_thread if t != training and total and launches[t] >= 0.05 * total]


def _add_device_figures(summary: TraceSummary, device: List[_Event], watched: Dict[str, List[_Event]],
                        windows: List[Interval], *, gap_ms: float, num_longest: int) -> None:
    """Fills ``summary``'s device figures: the work by kind, the time without kernels, and what the
    ``watched`` threads (name -> events) were in during the stretches of at least ``gap_ms``."""
    kinds: Dict[str, List[Interval]] = defaultdict(list)
    for e in device:
        kinds[_device_kind(e)].append((e.start, e.end))
    for kind in sorted(kinds):
        busy = _union(kinds[kind])
        summary.device_s[kind] = sum(_length(_clip(busy, w)) for w in windows) / 1e6
    kernels = _union(iv for kind, ivs in kinds.items() if kind.startswith("kernels") for iv in ivs)
    timelines = {}
    for thread, events in watched.items():
        pieces = _timeline(events)
        timelines[thread] = (pieces, [e for _, e, _ in pieces])
    by_activity: Dict[Tuple[str, str], float] = defaultdict(float)
    gaps = []
    for window in windows:
        idle = _complement(_clip(kernels, window), window)
        summary.kernel_idle_s += _length(idle) / 1e6
        for gap in (g for g in idle if g[1] - g[0] >= gap_ms * 1e3):
            at_middle = []
            for thread, (pieces, ends) in timelines.items():
                spent = _overlaps(pieces, ends, gap)
                spent[_PYTHON] += (gap[1] - gap[0]) - sum(spent.values())
                for what, us in spent.items():
                    if us > 0:
                        by_activity[(thread, what)] += us / 1e6
                middle = (gap[0] + gap[1]) / 2
                there = _overlaps(pieces, ends, (middle, middle + 1e-3))
                at_middle.append(f"{thread}: {max(there, key=there.get) if there else _PYTHON}")
            offset = _length(_clip(windows, (windows[0][0], gap[0])))
            gaps.append((offset / 1e6, (gap[1] - gap[0]) / 1e6, "; ".join(at_middle)))
    summary.num_gaps = len(gaps)
    summary.gap_s = sum(g[1] for g in gaps)
    summary.idle_by_activity = sorted(((t, w, s) for (t, w), s in by_activity.items()), key=lambda x: -x[2])
    summary.longest_gaps = sorted(gaps, key=lambda g: -g[1])[:num_longest]


def _profile_ranges(by_thread: Dict[Tuple[Any, Any], List[_Event]], names: Dict[Tuple[Any, Any], str],
                    windows: List[Interval]) -> Dict[Tuple[str, str], Tuple[int, float]]:
    """The engine's profiler ranges (``PROFILE_PREFIX``) seen inside ``windows``, by thread name and
    range name: how many, and their seconds inside the windows."""
    ranges: Dict[Tuple[str, str], List[float]] = defaultdict(lambda: [0, 0.0])
    for thread, thread_events in by_thread.items():
        for e in thread_events:
            if e.name.startswith(PROFILE_PREFIX):
                seen = sum(_length(_clip([(e.start, e.end)], w)) for w in windows)
                if seen > 0:
                    entry = ranges[(_thread_name(names, thread), e.name)]
                    entry[0] += 1
                    entry[1] += seen / 1e6
    return {key: (int(c), s) for key, (c, s) in sorted(ranges.items())}


def summarize(path: Path, *, gap_ms: float = 1.0, num_longest: int = 10) -> TraceSummary:
    """Reads the trace at ``path`` (see :func:`find_trace`) into a :class:`TraceSummary`.

    Args:
        path: a trace file, or a folder to take the newest trace from.
        gap_ms: the shortest stretch without kernels counted as a gap; shorter ones are the
            launch gaps between back-to-back kernels.
        num_longest: how many of the longest gaps to list.

    Raises:
        FileNotFoundError: if there is no trace at ``path``.
        ValueError: if ``gap_ms`` is negative or the file is not a trace with events.
    """
    if gap_ms < 0:
        raise ValueError(f"gap_ms={gap_ms}: must be >= 0 (milliseconds).")
    source = find_trace(path)
    events, names = load_events(source)
    if not events:
        raise ValueError(f"{source}: the trace holds no events.")
    # A device's rows (its pid) hold only device work, whatever their categories.
    device_pids = {e.thread[0] for e in events if e.category in _DEVICE_CATEGORIES}
    host = [e for e in events if e.category not in _NOT_HOST_WORK and e.thread[0] not in device_pids]
    if not host:
        raise ValueError(f"{source}: the trace holds no host events (was it recorded with profiler.cpu=True?).")
    steps = sorted(((int(_STEP.match(e.name).group(1)), e) for e in host if _STEP.match(e.name)),
                   key=lambda step: (step[0], step[1].start))
    by_thread: Dict[Tuple[Any, Any], List[_Event]] = defaultdict(list)
    for e in host:
        by_thread[e.thread].append(e)
    names = _thread_names(names, by_thread)
    if steps:
        training = steps[0][1].thread
        windows = _union((e.start, e.end) for _, e in steps)
    else:
        # Without step markers: the thread that launched the device's work, else the busiest one.
        training = max(by_thread, key=lambda t: (sum(e.category in _LAUNCH_CATEGORIES for e in by_thread[t]),
                                                  len(by_thread[t])))
        windows = [(min(e.start for e in events), max(e.end for e in events))]
    summary = TraceSummary(
        source=str(source),
        steps=[(number, (e.end - e.start) / 1e6) for number, e in steps],
        span_s=_length(windows) / 1e6,
        training_thread=_thread_name(names, training),
    )

    device = [e for e in events if e.category in _DEVICE_CATEGORIES]
    if device:
        watched = {_thread_name(names, t): by_thread[t] for t in _watched(by_thread, training)}
        _add_device_figures(summary, device, watched, windows, gap_ms=gap_ms, num_longest=num_longest)

    summary.ranges = _profile_ranges(by_thread, names, windows)
    return summary


def format_summary(summary: TraceSummary) -> str:
    """The summary as Markdown: device work, where the kernel-idle time went, the engine's ranges.
    Figures are per profiled step (summed over the steps, divided by their number)."""
    n = max(1, len(summary.steps))

    def per(seconds: float) -> str:
        return f"{seconds / n:.4f}"

    lines = [f"Trace: {summary.source}"]
    if summary.steps:
        walls = ", ".join(f"#{k} {s:.3f} s" for k, s in summary.steps)
        lines.append(f"Profiled steps: {walls}; figures are seconds per step (mean of {n}).")
    else:
        lines.append(f"No ProfilerStep markers: figures cover the whole trace ({summary.span_s:.3f} s).")
    lines.append(f"Training thread: {summary.training_thread}.")
    lines.append("")
    if not summary.device_s:
        lines.append("No device events in the trace (a CPU-only run, or the profiler's cuda: false).")
    else:
        lines += ["| device work (union over streams) | s per step | share of the step |", "|---|---:|---:|"]
        span = summary.span_s or 1.0
        for kind, s in summary.device_s.items():
            lines.append(f"| {kind} | {per(s)} | {s / span:.1%} |")
        lines.append(f"| no kernel running | {per(summary.kernel_idle_s)} | {summary.kernel_idle_s / span:.1%} |")
        lines += ["", f"{summary.num_gaps / n:.1f} stretches a step without kernels, {per(summary.gap_s)} s a step "
                  "in all. What the threads that launch kernels were in during them:", "",
                  "| thread | in | s per step |", "|---|---|---:|"]
        lines += [f"| {thread} | {what} | {per(s)} |" for thread, what, s in summary.idle_by_activity]
        if summary.longest_gaps:
            lines += ["", "| longest stretches: start, s into the profiled span | length, s | threads were in |",
                      "|---:|---:|---|"]
            lines += [f"| {start:.4f} | {length:.4f} | {what} |" for start, length, what in summary.longest_gaps]
    lines.append("")
    if summary.ranges:
        lines += ["| thread | engine range | count per step | s per step |", "|---|---|---:|---:|"]
        lines += [f"| {thread} | {name} | {count / n:.1f} | {per(s)} |"
                  for (thread, name), (count, s) in summary.ranges.items()]
    else:
        lines.append(f"No {PROFILE_PREFIX}... ranges: the engine did not run, or the profiler did not record "
                     "its threads (profiler.all_threads).")
    return "\n".join(lines)


def called_by_aten(event: Any) -> bool:
    """Whether a ``torch.profiler`` event of an aten op was called by another aten op (its work), not
    dispatched by its thread itself."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def dispatched_aten_ops(fn: Callable[[], Any]) -> List[str]:
    """The aten ops ``fn`` dispatches that no other aten op called, in the order they started."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::") and not called_by_aten(e)]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]
