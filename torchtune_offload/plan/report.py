"""The planner's report: the variants' table with a verdict against each budget, the full/LoRA/QLoRA
block, and the advice on where the update runs (``python -m torchtune_offload.plan`` prints it)."""

from typing import Dict, List, Mapping, Optional

from torchtune_offload.plan.fastest import fastest_block
from torchtune_offload.plan.planner import GIB, VariantPlan
from torchtune_offload.plan.recorded_runs import known_gaps_block
from torchtune_offload.plan.speed import Speed, sums_elsewhere_block


def gib(n: Optional[int]) -> str:
    """Bytes in GiB for a table cell; '-' where a plan has no figure."""
    return "-" if n is None else f"{n / GIB:.2f}"


def device_verdict(p: VariantPlan, budget: Optional[int]) -> str:
    """Whether ``p`` fits a device of ``budget`` bytes: its step peak and, where higher, the load
    (``load_bytes``: FP8 device weights load in bf16 first), which alone may not fit ("no (load)")."""
    if p.device_bytes is None:
        return "-"
    if budget is None:
        return "?"
    if p.device_bytes > budget:
        return "no"
    return "no (load)" if p.device_need > budget else "yes"


def format_fine_tunes(plans: List[VariantPlan], *, device_budget: Optional[int], host_budget: int,
                      optimizer: str) -> str:
    """The full/LoRA/QLoRA block: a table, then one line saying which fit the device budget."""
    budget = "unknown (give --device-gib)" if device_budget is None else f"{device_budget / GIB:.1f} GiB"
    lines = [f"Full, LoRA and QLoRA of this model, each with the configured optimizer ({optimizer}); "
             f"device budget {budget}:", "",
             "| fine-tune | device peak GiB | fits device | host peak GiB | fits host | model._component_ |",
             "|---|---:|:---:|---:|:---:|---|"]
    for p in plans:
        fits = "-" if device_budget is None else device_verdict(p, device_budget)
        fits_host = "-" if p.host_bytes is None else ("yes" if p.host_bytes <= host_budget else "no")
        lines.append(f"| {p.name} | {gib(p.device_bytes)} | {fits} | {gib(p.host_bytes)} | {fits_host} | "
                     f"{p.problem if p.problem else p.description} |")
    if device_budget is not None:
        fit = [p.name for p in plans if device_verdict(p, device_budget) == "yes"]
        miss = [p.name for p in plans if device_verdict(p, device_budget).startswith("no")]
        unknown = [p.name for p in plans if p.device_bytes is None]
        lines.append("")
        lines.append(f"On a {budget} device: " + "; ".join(part for part in (
            f"{', '.join(fit)} fit{'s' if len(fit) == 1 else ''}" if fit else "",
            f"{', '.join(miss)} do{'es' if len(miss) == 1 else ''} not fit" if miss else "",
            f"{', '.join(unknown)} could not be planned" if unknown else "") if part) + ".")
        short = [f"{p.name} needs {gib(p.host_bytes)} GiB" for p in plans
                 if p.host_bytes is not None and p.host_bytes > host_budget]
        if short:
            lines.append(f"Host memory ({host_budget / GIB:.1f} GiB budget): {', '.join(short)}, more than it has.")
    return "\n".join(lines)


#: The sweep's variants of each place the update runs, in order of preference.
_DEVICE_UPDATE = ("offload_device_update_overlap", "offload_device_update")
_HOST_UPDATE = ("offload_grads_overlap", "offload_grads", "offload_overlap", "offload")


def update_on_advice(plans: List[VariantPlan], *, device_budget: Optional[int], host_budget: int) -> Optional[str]:
    """Where the offloaded update should run, from the planned variants: on the device
    (``update_on=device``: the states alone on the host) where the weights and gradients fit the
    device, else on the host (``update_on=host`` with ``offload_gradients``). None without the
    variants to compare or a device budget."""
    planned = {p.name: p for p in plans if p.problem is None}
    device = next((planned[n] for n in _DEVICE_UPDATE if n in planned), None)
    host = next((planned[n] for n in _HOST_UPDATE if n in planned), None)
    if device is None or device_budget is None:
        return None

    def fits(p: VariantPlan) -> bool:
        return p.fits(device_budget=device_budget, host_budget=host_budget)

    def figures(p: VariantPlan) -> str:
        return f"{p.name}: {p.device_bytes / GIB:.2f} GiB device, {p.host_bytes / GIB:.2f} GiB host"

    other = f" ({figures(host)}{', which fits' if fits(host) else ''})" if host is not None else ""
    if fits(device):
        return ("Where the update runs: the weights and gradients fit the device, so optimizer.update_on=device is "
                f"the better choice ({figures(device)}): only the optimizer states are on the host, and the update "
                "is the device's own kernel, with no host arithmetic. The host engine needs more host memory and "
                f"is bound by the host's memory bandwidth{other}.")
    if device.device_need > device_budget:
        return ("Where the update runs: with optimizer.update_on=device the weights and gradients do not fit the "
                f"device ({figures(device)}), so the host engine is the choice: optimizer.update_on=host with "
                f"optimizer.offload_gradients=True, which keeps the gradients off the device too{other}.")
    return (f"Where the update runs: optimizer.update_on=device fits the device but not the host ({figures(device)}); "
            "8-bit states with update_on=device (optimizer.optimizer_class=bitsandbytes.optim.AdamW8bit: about half "
            "the host memory; staged whole, so optimizer.device_staging_mib must hold twice the largest tensor's "
            f"states) or a LoRA fine-tune need less{other}.")


