"""``tune-offload``: torchtune's verbs for torchtune-offload's recipes and configs, from any directory.

torchtune 0.6.1's ``tune`` keeps a fixed list of its own recipes and has no plugin hook, so this
command finds ours (:mod:`torchtune_offload.recipe.shipped`) and hands each run to torchtune's own
``tune run`` machinery: in this process for one device, through torchrun when torchrun options such
as ``--nproc_per_node`` come before the recipe, exactly as ``tune run`` launches its built-in
recipes. ``download`` is torchtune's ``tune download``; ``plan`` is the memory planner
(``python -m torchtune_offload.plan``) and ``probe`` measures a machine for it.
"""

import argparse
import difflib
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torchtune._cli.download import Download
from torchtune._cli.run import Run
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args

from torchtune_offload.assets import missing_tiny_assets
from torchtune_offload.bench.variants import legend
from torchtune_offload.plan.__main__ import main as plan_main
from torchtune_offload.plan.probe import run_probe
from torchtune_offload.recipe import ConfigError, preflight
from torchtune_offload.recipe.checks.component_options import (
    component_option_problems,
    component_removal_problem,
    model_option_problems,
    unchecked_options,
)
from torchtune_offload.recipe.dataset_build import dataset_build_problems
from torchtune_offload.recipe.reports.disk_log import has_disk_log, read_disk_log, runs_inside
from torchtune_offload.recipe.reports.run_report import compare_runs
from torchtune_offload.recipe.shipped import RECIPE_KINDS, Shipped, shipped_root, torchtune_config

PROG = "tune-offload"
#: The config keys that name files a run reads (what the missing-assets hint looks at).
_FILE_KEYS = ("tokenizer.path", "tokenizer.special_tokens_path", "dataset.data_files", "checkpointer.checkpoint_dir")
_NULL = "<>"

EPILOG = textwrap.dedent(f"""\
    examples:
        $ {PROG} ls
        $ {PROG} cp tiny/full ./my.yaml
        $ python -m torchtune_offload.assets        # the tiny offline assets, once
        $ {PROG} run full_finetune_single_device --config tiny/full max_steps_per_epoch=2
        $ {PROG} run full_finetune_single_device --config ./my.yaml
        $ {PROG} run --nproc_per_node 2 full_finetune_distributed --config tiny/full_distributed device=cpu
        $ {PROG} validate --config tiny/full
        $ {PROG} download meta-llama/Llama-3.2-1B-Instruct --output-dir /tmp/Llama-3.2-1B-Instruct
        $ {PROG} plan --config llama3_1/8B_full_offload_engine --device-gib 16   # will it fit?
        $ {PROG} probe --output machine.json        # this machine's rates, for the planner's --machine
        $ {PROG} probe --output machine.json --gpu-from rtx4090_ddr5   # no GPU here: the GPU keys from a preset
    """)


class UsageError(ValueError):
    """Bad input to a verb: printed with the verb's name, exit status 2."""


def _shipped() -> Shipped:
    try:
        return Shipped(shipped_root())
    except FileNotFoundError as err:
        raise UsageError(str(err)) from err


def load_config(path: Path, overrides: Sequence[str]) -> DictConfig:
    """The config a recipe would see: the YAML at ``path`` with ``key=value`` / ``~key`` overrides.

    Parsed by torchtune's own argument parser and merge, as ``@config.parse`` does in a recipe.

    Raises:
        UsageError: for a file that is not YAML, or whose top level is not a mapping of keys, and
            for a ``~key`` of a component, which torchtune cannot delete.
    """
    data = _yaml_mapping(path)  # torchtune's parser would raise a YAML error or a TypeError, with a traceback
    removal = component_removal_problem(data, overrides)
    if removal is not None:
        raise UsageError(removal)
    parser = TuneRecipeArgumentParser(prog=PROG, add_help=False)
    yaml_args, cli_args = parser.parse_known_args(["--config", str(path), *overrides])
    return _merge_yaml_and_cli_args(yaml_args, cli_args)


