"""Model builders the planner must refuse in one line: named by ``model._component_`` in tests/plan/test_qlora.py."""

import torch
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_offload.models import tiny_llama


class TaggedTensor(torch.Tensor):
    """A tensor subclass the planner does not know (as a new quantisation library's would be)."""


def tiny_llama_with_tagged_embedding() -> TransformerDecoder:
    """The tiny Llama whose token embedding is a :class:`TaggedTensor`."""
    model = tiny_llama()
    weight = model.tok_embeddings.weight
    model.tok_embeddings.weight = nn.Parameter(torch.Tensor._make_subclass(TaggedTensor, weight.detach()))
    return model


class _RefusingDecoder(nn.Module):
    """A decoder whose forward fails, as an operator with no fake-tensor kernel does."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)

    def set_num_output_chunks(self, num_output_chunks: int) -> None:
        pass  # as torchtune's decoders take it, so that the trace reaches forward

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no kernel for this operator on fake tensors")


def refusing_decoder() -> nn.Module:
    """A model whose training step cannot be traced."""
    return _RefusingDecoder()
