"""Workloads: deterministic streams of chat requests that exercise (or defeat) prefix caching.

Prompt text is drawn from common English words that each encode to one token in the Llama/
SmolLM2 BPE vocabularies (checked against the default model's tokenizer), so "N tokens" of
prompt is N words. The exact token counts are measured at run time through the engine's
`/tokenize`; these nominal counts only size the workload.

Three shapes, as in vLLM's `bench serve` datasets and inference-perf's:
- `shared-prefix`: G groups, each with a long system prompt shared by many users who each
  add a short unique question (a product with a few assistants and many users);
- `multi-turn`: conversations whose every turn resends the whole history plus a new user turn,
  so the prefix grows; a turn is only sent once the previous turn of its conversation ended;
- `random`: independent prompts of random length; nothing to share beyond the chat template;
- `long-prompt`: unique long prompts (documents to summarise, 4-8k tokens) mixed with short
  chats, the shape where prefill/decode disaggregation pays: a long prefill on an engine stalls
  the decode steps of everything else running there.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

WorkloadKind = Literal["shared-prefix", "multi-turn", "random", "long-prompt", "lora"]
WORKLOAD_KINDS: tuple[WorkloadKind, ...] = ("shared-prefix", "multi-turn", "random", "long-prompt", "lora")

# Each is a single token (with its leading space) in the SmolLM2 / Llama BPE vocabulary.
WORDS: tuple[str, ...] = tuple(
    """time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot right
    study book eye job word business issue side kind head house service friend father power hour
    game line end member law car city community name president team minute idea kid body
    information back parent face others level office door health person art war history party
    result change morning reason research girl guy moment air teacher force education""".split()
)


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class BenchRequest:
    """One request the load generator sends."""

    index: int
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    group: str  # the shared-content key: a system-prompt group or a conversation
    depends_on: int | None = None  # index of a request that must finish before this is sent
    # The prompt as a word sequence, for the nominal (pre-tokenization) ideal-hit-rate estimate.
    nominal_words: tuple[str, ...] = field(default=(), compare=False, repr=False)
    model: str | None = None  # a LoRA adapter to run (None: the stack's model)
    tenant: str | None = None  # who sends it (the fairness id); None: the anonymous tenant
    priority: int = 0  # its InferenceObjective's priority (negative: sheddable)

    def payload_messages(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int = 16
    prefix_tokens: int = 2048
    suffix_tokens: int = 32
    output_tokens: int = 32


@dataclass(frozen=True)
class MultiTurnSpec:
    conversations: int = 16
    turns: int = 6
    first_turn_tokens: int = 512  # a system prompt opening each conversation
    # Conversations open with one of this many system prompts, shared (one app's or tenant's
    # prompt, as in inference-perf's multi-turn shared-prefix shape); 0: each opens with its own.
    system_prompts: int = 0
    user_turn_tokens: int = 64
    assistant_turn_tokens: int = 64  # a synthetic assistant reply folded into the history
    output_tokens: int = 64


@dataclass(frozen=True)
class RandomSpec:
    min_prompt_tokens: int = 128
    max_prompt_tokens: int = 1024
    min_output_tokens: int = 16
    max_output_tokens: int = 64


@dataclass(frozen=True)
class LongPromptSpec:
    long_fraction: float = 0.3  # share of requests that carry a long unique prompt
    min_long_tokens: int = 4000
    max_long_tokens: int = 8000
    min_short_tokens: int = 32  # the short chats
    max_short_tokens: int = 256
    output_tokens: int = 128


@dataclass(frozen=True)
class LoRASpec:
    """Many adapters on few slots: requests name adapter i with Zipf popularity (a few hot ones,
    a long tail), each adapter's users share its system prompt."""

    adapters: int = 12
    zipf: float = 1.1  # popularity exponent: adapter i is chosen with weight 1 / (i + 1) ** zipf
    base_fraction: float = 0.1  # share of requests for the base model itself
    prefix_tokens: int = 512  # the adapter's system prompt
    suffix_tokens: int = 128
    output_tokens: int = 64

    def names(self) -> list[str]:
        return [adapter_name(i) for i in range(self.adapters)]


