"""Unit tests of torchtune_offload.assets.data: the templated instruction examples."""

from __future__ import annotations

import json
from collections import Counter
from random import Random

from torchtune_offload.assets.data import TASKS, make_examples, write_examples

# The prompt prefix of each task in TASKS, in order.
_PREFIXES = (
    "Next letter after ", "Letter before ", "Reverse: ", "Sort: ", "Uppercase: ",
    "Say twice: ", "Capital of ", "Opposite of ", "Add ", "Count: ",
)  # fmt: skip


def _task_index(prompt: str) -> int:
    (index,) = [i for i, prefix in enumerate(_PREFIXES) if prompt.startswith(prefix)]
    return index


def test_same_seed_same_examples_other_seed_other_examples():
    first = make_examples(num_examples=50, seed=0)
    assert make_examples(num_examples=50, seed=0) == first
    assert make_examples(num_examples=50, seed=1) != first


def test_examples_are_balanced_across_tasks_and_shuffled():
    examples = make_examples(num_examples=200, seed=0)
    assert all(set(ex) == {"input", "output"} for ex in examples)
    assert all(isinstance(ex["output"], str) and ex["output"] for ex in examples)
    tasks = [_task_index(ex["input"]) for ex in examples]
    assert Counter(tasks) == {i: 20 for i in range(len(TASKS))}
    assert tasks != sorted(tasks) and tasks[:10] != list(range(10))


def test_tasks_answer_correctly():
    rng = Random(0)
    for _ in range(20):
        for index, task in enumerate(TASKS):
            prompt, answer = task(rng=rng)
            assert _task_index(prompt) == index
            arg = prompt[len(_PREFIXES[index]):]
            if index == 2:
                assert answer.split() == arg.split()[::-1]
            elif index == 3:
                assert answer.split() == sorted(arg.split())
            elif index == 4:
                assert answer == arg.upper()
            elif index == 5:
                assert answer == f"{arg} {arg}"
            elif index == 8:
                a, b = arg.split(" and ")
                assert answer == str(int(a) + int(b))
            elif index == 9:
                assert answer == str(len(arg.split()))


def test_write_examples_is_json_lines(tmp_path):
    examples = [{"output": "ü ✓", "input": "x"}, {"input": "Add 1 and 2", "output": "3"}]
    path = tmp_path / "sub" / "train.json"
    write_examples(examples=examples, path=path)
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and "ü ✓".encode() in raw  # UTF-8, not \\u escapes
    assert raw.splitlines()[0] == b'{"input": "x", "output": "\xc3\xbc \xe2\x9c\x93"}'
    assert [json.loads(line) for line in raw.decode().splitlines()] == examples
    assert [p.name for p in path.parent.iterdir()] == ["train.json"]  # no .tmp left behind