def format_plans(plans: List[VariantPlan], *, device: str, device_budget: Optional[int], host_budget: int,
                 config_path: str, seq_len_note: str, fine_tunes: str = "",
                 speeds: Optional[Dict[str, Optional[Speed]]] = None, machine: str = "",
                 device_budget_note: str = "", host_budget_note: str = "",
                 math_changes: Optional[Mapping[str, Optional[str]]] = None, ranks: Optional[int] = None) -> str:
    """A markdown table of the plans, with the budgets and a verdict per variant.

    Args:
        fine_tunes: a block shown after the table, before each variant's breakdown
            (:func:`format_fine_tunes`).
        speeds: each variant's predicted step (:func:`plan_speed`), by name: adds its seconds,
            tok/s, bound and the batch at which overlap hides the offloaded work to the row.
        machine: the machine the speeds are for, named in the header.
        device_budget_note: where the device budget comes from, where not from the flag or this
            machine's device (a ``--machine`` file's or preset's memory).
        host_budget_note: where the host budget comes from, shown beside it.
        math_changes: each variant's :func:`~torchtune_offload.plan.fastest.math_change`, by name:
            with ``speeds`` (and a device that is not the CPU), the fastest variant that fits is
            named under the table, and the fastest without such a change where that is another.
        ranks: the distributed recipe's ranks on this machine: the device figures are one rank's,
            the host figures the machine's, and the speeds leave FSDP2's collectives out (said).
    """
    lines = [f"Plan for {config_path} ({seq_len_note}); device {device}, budget "
             f"{'unknown (give --device-gib)' if device_budget is None else f'{device_budget / GIB:.1f} GiB'}"
             f"{f' ({device_budget_note})' if device_budget_note else ''}; "
             f"host budget {host_budget / GIB:.1f} GiB{f' ({host_budget_note})' if host_budget_note else ''}.", "",
             "| variant | device peak GiB | + paged GiB | fits device | host peak GiB | fits host |"
             + (" s/step | tok/s | bound | overlap hides at batch |" if speeds is not None else "") + " what |",
             "|---|---:|---:|:---:|---:|:---:|" + ("---:|---:|---|---:|" if speeds is not None else "") + "---|"]
    if ranks is not None:
        lines.insert(1, f"The distributed recipe over {ranks} rank(s) on one machine (docs/planner.md#fsdp2-per-rank): "
                        "device figures are one rank's, each device against the device budget; host figures are "
                        "the machine's, all ranks together.")
    if speeds is not None:
        cpu = " No speed for a CPU run: the model predicts a GPU's step (plan device=cuda)." if device == "cpu" else ""
        collectives = (" One rank's step without FSDP2's all-gathers and reduce-scatters, which the model has no "
                       "interconnect rate for: not a prediction of the run's speed, a basis for ranking the variants "
                       "that fit." if ranks is not None else "")
        lines.insert(1 + (ranks is not None), f"Speed on {machine} (docs/planner.md#how-fast).{cpu}{collectives}")
    lines += [_table_row(p, device_budget=device_budget, host_budget=host_budget, speeds=speeds) for p in plans]
    predicted = {p.name: speeds[p.name] for p in plans if speeds and speeds.get(p.name)}
    if speeds is not None and math_changes is not None and device != "cpu":
        lines += fastest_block(plans, speeds, device_budget=device_budget, host_budget=host_budget,
                               math_changes=math_changes, ranks=ranks)
    lines += known_gaps_block(predicted) + sums_elsewhere_block(predicted)
    # update_on=device moves the update to an accelerator; a CPU run has none to move it to.
    advice = None if device == "cpu" else update_on_advice(plans, device_budget=device_budget, host_budget=host_budget)
    if advice:
        lines += ["", advice]
    if fine_tunes:
        lines += ["", fine_tunes]
    lines += _breakdowns(plans)
    return "\n".join(lines)


def _verdict(n: Optional[int], budget: Optional[int]) -> str:
    """Whether a peak of ``n`` bytes fits ``budget``: "-" without a figure, "?" without a budget."""
    if n is None:
        return "-"
    if budget is None:
        return "?"
    return "yes" if n <= budget else "no"


def _table_row(p: VariantPlan, *, device_budget: Optional[int], host_budget: int,
               speeds: Optional[Dict[str, Optional[Speed]]]) -> str:
    """The row of :func:`format_plans`' table for ``p``, its speed's cells where ``speeds`` is given."""
    what = p.problem if p.problem else p.description
    paged = f"{p.paged_bytes / GIB:.2f}" if p.paged_bytes else "-"
    speed = ""
    if speeds is not None:
        s = speeds.get(p.name)
        speed = (" - | - | - | - |" if s is None else
                 f" {s.step_seconds:.3g} | {s.tokens_per_second:.0f} | {s.bound} | "
                 f"{'-' if s.hides_at_batch is None else f'>= {s.hides_at_batch}'} |")
    return (f"| {p.name} | {gib(p.device_bytes)} | {paged} | {device_verdict(p, device_budget)} | "
            f"{gib(p.host_bytes)} | {_verdict(p.host_bytes, host_budget)} |{speed} {what} |")


def _breakdowns(plans: List[VariantPlan]) -> List[str]:
    """The lines under :func:`format_plans`' table: each planned variant's device and host parts and
    its notes, a note every variant has said once above them."""
    lines: List[str] = []
    planned = [p for p in plans if not p.problem]
    # A note every variant has (the checkpoint not found, the allocator's rounding) is said once.
    shared = [n for n in planned[0].notes if all(n in p.notes for p in planned)] if len(planned) > 1 else []
    if shared:
        lines += ["", "Notes on every variant below:", *(f"  note: {note}" for note in shared)]
    for p in planned:
        lines.append(f"\n{p.name}:")
        lines.append("  device: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.device_parts.items()))
        lines.append("  host:   " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.host_parts.items()))
        for note in p.notes:
            if note not in shared:
                lines.append(f"  note: {note}")
    return lines


