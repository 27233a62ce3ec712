"""The demo model's training corpus: a few hundred short sentences it writes itself.

Capitals of countries, small arithmetic in words ("two plus three is five."), what DWDP does,
one story opening, a few chat turns in the layout of the tokenizer's chat template and tool
turns (asked for a city's weather with a ``get_weather`` tool offered, the model calls it). The
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


WEATHER_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
"""The one tool of the demo's tool turns (OpenAI's ``tools`` entry)."""

WEATHER_CITIES: tuple[str, ...] = ("Paris",)
"""The cities whose weather the model learns to ask ``get_weather`` for (one: a model this
small learns one call by heart; more, and it mixes their cities up)."""


WEATHER_REPORT = "sunny, 21 C"
"""What the demo's ``get_weather`` answers (the ``role: tool`` message)."""


def weather_question(city: str) -> str:
    return f"What is the weather in {city}?"


def weather_answer(city: str) -> str:
    """The assistant's last turn, once the tool answered :data:`WEATHER_REPORT`."""
    return f"It is {WEATHER_REPORT} in {city}."


def weather_call(city: str) -> dict:
    """The assistant's call for ``city`` (a message's ``tool_calls`` entry, arguments a map as
    chat templates take them)."""
    return {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}}


@dataclass(frozen=True)
class Corpus:
    """The training texts: ``completions`` are plain sentences (tokenized as a completion
    prompt is); ``chats`` are (user, assistant) turns (rendered with the chat template);
    ``tool_cities``: two tool turns each, the user asking :func:`weather_question` with
    :data:`WEATHER_TOOL` offered and the assistant calling it (:func:`weather_call`), then,
    the tool having answered :data:`WEATHER_REPORT`, the assistant saying
    :func:`weather_answer`."""

    completions: tuple[str, ...]
    chats: tuple[tuple[str, str], ...]
    tool_cities: tuple[str, ...] = ()

    def all_text(self) -> list[str]:
        """Every sentence, chat turn and tool turn as plain text (the tokenizer's input)."""
        import json

        calls = [f"{weather_question(c)}\n{json.dumps(weather_call(c)['function'])}\n"
                 f"{WEATHER_REPORT}\n{weather_answer(c)}" for c in self.tool_cities]
        tools = [json.dumps(WEATHER_TOOL)] if self.tool_cities else []
        return [*self.completions, *(f"{u}\n{a}" for u, a in self.chats), *tools, *calls]


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
        tool_cities=WEATHER_CITIES,
    )
