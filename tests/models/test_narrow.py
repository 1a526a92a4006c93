"""``models/narrow.py``: real Llama architectures at a small width, with their parameter tensors."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from torchtune_offload.models.narrow import (
    NARROW_MODELS,
    VOCAB_SIZE,
    checkpointed_llama,
    chosen_models,
    models_and_steps,
    narrow_llama,
    one_sequence,
    pass_seconds,
)


@pytest.mark.parametrize("name, layers, tensors", [("1B", 16, 146), ("3B", 28, 254), ("8B", 32, 291)])
def test_a_narrowed_model_keeps_its_layers_and_parameter_tensors(name, layers, tensors):
    """9 tensors a layer, the embedding and the final norm, and the 8B's untied output."""
    model = narrow_llama(name, width=64)
    assert len(model.layers) == layers
    assert len(list(model.parameters())) == tensors
    assert model.tok_embeddings.embedding_dim == 64


def test_model_names_are_checked_naming_the_choices():
    assert chosen_models("8B,1B") == ["8B", "1B"]
    with pytest.raises(ValueError, match="--models: unknown 70B, 2B; use some of 1B, 3B, 8B"):
        chosen_models("1B,70B,2B")
    with pytest.raises(ValueError, match="unknown 70B"):
        narrow_llama("70B", width=64)
    assert set(NARROW_MODELS) == {"1B", "3B", "8B"}


def test_a_benchmark_command_line_gives_models_and_steps_or_exits_naming_the_problem(monkeypatch, capsys):
    def parse(*argv):
        monkeypatch.setattr("sys.argv", ["bench.py", *argv])
        return models_and_steps("a benchmark", models="1B,8B", steps=8, steps_help="timed steps")

    assert parse() == (["1B", "8B"], 8)
    assert parse("--models", "3B", "--steps", "2") == (["3B"], 2)
    for argv, message in ((("--models", "70B"), "--models: unknown 70B; use some of 1B, 3B, 8B"),
                          (("--steps", "0"), "--steps must be at least 1")):
        with pytest.raises(SystemExit) as exit_:
            parse(*argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_checkpointed_model_is_bf16_with_every_layer_checkpointed_and_the_same_each_time():
    model = checkpointed_llama("1B", width=64, max_seq_len=16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(model.layers) == 16 and all(isinstance(layer, CheckpointWrapper) for layer in model.layers)
    again = checkpointed_llama("1B", width=64, max_seq_len=16)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    tokens = one_sequence(16)
    assert tokens.shape == (1, 16) and int(tokens.max()) < VOCAB_SIZE and torch.equal(tokens, one_sequence(16))


def test_pass_seconds_times_each_pass_ends_it_with_sync_and_trains():
    model = checkpointed_llama("1B", width=64, max_seq_len=16)
    syncs = []
    forward, backward = pass_seconds(model, one_sequence(16), steps=3, sync=lambda: syncs.append(1))
    assert len(forward) == len(backward) == 3 and all(t > 0 for t in forward + backward)
    assert len(syncs) == 6  # one after each forward and each backward
    assert all(p.grad is not None for p in model.parameters())
