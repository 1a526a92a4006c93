"""Every check a recipe makes before it loads anything, their problems named in one error.

The three checks (the config, the host's memory, the files the config names) used to stop at the
first that failed, so a user who fixed a misspelt key then met a missing file on the next try.
Now each check that can run does: the host-memory one needs the config's settings, so a bad
config is reported with its files' problems only. The host-memory check comes before the files',
as it did alone: it needs no file, so a machine too small for the model is named before anyone
downloads the weights.
"""

from typing import Callable, List, Optional, Tuple

from omegaconf import DictConfig

from torchtune_offload.recipe.checks.config import ConfigError, RecipeSettings, check_recipe_config
from torchtune_offload.recipe.checks.file_checks import check_files
from torchtune_offload.recipe.checks.fit import HostMemoryNeed

#: Checks the host's memory for the checked settings (``check_host_memory`` with the recipe's options).
HostCheck = Callable[[RecipeSettings], Optional[HostMemoryNeed]]


def preflight(cfg: DictConfig, *, recipe: str, check_host: Optional[HostCheck] = None, step_resume: bool = True,
              world_size: Optional[int] = None,
              device_present: bool = True) -> Tuple[RecipeSettings, Optional[HostMemoryNeed]]:
    """Checks ``cfg`` for ``recipe``, the host's memory for it and the files it names.

    Args:
        cfg: the recipe config.
        recipe: which recipe reads it ("full", "lora" or "distributed").
        check_host: the host-memory check, given the settings once the config passes; None skips
            it (``tune-offload validate`` checks a config, not this machine).
        step_resume: as for :func:`~torchtune_offload.recipe.checks.file_checks.check_files`.
        world_size: as for :func:`~torchtune_offload.recipe.checks.file_checks.check_files`.
        device_present: as for :func:`~torchtune_offload.recipe.checks.config.check_recipe_config` (the
            sweep passes False: its own process must not start CUDA).

    Returns:
        The settings the config check read and the host-memory need (None when not checked).

    Raises:
        ConfigError: listing the problems of every check that found some, in the order above.
    """
    errors: List[str] = []
    settings = need = None
    try:
        settings = check_recipe_config(cfg, recipe=recipe, device_present=device_present)
    except ConfigError as err:
        errors.append(str(err))
    if settings is not None and check_host is not None:
        try:
            need = check_host(settings)
        except ConfigError as err:
            errors.append(str(err))
    try:
        check_files(cfg, step_resume=step_resume, world_size=world_size)
    except ConfigError as err:
        errors.append(str(err))
    except Exception:  # noqa: BLE001 - a config too malformed to find its files in: its own problems say why
        if not errors:
            raise
    if errors:
        raise ConfigError("\n".join(errors))
    return settings, need
