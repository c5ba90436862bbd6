"""BeamGroup.select: transformers' beam rules on hand-made candidates (no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.beam import BeamGroup, Candidate


@dataclass
class FakeBeam:
    output_token_ids: list[int] = field(default_factory=list)


def cands(*rows: tuple[Any, int, float]) -> list[Candidate]:
    return [Candidate(p, t, s) for p, t, s in rows]  # type: ignore[arg-type]


def group(early: bool | str = True, lp: float = 1.0, max_generated: int = 5) -> BeamGroup:
    return BeamGroup(
        width=2,
        eos_token_ids=frozenset({9}),
        stop_token_ids=frozenset({8}),
        length_penalty=lp,
        early_stopping=early,
        max_generated=max_generated,
    )


def test_only_finishers_ranked_within_the_width_are_kept() -> None:
    g = group()
    assert g.num_candidates == 6  # (1 + two finishing tokens) * width
    a = FakeBeam()
    running = g.select(cands((a, 9, -1.0), (a, 3, -1.5), (a, 8, -1.6), (a, 4, -2.0)), 0)
    assert [(c.token_id, c.cumulative_logprob) for c in running] == [(3, -1.5), (4, -2.0)]
    assert [(h.token_ids, h.score, h.finish_reason) for h in g.finished] == [([9], -1.0, "stop")]
    assert g.finished[0].stop_reason is None  # EOS; a stop token id would be named
    assert not g.done


def test_early_stopping_true_ends_when_width_beams_finished() -> None:
    g = group(early=True)
    a, b = FakeBeam([3]), FakeBeam([4])
    g.select(cands((a, 8, -2.0), (b, 5, -2.2), (a, 6, -3.0)), 1)
    assert not g.done and g.finished[0].stop_reason == 8
    g.select(cands((b, 9, -2.5), (a, 5, -2.6), (a, 6, -3.0)), 2)
    assert g.done
    assert [h.token_ids for h in g.finished] == [[4, 9], [3, 8]]  # -2.5 / 3 beats -2.0 / 2


def test_early_stopping_false_runs_while_a_beam_could_win() -> None:
    g = group(early=False)
    a, b = FakeBeam([3]), FakeBeam([4])
    g.select(cands((a, 9, -2.0), (b, 8, -2.2), (a, 6, -2.3), (b, 5, -2.4)), 1)
    # Full (-1.0, -1.1); best running -2.3 / 2 = -1.15 is not above -1.1: the search ends.
    assert g.done and [h.score for h in g.finished] == [-1.0, -1.100000023841858]
    g2 = group(early=False)
    g2.select(cands((a, 9, -2.0), (b, 8, -2.2), (a, 6, -2.1), (b, 5, -2.4)), 1)
    assert not g2.done  # -2.1 / 2 = -1.05 beats -1.1


def test_length_limit_finishes_the_top_width_candidates() -> None:
    g = group(early="never", lp=2.0, max_generated=2)
    a = FakeBeam([1])
    running = g.select(cands((a, 3, -1.0), (a, 4, -2.0), (a, 5, -3.0)), 1)
    assert running == [] and g.done
    assert [(h.token_ids, h.finish_reason) for h in g.finished] == [
        ([1, 3], "length"),
        ([1, 4], "length"),
    ]
    assert g.finished[0].score == -0.25  # -1 / 2 ** 2
