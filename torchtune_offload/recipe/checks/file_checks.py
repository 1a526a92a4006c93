"""The files a run will read, checked before any of them is loaded.

A missing or damaged file otherwise surfaces minutes into a run, after the weights are loaded, as a
library's error that names no config key. Here each problem names its key, the file and the fix.
Checks are cheap: existence, the safetensors header against the file's size (a truncated download),
and that a JSON dataset is not empty and parses.
"""

import json
import re
import struct
from pathlib import Path
from typing import Any, Iterable, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_offload.recipe.checkpoints.resume import final_weights, no_checkpoint_problem, run_output_dir, weight_files
from torchtune_offload.recipe.checkpoints.step_checkpoints import CHECKPOINTS_DIR, checkpoint_folders, newest_checkpoint
from torchtune_offload.recipe.checks.config import ConfigError

#: Dataset sources read from local files (``datasets.load_dataset(source, data_files=...)``).
_LOCAL_SOURCES = ("json", "csv", "text", "parquet", "arrow")


#: Compressed files ``datasets`` decompresses itself: their content is not checked here.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")
#: Only JSON files up to this size are parsed whole; larger ones are checked by their first record.
_PARSE_WHOLE_BYTES = 64 * 2**20


def _listed(value: Any) -> List[str]:
    if value is None:
        return []
    if isinstance(value, (dict, DictConfig)):  # split -> file(s)
        return [f for v in value.values() for f in _listed(v)]
    if isinstance(value, (list, ListConfig)):
        return [f for v in value for f in _listed(v)]
    return [str(value)]


def _is_local_path(name: str) -> bool:
    """A plain path: no URL scheme (hf://, https://) and no glob pattern, which ``datasets`` resolves."""
    return "://" not in name and not any(c in name for c in "*?[")


def safetensors_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete safetensors file, or None: its header must parse and the data
    it describes must end where the file does."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"its header claims {header_len} bytes but the file has {size}"
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        return f"it has no readable safetensors header ({type(err).__name__})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"it is truncated: {size} bytes of {expected}"
    return None


