"""Writes `data/tiny_corpus.txt`, the training text of the GPT example, from word lists and templates.

    python examples/gpt/make_corpus.py [--kib 320] [--seed 1234] [--out examples/gpt/data/tiny_corpus.txt]

Owns the corpus: every sentence is generated here from small hand-written word lists, so the text is
original, free of copyright and reproducible (the same seed gives the same bytes). It mixes short
stories about villagers, weather reports, counting and arithmetic facts, calendar lines and dialogue:
regular enough that a 1M-parameter character model learns visibly in a minute, varied enough that it
does not just memorise one line. Pure standard library; ASCII only.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

NAMES = [
    "Ada",
    "Bram",
    "Cora",
    "Dov",
    "Edda",
    "Finn",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Lars",
    "Mira",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sven",
    "Tilda",
    "Ugo",
    "Vera",
    "Wim",
    "Yara",
]
TRADES = [
    "baker",
    "miller",
    "weaver",
    "smith",
    "potter",
    "fisher",
    "carpenter",
    "shepherd",
    "gardener",
    "cooper",
    "tailor",
    "mason",
    "brewer",
    "farmer",
    "sailor",
    "clockmaker",
]
PLACES = [
    "the market",
    "the harbour",
    "the old mill",
    "the bridge",
    "the orchard",
    "the village square",
    "the hill",
    "the forest path",
    "the river bank",
    "the library",
    "the bakery",
    "the workshop",
    "the meadow",
    "the lighthouse",
    "the school",
    "the inn",
]
THINGS = [
    "a basket of apples",
    "a loaf of bread",
    "a wooden chair",
    "a clay pot",
    "a warm coat",
    "a bag of flour",
    "a fishing net",
    "a copper kettle",
    "a bundle of wool",
    "a small boat",
    "a wheel of cheese",
    "a lantern",
    "a pair of boots",
    "a box of nails",
    "a jar of honey",
    "a book of maps",
    "a barrel of cider",
    "a kite",
    "a violin",
    "a bucket of paint",
]
ANIMALS = ["cat", "dog", "goat", "horse", "owl", "fox", "hen", "duck", "sheep", "crow", "mule", "rabbit"]
ADJECTIVES = [
    "quiet",
    "busy",
    "cold",
    "bright",
    "windy",
    "sleepy",
    "cheerful",
    "muddy",
    "golden",
    "grey",
    "calm",
    "noisy",
    "crowded",
    "peaceful",
]
TIMES = [
    "in the morning",
    "at noon",
    "in the afternoon",
    "in the evening",
    "at dawn",
    "at dusk",
    "before breakfast",
    "after supper",
    "late at night",
    "on the first day of spring",
]
VERBS = [
    ("carried", "to"),
    ("brought", "to"),
    ("sold", "at"),
    ("found", "near"),
    ("fixed", "at"),
    ("painted", "behind"),
    ("hid", "under"),
    ("left", "beside"),
    ("lost", "on the way to"),
]
FEELINGS = ["happy", "tired", "hungry", "curious", "proud", "worried", "surprised", "glad"]
WEATHER = ["sunny", "rainy", "cloudy", "foggy", "snowy", "stormy", "clear", "mild"]
WINDS = ["north", "south", "east", "west"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange"]


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} the {rng.choice(TRADES)}"


def story(rng: random.Random) -> str:
    """A short paragraph: someone moves a thing to a place, meets someone, and feels something."""
    who, other = _person(rng), rng.choice(NAMES)
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    verb, prep = rng.choice(VERBS)
    animal = rng.choice(ANIMALS)
    lines = [
        f"{_cap(rng.choice(TIMES))}, {who} {verb} {thing} {prep} {place}.",
        f"The day was {rng.choice(ADJECTIVES)} and the {animal} followed close behind.",
        f'At {place} {other} was waiting, and {other} asked, "Why did you bring {thing}?"',
        f'"Because {rng.choice(NAMES)} needs it before {rng.choice(DAYS)}," came the answer.',
        f"After that the two of them felt {rng.choice(FEELINGS)} and walked home together.",
    ]
    keep = 3 + rng.randrange(3)
    return " ".join(lines[:keep])


def weather(rng: random.Random) -> str:
    """A weather report line with a day, sky, wind and temperature."""
    day, month = rng.choice(DAYS), rng.choice(MONTHS)
    low = rng.randrange(-5, 20)
    high = low + rng.randrange(2, 12)
    return (
        f"Weather for {day}, {rng.randrange(1, 29)} {month}: {rng.choice(WEATHER)} skies, wind from the "
        f"{rng.choice(WINDS)}, low of {low} and high of {high} degrees."
    )


def arithmetic(rng: random.Random) -> str:
    """A small, correct sum or difference written out in words."""
    a, b = rng.randrange(0, 11), rng.randrange(0, 11)
    if rng.random() < 0.5:
        return f"{_cap(NUMBERS[a])} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    a, b = max(a, b), min(a, b)
    return f"{_cap(NUMBERS[a])} minus {NUMBERS[b]} is {NUMBERS[a - b]}."


def counting(rng: random.Random) -> str:
    """A run of consecutive numbers, days or months: long-range regularity for the model to pick up."""
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randrange(0, 14)
        return _cap(", ".join(NUMBERS[start : start + 5 + rng.randrange(3)])) + "."
    seq = DAYS if kind == 1 else MONTHS
    start = rng.randrange(len(seq))
    count = 3 + rng.randrange(4)
    items = [seq[(start + i) % len(seq)] for i in range(count)]
    return f"After {items[0]} comes {', then '.join(items[1:])}."


def market(rng: random.Random) -> str:
    """A price list line from the market."""
    seller = _person(rng)
    count = rng.randrange(2, 13)
    colour = rng.choice(COLOURS)
    return (
        f"{_cap(seller)} sells {NUMBERS[count]} {colour} {rng.choice(['cups', 'hats', 'plates', 'ribbons'])} "
        f"for {NUMBERS[rng.randrange(1, 21)]} coins each at {rng.choice(PLACES)}."
    )


def dialogue(rng: random.Random) -> str:
    """Two lines of conversation about an animal."""
    a, b = rng.sample(NAMES, 2)
    animal = rng.choice(ANIMALS)
    return (
        f'{a}: "Have you seen my {animal}?" {b}: "Yes, it was near {rng.choice(PLACES)} '
        f'{rng.choice(TIMES)}, looking {rng.choice(FEELINGS)}."'
    )


GENERATORS: list[tuple[Callable[[random.Random], str], int]] = [
    (story, 5),
    (weather, 2),
    (arithmetic, 2),
    (counting, 2),
    (market, 2),
    (dialogue, 2),
]


def build_corpus(*, num_bytes: int, seed: int) -> str:
    """Paragraphs of generated sentences until the text reaches `num_bytes` bytes."""
    rng = random.Random(seed)
    funcs = [f for f, weight in GENERATORS for _ in range(weight)]
    paragraphs: list[str] = []
    size = 0
    while size < num_bytes:
        sentences = [rng.choice(funcs)(rng) for _ in range(1 + rng.randrange(3))]
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    text = "\n\n".join(paragraphs) + "\n"
    assert text.isascii()
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=320, help="size of the corpus in KiB")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
    )
    args = parser.parse_args()
    text = build_corpus(num_bytes=args.kib * 1024, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {len(text):,} bytes, {len(set(text))} distinct characters, to {args.out}")


if __name__ == "__main__":
    main()
