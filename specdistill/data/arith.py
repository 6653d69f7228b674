"""A seeded generator of GSM8K look-alike word problems (the embedded `arith` task).

The words come from small lists, so a tiny model learns the template text quickly; the numbers are what is hard:
two or three operations (+, -, *, /) on one- and two-digit numbers. Records follow GSM8K's schema (`question`,
`answer` ending in "#### N") so that the GSM8K formatting applies unchanged.

Splits are disjoint by construction: every question is assigned to one split by a hash of its text, and each
split's generator (seeded by `(seed, split)`) keeps only the questions of its own bucket. A split's records depend
only on `(seed, split, its size)`; asking for more test problems never changes the train ones.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

# bumped whenever the text of generated records changes (it is part of the arith tokenizer's cache key)
GENERATOR_VERSION = 1
DEFAULT_SIZES: dict[str, int] = {"train": 4000, "validation": 200, "test": 200}
# hash buckets (out of 20) owned by each split: 10% test, 10% validation, 80% train
_BUCKETS: dict[str, range] = {"test": range(0, 2), "validation": range(2, 4), "train": range(4, 20)}

_PEOPLE = [
    ("Mia", "she", "her"), ("Tom", "he", "his"), ("Ava", "she", "her"), ("Leo", "he", "his"),
    ("Zoe", "she", "her"), ("Sam", "he", "his"), ("Lily", "she", "her"), ("Max", "he", "his"),
    ("Emma", "she", "her"), ("Ben", "he", "his"), ("Nora", "she", "her"), ("Jack", "he", "his"),
]  # fmt: skip
_OBJECTS = [
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "books",
    "shells",
    "cards",
    "coins",
    "stamps",
]
_GAIN = [("buys", "buying"), ("finds", "finding"), ("wins", "winning"), ("picks up", "picking up")]
_LOSS = [("gives away", "giving away"), ("loses", "losing"), ("sells", "selling"), ("uses", "using")]
_CONTAINERS = ["boxes", "bags", "jars", "packs"]
_SHARES = ["piles", "bowls", "rows", "groups"]


@dataclass(frozen=True)
class _State:
    value: int
    ops: int  # arithmetic operations used so far


def _step_start(rng: random.Random, name: str, obj: str) -> tuple[str, str, _State]:
    if rng.random() < 0.35:  # a product to start with
        n, k = rng.randint(2, 9), rng.randint(2, 12)
        box = rng.choice(_CONTAINERS)
        q = f"{name} has {n} {box} with {k} {obj} in each."
        a = f"{name} has {n} * {k} = {n * k} {obj}."
        return q, a, _State(n * k, 1)
    n = rng.randint(5, 99)
    return f"{name} has {n} {obj}.", "", _State(n, 0)


def _step_op(rng: random.Random, state: _State, pron: str, obj: str) -> tuple[str, str, _State] | None:
    """One more operation on the running value, or None when the drawn kind does not fit the value."""
    v = state.value
    kind = rng.choice(["add", "add", "sub", "sub", "mul", "groups"])
    if kind == "add":
        n = rng.randint(2, 99)
        verb, ing = rng.choice(_GAIN)
        return (f"{pron.capitalize()} {verb} {n} more.", f"After {ing} {n} more, {pron} has {v} + {n} = {v + n} {obj}.",
                _State(v + n, state.ops + 1))  # fmt: skip
    if kind == "sub":
        if v < 3:
            return None
        n = rng.randint(1, min(v - 1, 99))
        verb, ing = rng.choice(_LOSS)
        return (f"{pron.capitalize()} {verb} {n} of them.", f"After {ing} {n}, {pron} has {v} - {n} = {v - n} {obj}.",
                _State(v - n, state.ops + 1))  # fmt: skip
    if kind == "mul":
        if v > 99:
            return None
        k = rng.randint(2, 4)
        times = {2: "twice", 3: "three times", 4: "four times"}[k]
        return (f"Then {pron} gets more until {pron} has {times} as many.", f"Now {pron} has {v} * {k} = {v * k} {obj}.",
                _State(v * k, state.ops + 1))  # fmt: skip
    if state.ops > 1:  # "groups" is two operations
        return None
    n, k = rng.randint(2, 9), rng.randint(2, 12)
    box = rng.choice(_CONTAINERS)
    return (f"{pron.capitalize()} buys {n} {box} with {k} {obj} in each.",
            f"{pron.capitalize()} buys {n} * {k} = {n * k} more, so {pron} has {v} + {n * k} = {v + n * k} {obj}.",
            _State(v + n * k, state.ops + 2))  # fmt: skip


def generate_problem(rng: random.Random) -> dict[str, str]:
    """One GSM8K-style record `{"question", "answer"}` with 2-3 operations and the result after "#### "."""
    name, pron, _ = rng.choice(_PEOPLE)
    obj = rng.choice(_OBJECTS)
    target_ops = rng.choice([2, 3])
    q, a, state = _step_start(rng, name, obj)
    questions, steps = [q], [a] if a else []
    while state.ops < target_ops:
        if state.ops == target_ops - 1 and state.ops > 0 and rng.random() < 0.3:
            divisors = [k for k in range(2, 10) if state.value % k == 0 and state.value // k > 1]
            if divisors:  # end by sharing equally: the question asks for one share
                k = rng.choice(divisors)
                box = rng.choice(_SHARES)
                share = state.value // k
                questions.append(f"{pron.capitalize()} puts them equally into {k} {box}.")
                question = " ".join(questions) + f" How many {obj} are in each of the {box}?"
                steps.append(f"Each of the {box} gets {state.value} / {k} = {share} {obj}.")
                return {"question": question, "answer": "\n".join(steps) + f"\n#### {share}"}
        step = _step_op(rng, state, pron, obj)
        if step is None or step[2].ops > target_ops:
            continue
        questions.append(step[0])
        steps.append(step[1])
        state = step[2]
    question = " ".join(questions) + f" How many {obj} does {name} have now?"
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {state.value}"}


def split_bucket(question: str) -> int:
    """The hash bucket (0..19) of a question; it decides the question's split."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:4], "big") % 20


def generate_split(split: str, size: int, seed: int = 0) -> list[dict[str, str]]:
    """`size` distinct records of `split` ("train", "validation" or "test"), deterministic in (seed, split, size).

    No question appears twice within a split or in two splits.
    """
    if split not in _BUCKETS:
        raise ValueError(f"Unknown arith split {split!r}; use one of {sorted(_BUCKETS)}.")
    if size < 1:
        raise ValueError(f"arith split {split!r} needs a positive size, got {size}.")
    rng = random.Random(f"specdistill-arith-v{GENERATOR_VERSION}-{seed}-{split}")
    buckets = _BUCKETS[split]
    seen: set[str] = set()
    records: list[dict[str, str]] = []
    attempts = 0
    while len(records) < size:
        attempts += 1
        if attempts > 200 * size + 10_000:
            raise RuntimeError(
                f"arith generator could not find {size} distinct {split} problems; ask for fewer."
            )
        record = generate_problem(rng)
        question = record["question"]
        if question in seen or split_bucket(question) not in buckets:
            continue
        seen.add(question)
        records.append(record)
    return records