def _json_problem(path: Path) -> Optional[str]:
    if path.name.endswith(_COMPRESSED):
        return None
    if path.stat().st_size > _PARSE_WHOLE_BYTES:
        # Large: cheap checks only, the first line of JSON Lines or the start of one document.
        with open(path, errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        if not first:
            return "it is empty"
        if first.lstrip()[:1] in "[":
            return None
        try:
            json.loads(first)
        except ValueError as err:
            return f"its first line is not JSON ({err.msg})"
        return None
    text = path.read_text(errors="replace")
    if not text.strip():
        return "it is empty"
    try:
        json.loads(text)  # one JSON document (a list of records)
        return None
    except ValueError:
        pass
    for number, line in enumerate(text.splitlines(), 1):  # else JSON Lines: one record per line
        if line.strip():
            try:
                json.loads(line)
            except ValueError as err:
                return f"line {number} is not JSON ({err.msg})"
    return None


#: torchtune's epoch folders in ``output_dir`` (``epoch_0/model-00001-of-00001.safetensors``).
_EPOCH_FILE = re.compile(r"^(.*/)?epoch_\d+/")


def _how_to_resume_here(out: Path) -> str:
    newest = newest_checkpoint(out)
    found = (f"it continues from the newest complete checkpoint there, now {newest.name}" if newest is not None
             else "none is there yet: the run to resume must have written one (save_every_n_steps, or an epoch end)")
    return (f"This project resumes from its own checkpoints in {out / CHECKPOINTS_DIR}: keep "
            "checkpointer.checkpoint_dir and checkpointer.checkpoint_files at the model you fine-tuned from "
            "(the files the interrupted run was started with), leave checkpointer.recipe_checkpoint and adapter_checkpoint unset, and set "
            f"resume_from_checkpoint=True with no path; {found}.")


def torchtune_resume_problem(ck: DictConfig, *, directory: Path, files: List[str], out: Path) -> Optional[str]:
    """torchtune's documented way to resume (``checkpoint_files`` naming ``output_dir``'s
    ``epoch_<N>/`` files, ``recipe_checkpoint`` naming its recipe state) recognised before any
    weight is read, with how to resume here; ``None`` when the config does not use it.

    Weights saved at an epoch's end are not what a run stood at mid-epoch, and a LoRA epoch folder
    holds merged weights, which are no base to add adapters to: the convention is refused, not mapped.
    """
    epoch_files = [f for f in files if _EPOCH_FILE.match(f)]
    in_output = out.resolve() in (directory.resolve(), *directory.resolve().parents)
    if epoch_files or (in_output and files):
        shown = ", ".join((epoch_files or files)[:2])
        return (f"checkpointer.checkpoint_files=[{shown}] with resume_from_checkpoint=True is torchtune's way to "
                f"resume (the weights saved in {out} at an epoch's end). " + _how_to_resume_here(out))
    for key, what in (("recipe_checkpoint", "recipe state"), ("adapter_checkpoint", "adapter weights of an epoch")):
        value = ck.get(key)
        if value:
            return (f"checkpointer.{key}={value} with resume_from_checkpoint=True: torchtune's {what} is not read "
                    "here. " + _how_to_resume_here(out))
    return None


def _checkpoint_problems(ck: DictConfig, *, resume: bool, step_resume: bool, out: Path) -> Iterable[str]:
    directory = Path(str(ck.get("checkpoint_dir", "")))
    if not directory.is_dir():
        yield (f"checkpointer.checkpoint_dir={directory}: no such directory. Point it at the downloaded "
               "checkpoint (tune download ...) or a random-init one (python -m torchtune_offload.assets "
               "--real-arch ...).")
        return
    files = ck.get("checkpoint_files")
    if not isinstance(files, (list, ListConfig)):
        return  # a filename pattern: torchtune expands it
    if resume and step_resume:
        convention = torchtune_resume_problem(ck, directory=directory, files=_listed(files), out=out)
        if convention:
            yield convention
            return
    if resume and not step_resume:
        # As torchtune resolves them: its full fine-tune resumes from the weights it saved.
        directory = Path(str(ck.get("output_dir", directory)))
    for name in _listed(files):
        path = directory / name
        if not path.is_file():
            there = weight_files(directory)
            yield (f"checkpointer.checkpoint_files: {name} is not in {directory}. List the files that are there"
                   + (f" (weight files: {', '.join(there[:8])}{', ...' if len(there) > 8 else ''})." if there else
                      "; it holds no .safetensors or .bin file."))
        elif path.suffix == ".safetensors":
            why = safetensors_problem(path)
            if why:
                yield f"checkpointer.checkpoint_files: {path} is not a complete safetensors file: {why}. Download it again."


def _dataset_problems(cfg_dataset: Any, key: str) -> Iterable[str]:
    if isinstance(cfg_dataset, (list, ListConfig)):
        for i, entry in enumerate(cfg_dataset):
            yield from _dataset_problems(entry, f"{key}[{i}]")
        return
    if not isinstance(cfg_dataset, DictConfig) or str(cfg_dataset.get("source", "")) not in _LOCAL_SOURCES:
        return  # a Hub dataset or a component with its own inputs
    data_dir = cfg_dataset.get("data_dir")
    for name in _listed(cfg_dataset.get("data_files")):
        if not _is_local_path(name):
            continue
        path = Path(name) if data_dir is None else Path(str(data_dir)) / name
        if not path.is_file():
            yield f"{key}.data_files: {path} not found. Build it or point the key at your data file."
        elif cfg_dataset.source == "json":
            why = _json_problem(path)
            if why:
                yield f"{key}.data_files: {path} cannot be read as JSON or JSON Lines: {why}."


def _earlier_run_problems(cfg: DictConfig) -> Iterable[str]:
    """A fresh run must not replace the checkpoints an earlier run left in its output folder."""
    if cfg.get("resume_from_checkpoint") is True or cfg.get("overwrite_checkpoints") is True:
        return
    out = Path(str(OmegaConf.select(cfg, "checkpointer.output_dir", default=None) or cfg.get("output_dir", ".")))
    if not out.is_dir():
        return
    found = sorted(p.name for p in out.iterdir() if re.match(r"^epoch_\d+$", p.name) or p.name == "recipe_state")
    found += [f"{CHECKPOINTS_DIR}/{name}" for name in checkpoint_folders(out)]
    if found:
        # Resuming is offered only where the resume check would let it: a checkpoint, and a run not finished.
        finished = final_weights(cfg)
        if finished is not None:
            resume = f"It finished ({finished} holds its final weights), so nothing is left to resume. Write"
        elif newest_checkpoint(run_output_dir(cfg)):
            resume = "Resume it with resume_from_checkpoint=True, write"
        else:
            resume = "It left no checkpoint to resume from (it stopped before its first). Write"
        yield (f"output_dir: {out} holds the checkpoints of an earlier run ({', '.join(found[:4])}). {resume} "
               "elsewhere with output_dir=..., or replace them with overwrite_checkpoints=True.")


def file_problems(cfg: DictConfig, *, step_resume: bool = False, world_size: Optional[int] = None) -> List[str]:
    """Every problem with the files ``cfg`` names: checkpoint, tokenizer, local dataset files.

    Args:
        cfg: the recipe config.
        step_resume: the recipe resumes from step checkpoints (``output_dir/checkpoints``) and
            reads the configured weights from ``checkpoint_dir`` even then; else it resumes as
            torchtune does, from the weights and recipe state saved in ``output_dir``.
        world_size: the distributed recipe's rank count (a checkpoint to resume must have been
            written with it); ``None`` for a single-device recipe.
    """
    resume = cfg.get("resume_from_checkpoint") is True
    problems = list(_checkpoint_problems(cfg.checkpointer, resume=resume, step_resume=step_resume,
                                         out=run_output_dir(cfg)))
    if resume and step_resume and not any("torchtune's" in p for p in problems):
        missing = no_checkpoint_problem(cfg, world_size=world_size)
        if missing:
            problems.append(missing)
    for key in ("path", "special_tokens_path", "merges_file"):
        value = OmegaConf.select(cfg, f"tokenizer.{key}")
        if value is not None and not Path(str(value)).is_file():
            problems.append(f"tokenizer.{key}={value}: no such file. Point it at the tokenizer files of "
                            "the checkpoint (original/tokenizer.model for Llama 3).")
    problems.extend(_dataset_problems(cfg.dataset, "dataset"))
    problems.extend(_earlier_run_problems(cfg))
    return problems


def check_files(cfg: DictConfig, *, step_resume: bool = False, world_size: Optional[int] = None) -> None:
    """Raises one ``ConfigError`` (a ``ValueError``) listing every problem of :func:`file_problems`, if any."""
    problems = file_problems(cfg, step_resume=step_resume, world_size=world_size)
    if problems:
        raise ConfigError("Files the config names cannot be used:\n  - " + "\n  - ".join(problems))
