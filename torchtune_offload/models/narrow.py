"""Real Llama architectures at a small width: each model's layers, parameter tensors and ops as
torchtune builds them (depth, tied embedding, grouped-query attention), with the arithmetic of each
op made small. For benchmarks of what grows with the layers and tensors rather than with the width:
the host's cost of dispatching a pass, or of a hook per parameter.
"""

import argparse
import time
from typing import Callable, List, Tuple

import torch
from torchtune import training
from torchtune.models.llama3_1 import llama3_1
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer

__all__ = ["NARROW_MODELS", "checkpointed_llama", "chosen_models", "models_and_steps", "narrow_llama", "one_sequence",
           "pass_seconds"]

#: Short name -> (the model's name, torchtune's component builder, its depth and embedding tying).
NARROW_MODELS = {
    "1B": ("llama3_2 1B", llama3_2, dict(num_layers=16, tie_word_embeddings=True)),
    "3B": ("llama3_2 3B", llama3_2, dict(num_layers=28, tie_word_embeddings=True)),
    "8B": ("llama3_1 8B", llama3_1, dict(num_layers=32)),
}
#: The vocabulary of every narrowed model.
VOCAB_SIZE = 1024


def narrow_llama(name: str, *, width: int, max_seq_len: int = 64) -> TransformerDecoder:
    """The architecture of ``name`` (a key of :data:`NARROW_MODELS`) at embedding width ``width``
    (4 heads, 2 of keys and values, an MLP twice as wide), a vocabulary of :data:`VOCAB_SIZE`.

    Raises:
        ValueError: for a name not in :data:`NARROW_MODELS`.
    """
    chosen_models(name)
    _, build, depth = NARROW_MODELS[name]
    return build(vocab_size=VOCAB_SIZE, num_heads=4, num_kv_heads=2, embed_dim=width, max_seq_len=max_seq_len,
                 intermediate_dim=2 * width, **depth)


def checkpointed_llama(name: str, *, width: int, max_seq_len: int) -> TransformerDecoder:
    """:func:`narrow_llama` in bf16 with activation checkpointing on every layer, as the recipes set
    it, its weights drawn after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    model = narrow_llama(name, width=width, max_seq_len=max_seq_len).to(torch.bfloat16)
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    return model


def one_sequence(tokens: int) -> torch.Tensor:
    """A batch of one sequence of ``tokens`` token ids below :data:`VOCAB_SIZE`, the same every call."""
    return torch.randint(0, VOCAB_SIZE, (1, tokens), generator=torch.Generator().manual_seed(0))


def pass_seconds(model: torch.nn.Module, tokens: torch.Tensor, *, steps: int,
                 sync: Callable[[], None] = lambda: None) -> Tuple[List[float], List[float]]:
    """Seconds of each forward (to the loss, a mean of the logits) and each backward of ``steps``
    training steps of ``model`` on ``tokens``, each pass ending with ``sync()`` (a device's
    synchronization; nothing on the CPU)."""
    forward, backward = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(tokens).float().mean()
        sync()
        middle = time.perf_counter()
        loss.backward()
        sync()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return forward, backward


def chosen_models(names: str) -> List[str]:
    """``names`` (comma-separated keys of :data:`NARROW_MODELS`) as a list.

    Raises:
        ValueError: naming the unknown ones and the choices.
    """
    models = names.split(",")
    unknown = [m for m in models if m not in NARROW_MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; use some of {', '.join(NARROW_MODELS)}")
    return models


def models_and_steps(description: str, *, models: str, steps: int, steps_help: str) -> Tuple[List[str], int]:
    """The command line of a benchmark over narrowed models: ``--models`` and ``--steps``, parsed as
    argparse does (a bad value exits with status 2, naming it and the choices).

    Args:
        description: the script's help text.
        models: the default ``--models``.
        steps: the default ``--steps``.
        steps_help: what a step is, for ``--steps``' help.

    Returns:
        ``(models, steps)``: the chosen keys of :data:`NARROW_MODELS`, and the steps (at least 1).
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=models, help="comma-separated, of " + ", ".join(NARROW_MODELS))
    parser.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    args = parser.parse_args()
    try:
        chosen = chosen_models(args.models)
    except ValueError as err:
        parser.error(str(err))
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return chosen, args.steps
