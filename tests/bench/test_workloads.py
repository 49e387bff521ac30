"""Workload generators: deterministic by seed, the advertised shapes, clear errors for bad sizes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvgate.bench.workloads import (
    WORDS,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    WorkloadSpec,
    generate,
    group_prefix_words,
)


def take(spec: WorkloadSpec, n: int):
    return list(itertools.islice(generate(spec), n))


def test_same_seed_same_requests_other_seed_different() -> None:
    spec = WorkloadSpec(
        kind="shared-prefix", seed=7, shared_prefix=SharedPrefixSpec(groups=4, prefix_tokens=64)
    )
    a, b = take(spec, 50), take(spec, 50)
    assert [r.messages for r in a] == [r.messages for r in b]
    other = take(WorkloadSpec(kind="shared-prefix", seed=8, shared_prefix=spec.shared_prefix), 50)
    assert [r.messages for r in a] != [r.messages for r in other]


def test_shared_prefix_groups_share_system_prompt_and_users_differ() -> None:
    sp = SharedPrefixSpec(groups=3, prefix_tokens=100, suffix_tokens=12, output_tokens=9)
    reqs = take(WorkloadSpec(kind="shared-prefix", shared_prefix=sp), 300)
    by_group: dict[str, set[str]] = {}
    for r in reqs:
        system, user = r.messages
        assert (system.role, user.role) == ("system", "user")
        assert r.max_tokens == 9
        assert r.depends_on is None
        by_group.setdefault(r.group, set()).add(system.content)
        assert len(r.nominal_words) == 100 + 12
    assert len(by_group) == 3
    assert all(len(prompts) == 1 for prompts in by_group.values())
    assert len({p for ps in by_group.values() for p in ps}) == 3  # groups differ
    assert len({r.messages[1].content for r in reqs}) == len(reqs)  # every user question is unique
    # Groups are drawn uniformly: none is starved over 300 draws.
    counts = Counter(r.group for r in reqs)
    assert min(counts.values()) > 60


def test_group_prefixes_differ_from_the_first_words() -> None:
    prefixes = group_prefix_words(SharedPrefixSpec(groups=5, prefix_tokens=40), seed=0)
    assert len({tuple(p[:2]) for p in prefixes}) == 5
    assert all(len(p) == 40 for p in prefixes)
    assert all(w in WORDS for p in prefixes for w in p[2:])


def test_multi_turn_grows_the_prefix_and_chains_turns() -> None:
    mt = MultiTurnSpec(
        conversations=2, turns=3, first_turn_tokens=20, user_turn_tokens=5, assistant_turn_tokens=4
    )
    reqs = take(WorkloadSpec(kind="multi-turn", multi_turn=mt), 30)
    by_conv: dict[str, list] = {}
    for r in reqs:
        by_conv.setdefault(r.group, []).append(r)
    for turns in by_conv.values():
        assert len(turns) <= 3
        assert turns[0].depends_on is None
        for prev, cur in itertools.pairwise(turns):
            assert cur.depends_on == prev.index
            # Each turn resends the previous turn's whole history as its prefix.
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert cur.messages[len(prev.messages)].role == "assistant"
            assert cur.messages[-1].role == "user"
            assert len(cur.nominal_words) == len(prev.nominal_words) + 4 + 5
    # Finished conversations are replaced by new ones.
    assert len(by_conv) >= 30 // 3


def test_random_lengths_stay_in_bounds_and_share_nothing() -> None:
    rd = RandomSpec(min_prompt_tokens=10, max_prompt_tokens=30, min_output_tokens=2, max_output_tokens=5)
    reqs = take(WorkloadSpec(kind="random", random=rd), 100)
    assert all(10 <= len(r.nominal_words) <= 30 for r in reqs)
    assert all(2 <= r.max_tokens <= 5 for r in reqs)
    assert len({r.group for r in reqs}) == 100
    assert len({r.nominal_words[:2] for r in reqs}) == 100  # each opens with its own tag


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (WorkloadSpec(shared_prefix=SharedPrefixSpec(groups=0)), "--groups"),
        (WorkloadSpec(shared_prefix=SharedPrefixSpec(suffix_tokens=0)), "--suffix-tokens"),
        (WorkloadSpec(kind="multi-turn", multi_turn=MultiTurnSpec(turns=0)), "--turns"),
        (
            WorkloadSpec(kind="random", random=RandomSpec(min_prompt_tokens=50, max_prompt_tokens=10)),
            "prompt lengths",
        ),
    ],
)
def test_bad_sizes_are_clear_errors(spec: WorkloadSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next(generate(spec))


def test_warmup_requests_come_first_and_measured_ones_follow_in_the_same_stream() -> None:
    from kvgate.bench.loadgen import LoadSpec
    from kvgate.bench.runner import planned_requests

    spec = WorkloadSpec(kind="shared-prefix", shared_prefix=SharedPrefixSpec(groups=2, prefix_tokens=8))
    warm, measured = planned_requests(spec, LoadSpec(request_rate=1.0, num_requests=5, warmup_requests=3))
    assert [r.index for r in warm] == [0, 1, 2]
    assert [r.index for r in measured] == [3, 4, 5, 6, 7]
    assert [r.messages for r in warm + measured] == [r.messages for r in take(spec, 8)]


def test_conversations_can_share_their_system_prompts() -> None:
    def openings(system_prompts: int) -> list[tuple[str, ...]]:
        spec = WorkloadSpec(
            kind="multi-turn",
            multi_turn=MultiTurnSpec(
                conversations=6,
                turns=1,
                first_turn_tokens=40,
                user_turn_tokens=4,
                system_prompts=system_prompts,
            ),
        )
        return [req.nominal_words[:40] for req in itertools.islice(generate(spec), 6)]

    assert len(set(openings(0))) == 6  # each conversation its own
    shared = openings(2)
    assert len(set(shared)) == 2
    with pytest.raises(ValueError, match="--system-prompts"):
        WorkloadSpec(kind="multi-turn", multi_turn=MultiTurnSpec(system_prompts=-1)).validate()
