"""In-context learning in open forms: items of two to four kinds (pets, jobs, states, women's names, ...) are put
into groups named anew in every sample, one item per context, and the group of a new item can only be learned
from the contexts.

Where `icl` keeps six entity types, three classes and the label at the end of each line, this family composes
every sample's form: numbered or bare lines, the group name anywhere in a sentence, log line or chat turn, and
group names drawn from words, colors, letters, numbers, codes, people or plain category nouns. It teaches reading
a mapping from memory whatever its form, not one layout of it.
"""

from __future__ import annotations

import functools
import random
import string
from dataclasses import dataclass
from typing import Literal

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built, at_answer, in_chat_format

ITEM_KINDS = ("female_name", "male_name", "country", "language", "job", "state", "color", "hobby", "pet")
# What a person might call each kind's group; no noun serves two kinds, so the names of a sample's groups differ.
CATEGORY_NOUNS = {
    "female_name": ("women", "ladies", "gals"),
    "male_name": ("men", "guys", "fellas"),
    "country": ("countries", "nations", "abroad"),
    "language": ("languages", "tongues", "speech"),
    "job": ("jobs", "careers", "trades"),
    "state": ("states", "domestic", "home turf"),
    "color": ("colors", "shades", "paint"),
    "hobby": ("hobbies", "pastimes", "leisure"),
    "pet": ("pets", "animals", "critters"),
}
LABEL_SCHEMES = ("word", "color", "letter", "number", "code", "person", "category")
_NAME_POOLS = {"word": "word", "color": "color", "person": "first_name"}  # schemes that name groups by word-list items


Form = Literal["numbered", "bare", "prose", "chat"]


@dataclass(frozen=True)
class GroupingWording:
    """One context: `{x}` is the item, `{answer}` its group, `{i}` the context's number. `form`: composed anew
    for every sample in that form (then `demonstration` is unused)."""

    id: str
    demonstration: str = ""
    held_out: bool = False
    form: Form | None = None

    @property
    def varied(self) -> bool:
        """Whether every sample composes its own form."""
        return self.form is not None

    def frame(self, rng: random.Random) -> str:
        """The context template of one sample."""
        if not self.varied:
            return self.demonstration
        return composed_turns(rng) if self.form == "chat" else composed_line(rng, self.form)


# Parts of composed forms. None of them belongs to a held-out wording ("Ticket", "routed", "queue", "lane",
# "roster", "I believe"), nor to the probes in docs/results/probe.
_PREFIXES = {
    "numbered": ("{i}. ", "{i}) ", "#{i} ", "Entry {i}: ", "Step {i}: ", "({i}) ", "{i} - "),
    "bare": ("", "", "- ", "* ", "> "),
    "prose": ("",),
}
_ENDINGS = {
    "numbered": (".\n", "\n", ";\n", ".\n\n"),
    "bare": (".\n", "\n", ";\n", " | ", " // "),
    "prose": (". ", ". ", "; "),
}
_BODIES = (
    "{x} goes to {answer}", "{x} was filed under {answer}", "Sent {x} to the {answer} team", "{x}, marked {answer}",
    "{x} <{answer}>", "{x} => group {answer}", "{x}: {answer} pile", "Sorted {x} into {answer}",
    "{x} gets the {answer} sticker", "Moved {x} to {answer} this morning", "{x} lands in bin {answer}",
    "{x} is a {answer} one", "{x}? {answer}, of course", "{x} belongs with {answer} now", "put {x} under {answer}",
    "{x} -- {answer}", "{x} / {answer}", "{x} went in tray {answer} last week", "Next came {x}, which joined {answer}",
    "{x} sits with {answer}", "file {x} as {answer}", "{x} counts as {answer}",
)  # fmt: skip
_ASKS = ("{x}?", "Where does {x} go?", "And {x}?", "group for {x}", "{x} - which one?", "what about {x}")
_REPLIES = ("{answer}", "{answer}.", "That one is {answer}.", "Put it in {answer}.", "{answer}, I'd say.")
_CHAT = "<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n"


def composed_line(rng: random.Random, form: Form) -> str:
    """A line template in `form`: a prefix (a number, a bullet or none), a body with the item before its group,
    and an ending (a new line, or a sentence's end for prose)."""
    body = rng.choice(_BODIES)
    if body[0].islower() and rng.random() < 0.5:
        body = body[0].upper() + body[1:]
    return rng.choice(_PREFIXES[form]) + body + rng.choice(_ENDINGS[form])


