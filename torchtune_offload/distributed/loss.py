"""The chunked cross-entropy loss for a decoder whose output projection is an FSDP2 unit."""

import torch
from torch import nn


class RowChunkedLoss(nn.Module):
    """torchtune's ``CEWithChunkedOutputLoss`` for logits projected in one call.

    With the output projection as a unit of its own, the decoder must not call it once per chunk
    (``set_num_output_chunks``): each call gathers and reduces the unit again, and the number of
    chunks, ``ceil``-divided from each rank's padded sequence length, can differ between ranks,
    whose collectives then no longer pair up. The projection runs once; this loss upcasts the
    logits one chunk of rows at a time, as the chunked loss does, to the same sum over tokens.

    Args:
        loss: the configured ``CEWithChunkedOutputLoss``.
    """

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss
        self.ignore_index = loss.ignore_index
        self.num_output_chunks = loss.num_output_chunks

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``logits`` ``(tokens, vocab)`` and ``labels`` ``(tokens,)``, as the train loop flattens them."""
        total = sum(
            self.loss.compute_cross_entropy(lc, yc)
            for lc, yc in zip(logits.chunk(self.num_output_chunks), labels.chunk(self.num_output_chunks))
        )
        return total / (labels != self.ignore_index).sum()
