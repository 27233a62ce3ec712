"""The demo model's training corpus: a few hundred short sentences it writes itself.

Capitals of countries, small arithmetic in words ("two plus three is five."), what DWDP does,
one story opening and a few chat turns in the layout of the tokenizer's chat template. The
text is fixed (no randomness, nothing read from disk), so the corpus and everything trained on
it depend only on this module.
"""

from __future__ import annotations

from dataclasses import dataclass

CAPITALS: tuple[tuple[str, str], ...] = (
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Argentina", "Buenos Aires"),
    ("Brazil", "Brasilia"),
    ("Australia", "Canberra"),
    ("China", "Beijing"),
    ("India", "New Delhi"),
    ("Russia", "Moscow"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Poland", "Warsaw"),
    ("Greece", "Athens"),
    ("Turkey", "Ankara"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Korea", "Seoul"),
)
"""(country, capital) pairs the model learns."""

NUMBERS: tuple[str, ...] = (
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
)

DWDP_FACTS: tuple[str, ...] = (
    "DWDP shares the experts across the ranks of a group.",
    "Each rank of a DWDP group stores only a slice of the experts.",
    "Before a layer runs, a rank copies the missing experts from its peers.",
    "The copied experts wait in a prefetch slot until the layer needs them.",
    "Every rank of a group serves its own requests.",
    "Dense DWDP also shares the attention weights, the router and the shared expert.",
    "The operator starts a DWDP group as one unit and restarts it together.",
    "A group whose ranks do not all meet in time fails together.",
    "Every rank answers exactly as one process with all the weights.",
)
"""What DWDP does, in sentences; only the first starts with "DWDP shares the experts"."""

STORY = "Once upon a time there was a tiny model that learned the capitals of the world."

DEMO_CHAT: tuple[tuple[str, str], ...] = (
    ("Say hello to the DWDP group.", "Hello, DWDP group! Every rank answers the same."),
    ("What does DWDP do?", "DWDP shares the experts across the ranks of a group."),
    ("What is two plus three?", "Two plus three is five."),
    ("Tell me a story.", STORY),
)
"""(user message, assistant answer) turns besides the capital questions."""


@dataclass(frozen=True)
class Corpus:
    """The training texts: ``completions`` are plain sentences (tokenized as a completion
    prompt is); ``chats`` are (user, assistant) turns (rendered with the chat template)."""

    completions: tuple[str, ...]
    chats: tuple[tuple[str, str], ...]

    def all_text(self) -> list[str]:
        """Every sentence and chat turn as plain text (the tokenizer's training input)."""
        return [*self.completions, *(f"{u}\n{a}" for u, a in self.chats)]


def _capital_sentences() -> list[str]:
    out = []
    for country, capital in CAPITALS:
        out += [
            f"The capital of {country} is {capital}.",
            f"{capital} is the capital of {country}.",
            f"What is the capital of {country}? It is {capital}.",
        ]
    return out


def _arithmetic_sentences() -> list[str]:
    out = []
    for a, left in enumerate(NUMBERS):
        for b, right in enumerate(NUMBERS):
            if a + b < len(NUMBERS):
                out.append(f"{left} plus {right} is {NUMBERS[a + b]}.")
                out.append(f"{left.capitalize()} plus {right} is {NUMBERS[a + b]}.")
    return out


def demo_corpus() -> Corpus:
    """The corpus: 90 capital sentences, 132 sums, the DWDP facts, the story and 34 chats."""
    chats = [(f"What is the capital of {c}?", f"The capital of {c} is {k}.") for c, k in CAPITALS]
    return Corpus(
        completions=(
            *_capital_sentences(),
            *_arithmetic_sentences(),
            *DWDP_FACTS,
            STORY,
        ),
        chats=(*DEMO_CHAT, *chats),
    )