def composed_turns(rng: random.Random) -> str:
    """A user turn that names the item and an assistant turn that names its group."""
    return _CHAT.format(ask=rng.choice(_ASKS), reply=rng.choice(_REPLIES))


WORDINGS = (
    GroupingWording("grouping/numbered", form="numbered"),
    GroupingWording("grouping/bare", form="bare"),
    GroupingWording("grouping/prose", form="prose"),
    GroupingWording("grouping/chat", form="chat"),
    GroupingWording("grouping/ticket", "Ticket {i}: {x} routed to queue {answer}.\n", held_out=True),
    GroupingWording("grouping/ledger", "{i}\t{x}\tlane {answer}\n", held_out=True),
    GroupingWording(
        "grouping/ask-roster",
        _CHAT.format(ask="Which roster has {x}?", reply="On the {answer} roster, I believe."),
        held_out=True,
    ),
)


def group_names(rng: random.Random, split: Split, kinds: list[str]) -> tuple[list[str], list[str]]:
    """Distinct names for the groups of `kinds`, in one scheme drawn at random; and those of them that are
    word-list items (of `split`)."""
    count = len(kinds)
    schemes = [s for s in LABEL_SCHEMES if not (s == "color" and "color" in kinds)]
    if any(kind.endswith("_name") for kind in kinds):
        schemes.remove("person")
    scheme = rng.choice(schemes)
    if scheme in _NAME_POOLS:
        names = rng.sample(words(_NAME_POOLS[scheme], split), count)
        return names, names
    if scheme == "letter":
        return rng.sample(string.ascii_uppercase, count), []
    if scheme == "number":
        return [str(n) for n in rng.sample(range(1, 100), count)], []
    if scheme == "code":
        letters = rng.sample(string.ascii_uppercase, count)
        return [f"{letter}{rng.randrange(10)}" for letter in letters], []
    return [rng.choice(CATEGORY_NOUNS[kind]) for kind in kinds], []


@functools.cache
def _shared(kind: str, other: str, split: Split) -> frozenset[str]:
    """The items of `split` that are of both kinds (Jordan: a woman's name, a man's and a country)."""
    return frozenset(words(kind, split)).intersection(words(other, split))


def _unambiguous(drawn: str, pool: list[str], ambiguous: set[str]) -> str:
    """`drawn`, or where it could be read two ways (the state Virginia in a group named Virginia; Jordan, a woman's
    name, a man's and a country), another item of `pool`: drawn by a generator of its own, so that every other
    sample of a seed stays as it was."""
    if drawn not in ambiguous:
        return drawn
    others = [w for w in pool if w not in ambiguous]
    return random.Random(f"{drawn}:{len(pool)}").choice(others) if others else drawn


def grouping_sample(
    rng: random.Random, split: Split, steps: int, wording: GroupingWording, chat: TurnFormat = CHATML_FORMAT
) -> Built:
    """One sample with `steps` contexts (chat turns as `chat` writes them), each an item of one of 2-4 kinds with its
    group's name, and the items it
    uses: the asked one first, which no context holds, then those of the contexts (small kinds such as pets
    repeat theirs once their pool runs out), then the group names that are word-list items."""
    demonstration = in_chat_format(wording.frame(rng), chat)
    kinds = rng.sample(ITEM_KINDS, rng.randint(2, 4))
    names, named_items = group_names(rng, split, kinds)
    # An item of two of the sample's kinds, or named like a group, would belong to two groups.
    ambiguous = [
        {*names, *(w for other in kinds if other != kind for w in _shared(kind, other, split))} for kind in kinds
    ]
    asked_kind = rng.randrange(len(kinds))
    asked_pool = words(kinds[asked_kind], split)
    asked = _unambiguous(rng.choice(asked_pool), asked_pool, ambiguous[asked_kind])
    pools = [[w for w in words(kind, split) if w != asked] for kind in kinds]
    used: list[str] = []

    def item(kind: int) -> str:
        pool = pools[kind]
        fresh = [w for w in pool if w not in used]
        chosen = _unambiguous(rng.choice(fresh or pool), fresh or pool, ambiguous[kind])
        if chosen not in used:
            used.append(chosen)
        return chosen

    contexts = []
    for number in range(1, steps + 1):
        kind = rng.randrange(len(kinds))
        contexts.append(demonstration.format(x=item(kind), answer=names[kind], i=number))
    prompt, output = at_answer(demonstration, names[asked_kind], x=asked, i=str(steps + 1))
    choices = [at_answer(demonstration, name, x=asked, i=str(steps + 1))[1] for name in names]
    return OnlineSample(contexts, prompt, output, choices), (asked, *used, *named_items)