def adapter_name(i: int) -> str:
    return f"adapter-{i:02d}"


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind = "shared-prefix"
    seed: int = 0
    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    multi_turn: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    random: RandomSpec = field(default_factory=RandomSpec)
    long_prompt: LongPromptSpec = field(default_factory=LongPromptSpec)
    lora: LoRASpec = field(default_factory=LoRASpec)

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for impossible sizes."""
        sp, mt, rd, lp = self.shared_prefix, self.multi_turn, self.random, self.long_prompt
        checks = [
            (sp.groups >= 1, "--groups must be at least 1"),
            (sp.prefix_tokens >= 0, "--prefix-tokens must be >= 0"),
            (sp.suffix_tokens >= 1, "--suffix-tokens must be at least 1"),
            (sp.output_tokens >= 1, "--output-tokens must be at least 1"),
            (mt.conversations >= 1, "--conversations must be at least 1"),
            (mt.turns >= 1, "--turns must be at least 1"),
            (mt.user_turn_tokens >= 1, "--user-turn-tokens must be at least 1"),
            (mt.system_prompts >= 0, "--system-prompts must be 0 or more"),
            (mt.output_tokens >= 1, "--output-tokens must be at least 1"),
            (
                1 <= rd.min_prompt_tokens <= rd.max_prompt_tokens,
                "random prompt lengths: need 1 <= min <= max",
            ),
            (
                1 <= rd.min_output_tokens <= rd.max_output_tokens,
                "random output lengths: need 1 <= min <= max",
            ),
            (0.0 <= lp.long_fraction <= 1.0, "--long-fraction must be between 0 and 1"),
            (
                1 <= lp.min_long_tokens <= lp.max_long_tokens,
                "long prompt lengths: need 1 <= --min-long-tokens <= --max-long-tokens",
            ),
            (1 <= lp.min_short_tokens <= lp.max_short_tokens, "short chat lengths: need 1 <= min <= max"),
            (lp.output_tokens >= 1, "--output-tokens must be at least 1"),
            (1 <= self.lora.adapters <= 1000, "--adapters must be between 1 and 1000"),
            (self.lora.zipf >= 0, "--adapter-zipf must be >= 0"),
            (0.0 <= self.lora.base_fraction < 1.0, "--base-fraction must be in [0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def unique_prompt_words(rng: random.Random, tag: str, tokens: int) -> list[str]:
    """A prompt of `tokens` words unique from its first word on (`tag`): nothing for the prefix
    cache to share, for benches about slots and queues. Simulated engines count a token a word."""
    return [tag, *_words(rng, max(0, tokens - 1))]


def _text(words: list[str]) -> str:
    return " ".join(words)


def _unique_words(index: int, n: int, rng: random.Random) -> list[str]:
    # A request-specific tag first, so two users of one group diverge right after the shared
    # prefix (and no two requests are byte-identical, which would overstate cache hits).
    tag = ["request", str(index)]
    return tag + _words(rng, max(0, n - len(tag)))


def generate(spec: WorkloadSpec) -> Iterator[BenchRequest]:
    """An endless, seed-deterministic stream of requests (take as many as the run needs)."""
    spec.validate()
    if spec.kind == "shared-prefix":
        return _shared_prefix(spec.shared_prefix, spec.seed)
    if spec.kind == "multi-turn":
        return _multi_turn(spec.multi_turn, spec.seed)
    if spec.kind == "random":
        return _random(spec.random, spec.seed)
    if spec.kind == "long-prompt":
        return _long_prompt(spec.long_prompt, spec.seed)
    if spec.kind == "lora":
        return _lora(spec.lora, spec.seed)
    raise ValueError(f"unknown workload {spec.kind!r}; choose one of {', '.join(WORKLOAD_KINDS)}")


def group_prefix_words(spec: SharedPrefixSpec, seed: int) -> list[list[str]]:
    """The system prompt (as words) of each group; shared by `_shared_prefix` and its tests."""
    prefix_rng = random.Random(f"{seed}:prefixes")
    prefixes = []
    for g in range(spec.groups):
        # The group id leads, so groups differ from their first block on.
        prefixes.append(["group", str(g), *_words(prefix_rng, max(0, spec.prefix_tokens - 2))])
    return prefixes


def _shared_prefix(spec: SharedPrefixSpec, seed: int) -> Iterator[BenchRequest]:
    prefixes = group_prefix_words(spec, seed)
    pick_rng = random.Random(f"{seed}:groups")
    text_rng = random.Random(f"{seed}:suffixes")
    index = 0
    while True:
        g = pick_rng.randrange(spec.groups)
        suffix = _unique_words(index, spec.suffix_tokens, text_rng)
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("system", _text(prefixes[g])), ChatMessage("user", _text(suffix))),
            max_tokens=spec.output_tokens,
            group=f"group-{g}",
            nominal_words=(*prefixes[g], *suffix),
        )
        index += 1


@dataclass
class _Conversation:
    ident: int
    history: list[ChatMessage]
    words: list[str]
    turns_sent: int = 0
    last_index: int | None = None


def _multi_turn(spec: MultiTurnSpec, seed: int) -> Iterator[BenchRequest]:
    rng = random.Random(f"{seed}:multi-turn")
    next_ident = 0

    shared = [
        _words(random.Random(f"{seed}:system-prompt:{k}"), spec.first_turn_tokens)
        for k in range(spec.system_prompts)
    ]

    def new_conversation() -> _Conversation:
        nonlocal next_ident
        if shared:
            opening = list(shared[next_ident % len(shared)])
        else:
            opening = ["conversation", str(next_ident), *_words(rng, max(0, spec.first_turn_tokens - 2))]
        conv = _Conversation(next_ident, [ChatMessage("system", _text(opening))], list(opening))
        next_ident += 1
        return conv

    active = [new_conversation() for _ in range(spec.conversations)]
    index = 0
    while True:
        slot = rng.randrange(len(active))
        conv = active[slot]
        if conv.turns_sent > 0:
            # The reply is synthetic (not the server's) so the workload stays reproducible and
            # identical across the strategies being compared.
            reply = _words(rng, spec.assistant_turn_tokens)
            conv.history.append(ChatMessage("assistant", _text(reply)))
            conv.words.extend(reply)
        question = _unique_words(index, spec.user_turn_tokens, rng)
        conv.history.append(ChatMessage("user", _text(question)))
        conv.words.extend(question)
        yield BenchRequest(
            index=index,
            messages=tuple(conv.history),
            max_tokens=spec.output_tokens,
            group=f"conversation-{conv.ident}",
            depends_on=conv.last_index,
            nominal_words=tuple(conv.words),
        )
        conv.last_index = index
        conv.turns_sent += 1
        index += 1
        if conv.turns_sent >= spec.turns:
            active[slot] = new_conversation()


def _random(spec: RandomSpec, seed: int) -> Iterator[BenchRequest]:
    rng = random.Random(f"{seed}:random")
    index = 0
    while True:
        n = rng.randint(spec.min_prompt_tokens, spec.max_prompt_tokens)
        words = _unique_words(index, n, rng)
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("user", _text(words)),),
            max_tokens=rng.randint(spec.min_output_tokens, spec.max_output_tokens),
            group=f"request-{index}",
            nominal_words=tuple(words),
        )
        index += 1


def _long_prompt(spec: LongPromptSpec, seed: int) -> Iterator[BenchRequest]:
    rng = random.Random(f"{seed}:long-prompt")
    index = 0
    while True:
        long = rng.random() < spec.long_fraction
        if long:
            n = rng.randint(spec.min_long_tokens, spec.max_long_tokens)
        else:
            n = rng.randint(spec.min_short_tokens, spec.max_short_tokens)
        words = _unique_words(index, n, rng)  # unique from the start: nothing cached anywhere
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("user", _text(words)),),
            max_tokens=spec.output_tokens,
            group=f"{'long' if long else 'short'}-{index}",
            nominal_words=tuple(words),
        )
        index += 1


def _lora(spec: LoRASpec, seed: int) -> Iterator[BenchRequest]:
    rng = random.Random(f"{seed}:lora")
    names = spec.names()
    weights = [1.0 / (i + 1) ** spec.zipf for i in range(spec.adapters)]
    prefixes = {name: _words(random.Random(f"{seed}:lora:{name}"), spec.prefix_tokens) for name in names}
    base = _words(random.Random(f"{seed}:lora:base"), spec.prefix_tokens)
    index = 0
    while True:
        adapter = None if rng.random() < spec.base_fraction else rng.choices(names, weights)[0]
        prefix = base if adapter is None else prefixes[adapter]
        question = _unique_words(index, spec.suffix_tokens, rng)
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("system", _text(prefix)), ChatMessage("user", _text(question))),
            max_tokens=spec.output_tokens,
            group=adapter or "base",
            nominal_words=tuple(prefix + question),
            model=adapter,
        )
        index += 1
