"""Benchmarking: optimizer variants side by side (:mod:`.sweep`) on a GPU limited by a ballast (:mod:`.ballast`)."""
