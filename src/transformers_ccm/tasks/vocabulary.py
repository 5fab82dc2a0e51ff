"""Real word lists that install offline (from Faker's data, plus short lists of hobbies and pets), split by
identity into train and test."""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Literal

from transformers_ccm.extras import require

_PURPOSE = "The built-in tasks' word lists"

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")
TEST_FRACTION = 5  # one item in five is held out for the test split


HOBBIES = (
    "archery", "baking", "beekeeping", "birdwatching", "board games", "bouldering", "bowling", "boxing",
    "calligraphy", "camping", "chess", "cooking", "crochet", "crossword puzzles", "cycling", "dancing", "drawing",
    "embroidery", "fencing", "fishing", "gardening", "golf", "gymnastics", "hiking", "horse riding", "ice skating",
    "jigsaw puzzles", "journaling", "judo", "juggling", "karate", "kayaking", "knitting", "meditation",
    "mountain biking", "origami", "painting", "photography", "pilates", "poetry", "pottery", "rock climbing",
    "roller skating", "running", "sailing", "scuba diving", "sewing", "singing", "skateboarding", "skiing",
    "snowboarding", "stargazing", "surfing", "swimming", "table tennis", "tennis", "trail running", "volleyball",
    "woodworking", "yoga",
)  # fmt: skip
PETS = (
    "alpaca", "axolotl", "beagle", "bearded dragon", "budgie", "bulldog", "canary", "cat", "chameleon",
    "chinchilla", "cockatiel", "cockatoo", "collie", "corgi", "dachshund", "dog", "donkey", "duck", "ferret",
    "gecko", "gerbil", "goat", "goldfish", "greyhound", "guinea pig", "hamster", "hedgehog", "horse", "husky",
    "iguana", "koi", "labrador", "lizard", "llama", "lovebird", "macaw", "mouse", "parrot", "persian cat", "pig",
    "pigeon", "pony", "poodle", "rabbit", "rat", "siamese cat", "snake", "tabby cat", "tarantula", "terrier",
    "tortoise", "tree frog", "turtle",
)  # fmt: skip


# Entries of Faker's job list that are word fragments, not occupations ("Make", "Copy"): as everyday words they
# turn up in other sentences, where a sample would seem to name the user's job.
_NOT_OCCUPATIONS = frozenset({"Make", "Copy"})


def with_article(noun: str) -> str:
    """`noun` with its indefinite article: "a nurse", "an engineer"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _words(text: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", text).lower()


def _provider(module: str) -> Any:
    return require(f"faker.providers.{module}", _PURPOSE).Provider


@functools.cache
def _pools() -> dict[str, tuple[str, ...]]:
    # Faker is imported on first use, so that importing the tasks (and `with_article`) needs no extra.
    Address, Color, Job = _provider("address.en_US"), _provider("color.en_US"), _provider("job.en_US")
    Lorem, Person, EnglishPerson = _provider("lorem.en_US"), _provider("person"), _provider("person.en_US")
    jobs = [
        job
        for job in Job.jobs
        if "," not in job and "(" not in job and len(job.split()) <= 2 and job not in _NOT_OCCUPATIONS
    ]
    return {
        "first_name": tuple(sorted(set(EnglishPerson.first_names_male) | set(EnglishPerson.first_names_female))),
        "female_name": tuple(sorted(EnglishPerson.first_names_female)),
        "male_name": tuple(sorted(EnglishPerson.first_names_male)),
        "country": tuple(Address.countries),
        "language": tuple(Person.language_names),
        "job": tuple(job.lower() for job in jobs),
        "state": tuple(Address.states),
        "color": tuple(sorted({_words(name) for name in Color.all_colors})),
        "word": tuple(sorted({w for w in Lorem.word_list if w.isalpha() and 4 <= len(w) <= 8})),
        "hobby": HOBBIES,
        "pet": PETS,
    }


POOLS: tuple[str, ...] = (
    "first_name",
    "female_name",
    "male_name",
    "country",
    "language",
    "job",
    "state",
    "color",
    "word",
    "hobby",
    "pet",
)


def in_test_split(item: str) -> bool:
    """Whether `item` belongs to the test split (a stable hash of the item itself)."""
    return int(hashlib.sha256(item.encode()).hexdigest()[:8], 16) % TEST_FRACTION == 0


@functools.cache
def words(pool: str, split: Split) -> tuple[str, ...]:
    """The items of `pool` ("first_name", "country", ...) in `split`; train and test never share an item."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    return tuple(item for item in _pools()[pool] if in_test_split(item) == (split == "test"))
