"""Seeded generators with the shape of Hypothesis strategies, for bulk request generation.

Hypothesis spends ~15 ms per drawn request of the adversarial suite (a draw is recorded
for shrinking); 20,000 requests a run would take minutes before one was sent. These
combinators draw from a ``random.Random`` instead: the same seed gives the same cases,
and a failing case is printed with its index to replay it. The API mirrors the part of
``hypothesis.strategies`` the suite uses, so the strategies read the same.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

Draw = Callable[["Gen[Any]"], Any]


class Gen(Generic[T]):
    """Something that draws a value from a random source."""

    def __init__(self, draw: Callable[[random.Random], T]) -> None:
        self._draw = draw

    def example(self, rng: random.Random) -> T:
        """One value."""
        return self._draw(rng)

    def map(self, fn: Callable[[T], U]) -> Gen[U]:
        """Values passed through ``fn``."""
        return Gen(lambda rng: fn(self._draw(rng)))

    def __or__(self, other: Gen[Any]) -> Gen[Any]:
        return one_of(self, other)


def one_of(*options: Gen[Any]) -> Gen[Any]:
    """A value from one of ``options``, each chosen equally often."""
    return Gen(lambda rng: rng.choice(options).example(rng))


def sampled_from(values: Sequence[T]) -> Gen[T]:
    """One of ``values``."""
    values = list(values)
    return Gen(lambda rng: rng.choice(values))


def booleans() -> Gen[bool]:
    """``True`` or ``False``."""
    return Gen(lambda rng: rng.random() < 0.5)


def integers(min_value: int | None = None, max_value: int | None = None) -> Gen[int]:
    """An integer in the bounds; unbounded sides reach past 64 bits now and then."""
    low = -(2**80) if min_value is None else min_value
    high = 2**80 if max_value is None else max_value

    def draw(rng: random.Random) -> int:
        if rng.random() < 0.3:  # near a bound, where the bugs are
            return rng.choice([low, high, min(low + 1, high), max(high - 1, low)])
        bits = rng.randint(0, max(1, (high - low).bit_length()))
        return low + rng.randint(0, min(2**bits, high - low))

    return Gen(draw)


def floats(min_value: float | None = None, max_value: float | None = None) -> Gen[float]:
    """A finite float in the bounds (unbounded: any magnitude, subnormals included)."""

    def draw(rng: random.Random) -> float:
        if min_value is not None and max_value is not None:
            return rng.uniform(min_value, max_value)
        return rng.choice([-1.0, 1.0]) * rng.random() * 10.0 ** rng.randint(-320, 308)

    return Gen(draw)


_ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz0123456789-._",
    " !\"#$%&'()*+,/:;<=>?@[\\]^`{|}~",
    "\u00e9\u00df\u0663\u202e\u200b\ufeff\u4e2d\U0001f600\U00010000",
]


def text(min_size: int = 0, max_size: int = 10) -> Gen[str]:
    """Text mixing ASCII, punctuation and wider Unicode (no surrogates, no controls)."""

    def draw(rng: random.Random) -> str:
        alphabet = "".join(rng.sample(_ALPHABETS, rng.randint(1, 3)))
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_size, max_size)))

    return Gen(draw)


def binary(min_size: int = 0, max_size: int = 16) -> Gen[bytes]:
    """Random bytes."""
    return Gen(lambda rng: rng.randbytes(rng.randint(min_size, max_size)))


def lists(
    elements: Gen[T], min_size: int = 0, max_size: int = 5, unique: bool = False
) -> Gen[list[T]]:
    """A list of drawn elements (``unique``: no repeats, so maybe shorter)."""

    def draw(rng: random.Random) -> list[T]:
        values = [elements.example(rng) for _ in range(rng.randint(min_size, max_size))]
        return list(dict.fromkeys(values)) if unique else values

    return Gen(draw)


def dictionaries(keys: Gen[Any], values: Gen[Any], max_size: int = 5) -> Gen[dict[Any, Any]]:
    """A dict of drawn keys and values."""
    return Gen(
        lambda rng: {
            keys.example(rng): values.example(rng) for _ in range(rng.randint(0, max_size))
        }
    )


def fixed_dictionaries(
    required: dict[str, Gen[Any]], optional: dict[str, Gen[Any]] | None = None
) -> Gen[dict[str, Any]]:
    """The required keys always, each optional key half the time."""

    def draw(rng: random.Random) -> dict[str, Any]:
        out = {k: g.example(rng) for k, g in required.items()}
        out.update({k: g.example(rng) for k, g in (optional or {}).items() if rng.random() < 0.5})
        return out

    return Gen(draw)


def recursive(base: Gen[Any], extend: Callable[[Gen[Any]], Gen[Any]], depth: int = 3) -> Gen[Any]:
    """``base``, or ``extend`` applied up to ``depth`` times."""
    levels = [base]
    for _ in range(depth):
        levels.append(base | extend(levels[-1]))
    return levels[-1]


def composite(fn: Callable[..., T]) -> Callable[..., Gen[T]]:
    """Like Hypothesis' ``composite``: ``fn(draw, *args)`` becomes a generator factory."""

    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Gen[T]:
        return Gen(lambda rng: fn(lambda g: g.example(rng), *args, **kwargs))

    return factory


def seed(label: str, index: int) -> random.Random:
    """The random source of one case: the same label and index give the same case."""
    return random.Random(f"{label}:{index}:{sys.hash_info.width}")