def _yaml_mapping(path: Path) -> dict:
    """The YAML file at ``path``, which must hold a mapping of config keys.

    Raises:
        UsageError: naming the file, and the line of a YAML error.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if isinstance(data, dict) and data:
            OmegaConf.load(path)  # as torchtune reads it: OmegaConf also refuses a key given twice
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{path}: not a YAML config{line}: {reason}.") from err
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not a YAML config (not UTF-8 text).") from err
    except OmegaConfBaseException as err:  # e.g. an interpolation that does not parse: ${foo
        raise UsageError(f"{path}: torchtune's OmegaConf cannot read it: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict) or not data:
        kinds = {"str": "text", "int": "a number", "float": "a number", "bool": "true or false"}
        held = ("nothing" if data is None else "no keys" if isinstance(data, dict)
                else kinds.get(type(data).__name__, "a " + type(data).__name__))
        raise UsageError(f"{path}: a config is a mapping of keys (model:, optimizer:, ...), and this file holds "
                         f"{held}.")
    return data


def _assets_problem(cfg: DictConfig) -> Optional[str]:
    paths = [OmegaConf.select(cfg, key, default=None) for key in _FILE_KEYS]
    return missing_tiny_assets(paths=[str(p) for p in paths if isinstance(p, str)])


# --- ls, cp, cat -------------------------------------------------------------------------------

def _ls(args: argparse.Namespace) -> int:
    print(f"{'RECIPE':<40} CONFIG")
    for recipe, configs in _shipped().configs_by_recipe().items():
        label = recipe if recipe is not None else f"{_NULL} (its header names none of our recipes)"
        for i, config in enumerate(configs or [_NULL]):
            print(f"{label if i == 0 else '':<40} {config}")
    return 0


def _cp(args: argparse.Namespace) -> int:
    shipped = _shipped()
    config = shipped.configs.get(args.file) or torchtune_config(args.file)  # ours first, then torchtune's
    if args.file in shipped.recipes:
        src, suffix = shipped.recipes[args.file], ".py"
    elif config is not None:
        src, suffix = config, ".yaml"
    else:
        near = difflib.get_close_matches(args.file, [*shipped.recipes, *shipped.configs], n=3, cutoff=0.8)
        raise UsageError(
            f"no recipe or config named '{args.file}'." + (f" Did you mean {' or '.join(near)}?" if near else "")
            + f" Recipes: {', '.join(shipped.recipes)}. Configs: {', '.join(shipped.configs)}."
        )
    dest = Path(args.destination)
    if dest.is_dir():
        dest = dest / src.name
    elif dest.suffix != suffix:
        dest = dest.with_suffix(suffix)  # as tune cp does: a config stays a .yaml, a recipe a .py
    if args.no_clobber and dest.exists():
        print(f"File already exists at {dest.absolute()}, not overwriting.")
        return 0
    if dest.exists() and not args.force:
        # tune cp overwrites; here a user's edited config is not lost by a second cp of the same name.
        renamed = "" if dest == Path(args.destination) else f" ({args.destination} with its {suffix} suffix)"
        raise UsageError(f"{dest} already exists{renamed}: pass --force to overwrite it, or give another name.")
    if args.make_parents:
        dest.parent.mkdir(parents=True, exist_ok=True)
    elif not dest.parent.is_dir():
        raise UsageError(f"cannot write {dest}: no folder {dest.parent}. Create it, or pass --make-parents.")
    print(f"Copied file to {shutil.copy(src, dest)}")
    return 0


def _cat(args: argparse.Namespace) -> int:
    shipped = _shipped()
    if args.config in shipped.recipes:
        raise UsageError(f"'{args.config}' is a recipe; cat prints configs. Copy the recipe with: {PROG} cp {args.config} .")
    data = _yaml_mapping(shipped.config(args.config))  # read as tune cat reads it (5e-3 stays a string)
    print(yaml.dump(data, default_flow_style=False, sort_keys=args.sort, indent=4, width=100), end="")
    return 0


# --- validate ----------------------------------------------------------------------------------

def _split_config(tokens: List[str], flag: Optional[str]) -> Tuple[str, List[str]]:
    """The config named by ``--config`` or by the first token that is not an override; the overrides."""
    if flag is not None:
        return flag, tokens
    for i, token in enumerate(tokens):
        if "=" not in token and not token.startswith("~"):
            return token, tokens[:i] + tokens[i + 1:]
    raise UsageError(f"name a config: {PROG} validate --config <name or path> [key=value ...]; {PROG} ls lists them.")


def _validate(args: argparse.Namespace) -> int:
    shipped = _shipped()
    name, overrides = _split_config(args.rest, args.config)
    path = shipped.config(name)
    recipe = args.recipe or shipped.recipe_of(path)
    if recipe is not None and recipe not in RECIPE_KINDS:
        raise UsageError(f"--recipe {recipe}: not one of our recipes ({', '.join(RECIPE_KINDS)}).")
    cfg = load_config(path, overrides)
    missing = _assets_problem(cfg)
    if missing:
        print(f"{PROG} validate: {missing}", file=sys.stderr)
        return 1
    # What tune validate checks (every _component_ accepts the options the config gives it), without
    # its tracebacks, and the model's values; with a recipe, preflight below checks all that.
    problems = [] if recipe is not None else component_option_problems(cfg, skip=("model",)) + model_option_problems(cfg)
    unbuilt: List[str] = []
    if recipe is not None:
        try:  # a distributed run's checkpoint to resume depends on the rank count, unknown here
            preflight(cfg, recipe=RECIPE_KINDS[recipe], step_resume=RECIPE_KINDS[recipe] != "distributed")
        except ValueError as err:
            problems.append(str(err))
        if not problems:
            # The values torchtune hands to the datasets library (source, split, column_map): as the
            # recipe builds the data before reading weights. A Hub dataset is not downloaded for this.
            built, unbuilt = dataset_build_problems(cfg)
            problems += built
    if problems:
        print(f"{PROG} validate: {path} does not pass:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    checked = (f"as {recipe} reads it (keys, values, files{', data' if not unbuilt else ''})" if recipe is not None else
               "(component arguments only: its header names none of our recipes; pass --recipe to check more)")
    print(f"Config is well-formed: {path} {checked}.")
    if unbuilt:
        print(f"Not built here, so their values (source, split, column_map) are not checked: {', '.join(unbuilt)} "
              "(a Hub dataset: building it downloads it). A run builds it before it reads any weight.")
    # A dataset built above took its options (load_dataset refuses an unknown one).
    built_data = recipe is not None and not unbuilt
    unchecked = [k for k in unchecked_options(cfg) if not (built_data and k.startswith("dataset"))]
    if unchecked:
        print(f"Passed on by their component to another library (a dataset's to load_dataset), so their names are "
              f"not checked here: {', '.join(unchecked)}. A run names an unknown one when it builds the component, "
              "before it reads any weight.")
    return 0


# --- probe ------------------------------------------------------------------------------------

def _probe(args: argparse.Namespace) -> int:
    if args.output is not None and args.output.parent and not args.output.parent.is_dir():
        raise UsageError(f"--output {args.output}: no such folder {args.output.parent}")
    if args.output is not None and args.output.is_dir():
        raise UsageError(f"--output {args.output}: is a folder; give a file's path, "
                         f"e.g. {args.output / 'machine.json'}")
    if args.output is not None and args.output.exists() and not args.force:
        # Checked before measuring; docs/planner.md invites editing this file by hand.
        raise UsageError(f"--output {args.output} already exists: pass --force to overwrite it, or give another name.")
    print(run_probe(args.output, gpu_from=args.gpu_from))  # an unknown preset: a ValueError before measuring
    return 0


# --- compare ----------------------------------------------------------------------------------

def _compare(args: argparse.Namespace) -> int:
    runs = {}
    for spec in args.runs:
        for name, path in _named_runs(spec):
            if name in runs:
                raise UsageError(f"{name!r} is named twice: give each run its own name (NAME=OUTPUT_DIR)")
            runs[name] = path
    try:
        print(compare_runs(runs))
    except FileNotFoundError as err:  # no log file where a run should have written one
        raise UsageError(str(err)) from err
    named = legend(runs)
    if named:
        print(named)
    return 0


def _named_runs(spec: str) -> List[Tuple[str, str]]:
    """The runs ``compare`` reads for one argument: NAME=OUTPUT_DIR, or a path alone: a run's
    output_dir or logs folder (named by the run's folder), a sweep's output folder (each of its
    variants that logged a step, named as the sweep names them) or a DiskLogger file (named by the file)."""
    given = Path(spec)
    name, sep, path = spec.partition("=")
    if sep and not given.exists():  # a path may hold '=' too
        if not name or not path:
            raise UsageError(f"{spec!r}: give NAME=OUTPUT_DIR, e.g. offload=runs/offload")
        return [(name, path)]
    if given.is_file():  # a DiskLogger file itself
        return [(given.stem, spec)]
    if not given.is_dir():
        raise UsageError(f"{spec!r}: no such folder. Give a run's or a sweep's output folder, or NAME=OUTPUT_DIR, "
                         "e.g. offload=runs/offload")
    if has_disk_log(given):
        run = given.resolve()
        return [((run.parent if run.name == "logs" else run).name, spec)]
    inside = runs_inside(given)
    if not inside:
        try:
            read_disk_log(given)  # raises, naming what the folder holds instead (a W&B-only run, say)
        except FileNotFoundError as err:
            raise UsageError(str(err)) from err
    # A sweep's variant that did not train has its run.log and no step logged (its log file, if the
    # recipe got as far as making one, is empty): said, not left out unseen.
    logged = [run for run in inside if read_disk_log(run)]
    untrained = sorted(d.name for d in given.iterdir() if d not in logged and (d / "run.log").is_file())
    if untrained:
        print(f"{spec}: not compared, no step logged (see their run.log): {', '.join(untrained)}", file=sys.stderr)
    if not logged:
        raise UsageError(f"{spec!r}: none of its runs logged a step")
    return [(run.name, str(run)) for run in logged]


# --- run, download -----------------------------------------------------------------------------

def _run(argv: List[str]) -> int:
    top = argparse.ArgumentParser(prog=PROG)
    runner = Run(top.add_subparsers())
    parser = runner._parser
    parser.prog = f"{PROG} run"
    parser.usage = f"{PROG} run [TORCHRUN-OPTIONS] <recipe> --config <config> [RECIPE-OPTIONS]"
    parser.epilog = EPILOG
    for action in parser._actions:  # torchtune's help points at tune ls, which lists only torchtune's recipes
        if action.dest == "recipe":
            action.help = f"a recipe's name ({PROG} ls lists them with their configs) or a recipe file's path"
        elif action.dest == "recipe_args":
            action.help = "--config <name or path> and key=value overrides, passed to the recipe"
    args = parser.parse_args(argv)
    # torchtune's own rule: anything before the recipe is a torchrun option, so torchrun launches it.
    distributed = len(argv) > len(args.recipe_args) + 1
    try:
        shipped = _shipped()
        recipe_path = shipped.recipe(args.recipe)
        if distributed and RECIPE_KINDS.get(args.recipe, "distributed") != "distributed":
            raise UsageError(f"{args.recipe} runs on one device: torchrun options (--nproc_per_node ...) are "
                             f"for {', '.join(k for k, v in RECIPE_KINDS.items() if v == 'distributed')}.")
        recipe_args = list(args.recipe_args)
        at = _config_index(recipe_args, args.recipe, shipped)
        config_path = shipped.config(recipe_args[at])
        recipe_args[at] = str(config_path)
        missing = _assets_problem(load_config(config_path, recipe_args[:at - 1] + recipe_args[at + 1:]))
        if missing:
            raise UsageError(missing)
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err
    args.recipe, args.recipe_args = str(recipe_path), recipe_args
    sys.path.append(os.getcwd())  # as tune run does: components defined in the working directory import
    if distributed:
        runner._run_distributed(args, is_builtin=True)  # a script path, run by torchrun
        return 0
    try:
        runner._run_single_device(args, is_builtin=True)  # runpy, as tune run runs its own recipes
    except ConfigError as err:  # the recipe refused its config before training: the message is the news
        print(f"{PROG} run: error: {err}", file=sys.stderr)
        return 1
    return 0


def _config_index(recipe_args: List[str], recipe: str, shipped: Shipped) -> int:
    """The position of the config's value in ``recipe_args`` (``--config=x`` is split in place)."""
    for i, token in enumerate(recipe_args):
        if token.startswith("--config="):
            recipe_args[i:i + 1] = ["--config", token.split("=", 1)[1]]
    if "--config" not in recipe_args or recipe_args.index("--config") + 1 == len(recipe_args):
        mine = shipped.configs_by_recipe().get(recipe) or list(shipped.configs)
        raise UsageError(f"--config <name or path> is required. Configs for {recipe}: {', '.join(mine)}.")
    return recipe_args.index("--config") + 1


def _download(argv: List[str]) -> int:
    top = argparse.ArgumentParser(prog=PROG)
    parser = Download(top.add_subparsers())._parser
    parser.prog, parser.usage = f"{PROG} download", f"{PROG} download <repo-id> [OPTIONS]"
    parser.epilog = parser.epilog.replace("$ tune download", f"$ {PROG} download")
    args = parser.parse_args(argv)
    args.func(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line of every verb but ``run``, ``download`` and ``plan`` (listed here for ``--help``)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="torchtune's verbs for torchtune-offload's recipes and configs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=lambda args: parser.print_help() or 0)
    verbs = parser.add_subparsers(title="verbs", metavar="{ls,cp,cat,validate,run,download,plan,probe,compare}")
    verbs.add_parser("ls", help="list our recipes and their configs").set_defaults(func=_ls)
    cp = verbs.add_parser("cp", help="copy a recipe or config to a local path")
    cp.add_argument("file", help="a recipe or config name (tune-offload ls lists them)")
    cp.add_argument("destination", help="a file or folder; a config keeps .yaml, a recipe .py")
    cp.add_argument("-n", "--no-clobber", action="store_true",
                    help="an existing file is left as it is, and the copy skipped (exit 0)")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file (refused without it)")
    cp.add_argument("--make-parents", action="store_true", help="create the destination's missing folders")
    cp.set_defaults(func=_cp)
    cat = verbs.add_parser("cat", help="print a config (by name or path)")
    cat.add_argument("config")
    cat.add_argument("--sort", action="store_true", help="sort the keys")
    cat.set_defaults(func=_cat)
    validate = verbs.add_parser(
        "validate", help="check a config (and key=value overrides) as its recipe would, files included")
    validate.add_argument("--config", help="a config name or path (or give it as the first argument)")
    validate.add_argument("--recipe", choices=sorted(RECIPE_KINDS),
                          help="check as this recipe reads it (default: the recipe the config's header names)")
    validate.add_argument("rest", nargs="*", metavar="config|key=value")
    validate.set_defaults(func=_validate)
    verbs.add_parser("run", add_help=False,
                     help="run a recipe: [TORCHRUN-OPTIONS] <recipe> --config <config> [key=value ...]")
    verbs.add_parser("download", add_help=False, help="torchtune's tune download")
    verbs.add_parser("plan", add_help=False, help="will a run fit, and how fast: python -m torchtune_offload.plan "
                     "(--config <name or path> [key=value ...] [--device-gib N] [--machine PRESET])")
    probe = verbs.add_parser(
        "probe", help="measure this machine's rates for the planner's speed model "
        "(python -m torchtune_offload.plan --machine machine.json)",
        description="Measures the rates the planner's step-time model reads, in about a minute: on the host, "
        "memory copies and the optimizer steps (torch's fused bf16 AdamW, AdamW8bit, the fused fp32-master "
        "pass) over every core; where CUDA is present, the GPU's bf16 rate in a small Llama's training step, "
        "pinned PCIe copies both ways and a bitsandbytes step's synchronizations. It prints them, and writes "
        "them with --output. Without CUDA it names the GPU keys to take from a preset (--gpu-from).")
    probe.add_argument("--output", type=Path, help="write them to this JSON file (a new one, unless --force)")
    probe.add_argument("--force", action="store_true", help="overwrite an existing --output file")
    probe.add_argument("--gpu-from", metavar="PRESET",
                       help="fill in the keys this machine cannot measure (no CUDA device: the GPU's) from this "
                            "preset, so that --output is a whole machine for the planner's --machine")
    probe.set_defaults(func=_probe)
    compare = verbs.add_parser(
        "compare", help="loss curves, tok/s and peak memory of finished runs, side by side",
        description="Reads each run's metric log (OUTPUT_DIR/logs/log_*.txt: the newest, after the earlier ones "
        "of the run it resumed from a step checkpoint) and prints "
        "the losses of the steps every run logged, the largest difference between them, and each run's median "
        "tok/s (after its first step) and peak memory figures.")
    compare.add_argument("runs", nargs="+", metavar="NAME=OUTPUT_DIR",
                         help="a name for each run and its output_dir; or a path alone: a run's output_dir, named "
                              "by its folder, a sweep's output folder, which gives each of its variants, or a "
                              "DiskLogger file")
    compare.set_defaults(func=_compare)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tune-offload`` console script.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 1 when ``validate`` finds problems, 2 on bad input.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv[0] if argv else None
    try:
        if verb == "run":
            return _run(argv[1:])  # the recipe's own errors keep their traceback
        if verb == "download":
            return _download(argv[1:])
        if verb == "plan":
            return plan_main(argv[1:], prog=f"{PROG} plan")  # its own argument errors exit 2 through argparse
        args = build_parser().parse_args(argv)
        try:
            return args.func(args)
        except ValueError as err:  # a name or file shipped.py could not find
            raise UsageError(str(err)) from err
    except UsageError as err:
        print(f"{PROG} {verb}: error: {err}", file=sys.stderr)
        return 2
