"""Building the configured datasets, with a failure named by its config key.

torchtune's dataset builders hand their values to the datasets library (``source``, ``split``,
``column_map``, and every option they do not take themselves, to ``load_dataset``), so the config
check can check their names but not their values: a misspelt loader, split or column fails only
when the data is built. The recipes build it before any weight is read; this turns the datasets
library's and torchtune's errors there into one :class:`ConfigError` naming the key and the fix.
``tune-offload validate`` builds local datasets the same way (:func:`dataset_build_problems`).
"""

import difflib
import inspect
import re
from pathlib import Path
from typing import Any, List, Optional, Tuple

from datasets import packaged_modules
from datasets.exceptions import DatasetsError
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

from torchtune_offload.recipe.checks.config import ConfigError

#: The datasets library's own loaders (``source: json`` with ``data_files``), which need no Hub.
#: Read from the library (a module-level table it keeps); empty if a release moves it.
LOADERS = tuple(sorted(getattr(packaged_modules, "_PACKAGED_DATASETS_MODULES", {})))


def build_dataset(cfg_dataset: DictConfig, tokenizer: Any, *, key: str) -> Any:
    """One configured dataset.

    Args:
        cfg_dataset: the dataset's config node.
        tokenizer: the model's tokenizer.
        key: the node's name in the config, for the error (``dataset``, ``dataset[1]``).

    Raises:
        ConfigError: naming the option (with the closest one the builder takes), ``split``,
            ``source`` or ``column_map``, where that is what the datasets library or torchtune
            refused, and what the error was.
    """
    try:
        return config.instantiate(cfg_dataset, tokenizer)
    except (TypeError, ValueError, ConnectionError, FileNotFoundError) as err:
        problem = _named_problem(cfg_dataset, err, key=key)
        if problem is None:
            raise
        raise ConfigError(problem) from err


def _named_problem(cfg_dataset: DictConfig, err: Exception, *, key: str) -> Optional[str]:
    """The message naming the key ``err`` comes from, or None where it cannot be told."""
    said, source = f"{type(err).__name__}: {err}", cfg_dataset.get("source")
    if isinstance(err, (ConnectionError, FileNotFoundError)):
        if source is None or str(source) not in str(err) or is_local(cfg_dataset):
            return None  # a data file: check_files names a missing one before this
        close = difflib.get_close_matches(str(source), LOADERS, n=1)
        hint = (f"Did you mean {key}.source={close[0]}?" if close else
                f"Name a Hub dataset, or one of the datasets library's loaders ({', '.join(LOADERS[:8])}, ...) "
                f"with {key}.data_files.")
        if isinstance(err, ConnectionError) and not close:
            # Offline, or the Hub out of reach: the name may well be right.
            hint = ("If it is a Hub dataset, this machine could not reach the Hub for it (offline?): download it "
                    "where the Hub can be reached, or point it at a local copy.")
        return (f"{key}.source={source}: neither one of the datasets library's loaders nor a local folder, and the "
                f"Hub could not give it ({said}). {hint}")
    split, columns = cfg_dataset.get("split"), cfg_dataset.get("column_map")
    if isinstance(err, ValueError) and split is not None and re.search(r"Unknown split|Bad split|[Ss]lice", str(err)) \
            and "split_across_pack" not in str(err):
        # The datasets library's own words ("Unknown split", a slice's bounds).
        return (f"{key}.split={split}: the datasets library cannot take it ({err}). Name one of the dataset's "
                "splits, optionally sliced (train, train[:90%]).")
    if isinstance(err, ValueError) and columns is not None and "column_map" in str(err):
        # torchtune's message transforms check the map's keys: "Expected a key of 'input' in column_map".
        return (f"{key}.column_map: torchtune's {cfg_dataset.get('_component_')} refuses it ({err}). Its keys are "
                "the builder's column names (for an instruct dataset: input, output; for a chat dataset: "
                "messages or conversations), its values the dataset's own columns.")
    # An unknown option: a local file's builder raises a TypeError, a Hub dataset's config a ValueError.
    stranger = re.search(r"unexpected keyword argument '(\w+)'|doesn't have a '(\w+)' key", str(err))
    name = None if stranger is None else stranger.group(1) or stranger.group(2)
    if name is None or name not in cfg_dataset:
        return None
    component = str(cfg_dataset.get("_component_"))
    own = [n for n, p in inspect.signature(_get_component_from_path(component)).parameters.items()
           if p.kind is not inspect.Parameter.VAR_KEYWORD and n != "tokenizer"]
    close = difflib.get_close_matches(name, own, n=1)
    hint = f"Did you mean '{key}.{close[0]}'?" if close else f"Its options: {', '.join(own)}."
    return (f"{key}.{name}: neither {component} nor the datasets library it passes options on to takes it "
            f"({said}). {hint}")


def is_local(cfg_dataset: DictConfig) -> bool:
    """Whether the dataset is read from this machine alone: its ``source`` is a loader of the
    datasets library (``json`` with ``data_files``) or a local folder, not a Hub id.

    Args:
        cfg_dataset: a dataset's config node.
    """
    source = cfg_dataset.get("source")
    return source is not None and (str(source) in LOADERS or Path(str(source)).expanduser().is_dir())


def dataset_nodes(cfg_dataset: Any) -> List[Tuple[str, DictConfig]]:
    """Each configured dataset with its key: one node, or a list of them (torchtune concatenates)."""
    if isinstance(cfg_dataset, ListConfig):
        return [(f"dataset[{i}]", c) for i, c in enumerate(cfg_dataset)]
    return [("dataset", cfg_dataset)]


def dataset_build_problems(cfg: DictConfig) -> Tuple[List[str], List[str]]:
    """What building the config's local datasets refuses, as a recipe would before reading weights,
    and the datasets not built here (a Hub dataset: building it would download it).

    Returns:
        The problems (each naming its key), and each dataset left unbuilt: its key and source, with
        the closest of the datasets library's loaders where one is close (a misspelt ``json``).
    """
    problems: List[str] = []
    nodes = dataset_nodes(cfg.dataset)
    local = [(key, node) for key, node in nodes if is_local(node)]
    if local:
        try:
            tokenizer = config.instantiate(cfg.tokenizer)
        except Exception as err:  # torchtune's own InstantiationError among them
            return [f"tokenizer: building it fails ({type(err).__name__}: {err}), so the data was not built."], []
        for key, node in local:
            try:
                # Unpacked: packing tokenizes the whole dataset, which checks nothing more.
                build_dataset(node if not node.get("packed") else OmegaConf.merge(node, {"packed": False}),
                              tokenizer, key=key)
            except ConfigError as err:
                problems.append(str(err))
            except (TypeError, ValueError, OSError, DatasetsError) as err:  # what build_dataset cannot tie to a key
                problems.append(f"{key}: building it fails ({type(err).__name__}: {err}).")
    unbuilt = []
    for key, node in nodes:
        if is_local(node):
            continue
        source = node.get("source")
        if source is None:  # a builder with its own source (torchtune's alpaca_dataset, say)
            unbuilt.append(f"{key} ({node.get('_component_')}'s own source, from the Hub)")
            continue
        close = difflib.get_close_matches(str(source), LOADERS, n=1)
        unbuilt.append(f"{key} (source={source}, from the Hub" +
                       (f"; or did you mean {key}.source={close[0]}?)" if close else ")"))
    return problems, unbuilt
