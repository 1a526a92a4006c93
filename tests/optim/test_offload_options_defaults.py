"""OffloadOptions.parse takes, for an option not given, OffloadOptimizer's own default: the two are
written in two signatures (the constructor documents its options), so a test holds them together."""

import inspect

from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim.offload_options import OffloadOptions


def test_parse_defaults_are_the_constructors():
    constructor = {name: p.default for name, p in inspect.signature(OffloadOptimizer.__init__).parameters.items()
                   if p.kind is p.KEYWORD_ONLY}
    parse = {name: p.default for name, p in inspect.signature(OffloadOptions.parse).parameters.items()
             if p.kind is p.KEYWORD_ONLY}
    assert parse == constructor
    assert OffloadOptions.parse() == OffloadOptions.parse(**constructor)
