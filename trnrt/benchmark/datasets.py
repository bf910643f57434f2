"""Benchmark prompts made locally, deterministic by seed (nothing is downloaded, no tokenizer).

Every generator returns a list of `Conversation`s; a single-turn data set gives one-turn
conversations. Lengths are drawn like SGLang's `bench_serving`: uniform in
`[max(int(L * range_ratio), 1), L]`, so `range_ratio = 1.0` gives fixed lengths.

- `random`: prompts of random words from a fixed word list (`WORDS`); lengths are in words. The
  server reports the token counts (usage), which is what the results use.
- `random-ids`: prompts of random token ids drawn from a pool (the server's own ids for `WORDS`,
  see `client.fetch_token_pool`); lengths are exact, in tokens. Only routes that take token ids
  (`/generate`, `/v1/completions`) can send them.
- `shared-prefix`: groups of prompts that share one long system prompt, each with its own
  question (SGLang's `generated-shared-prefix`); the prompts are shuffled by seed.
- `multi-turn`: conversations of T user turns; turn k is sent with the previous turns and answers
  in front of it, so each conversation's prompts grow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Common English words (each once): a prompt of random words reads as text to any tokenizer.
WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town road
arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need
court oil situation cost industry figure street image phone data picture practice piece land
product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population site river
garden bridge stone cloud summer winter spring autumn island forest mountain valley ocean desert
village market kitchen letter garden engine signal bottle pocket ticket planet rocket silver golden
""".split()))

DATASETS = ("random", "random-ids", "shared-prefix", "multi-turn")
ALIASES = {"generated-shared-prefix": "shared-prefix", "random-words": "random"}


@dataclass
class Turn:
    """One request's content: text (`text`, with an optional shared `system` part) or token ids."""

    text: str | None = None
    ids: list[int] | None = None
    system: str | None = None
    input_len: int = 0  # nominal: words (text) or tokens (ids), system part included
    output_len: int = 1


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)


def _check(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def draw_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [max(int(length * range_ratio), 1), length] (SGLang's rule)."""
    lo = max(int(length * range_ratio), 1)
    return rng.randint(min(lo, length), length)


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _check_common(num_prompts: int, input_len: int, output_len: int, range_ratio: float) -> None:
    _check("num_prompts", num_prompts)
    _check("input_len", input_len)
    _check("output_len", output_len)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")


def gen_random(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
               seed: int = 1) -> list[Conversation]:
    """`num_prompts` prompts of random words (`input_len` words, drawn with `range_ratio`)."""
    _check_common(num_prompts, input_len, output_len, range_ratio)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n, m = draw_len(rng, input_len, range_ratio), draw_len(rng, output_len, range_ratio)
        out.append(Conversation([Turn(text=random_words(rng, n), input_len=n, output_len=m)]))
    return out


def gen_random_ids(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 1, pool: list[int] | tuple[int, ...] = ()) -> list[Conversation]:
    """`num_prompts` prompts of token ids drawn from `pool` (exact lengths, in tokens)."""
    _check_common(num_prompts, input_len, output_len, range_ratio)
    pool = sorted(set(pool))
    if not pool:
        raise ValueError("random-ids needs a non-empty pool of token ids")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n, m = draw_len(rng, input_len, range_ratio), draw_len(rng, output_len, range_ratio)
        out.append(Conversation([Turn(ids=[rng.choice(pool) for _ in range(n)], input_len=n, output_len=m)]))
    return out


def gen_shared_prefix(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                      output_len: int, seed: int = 1) -> list[Conversation]:
    """`num_groups` system prompts of `system_prompt_len` words, each shared by
    `prompts_per_group` distinct questions of `question_len` words; shuffled by seed."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("system_prompt_len", system_prompt_len), ("question_len", question_len),
                    ("output_len", output_len)):
        _check(name, v)
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        # A group number up front keeps two groups' prefixes apart even from their first word.
        system = f"Group {g}. " + random_words(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            out.append(Conversation([Turn(text=random_words(rng, question_len), system=system,
                                          input_len=system_prompt_len + question_len + 2,
                                          output_len=output_len)]))
    rng.shuffle(out)
    return out


def gen_multi_turn(num_conversations: int, turns: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 1) -> list[Conversation]:
    """`num_conversations` conversations of `turns` user turns of `input_len` words each (drawn
    with `range_ratio`). A turn's `input_len` is its own words only: the runner sends it after the
    earlier turns and answers."""
    _check_common(num_conversations, input_len, output_len, range_ratio)
    _check("turns", turns)
    rng = random.Random(seed)
    out = []
    for _ in range(num_conversations):
        conv = Conversation()
        for _ in range(turns):
            n, m = draw_len(rng, input_len, range_ratio), draw_len(rng, output_len, range_ratio)
            conv.turns.append(Turn(text=random_words(rng, n), input_len=n, output_len=m))
        out.append(conv)
    return out


def num_requests(conversations: list[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)
