"""A beam-search step's effect on sequences and blocks: fork, drop, finish.

The search's rules are `BeamGroup.select` (engine/core/beam.py); this applies its answer. A
running beam continued by one candidate appends the token in place; one continued by several
forks (the children share all its blocks through their reference counts, and the partly filled
tail block is copied on write by whichever appends to it first); one continued by none is dropped
and frees its blocks at once. Full blocks keep their hashes, so the prompt's blocks stay in the
prefix cache for later requests.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.core.beam import BeamGroup, Candidate
from engine.core.sequence import Request, SeqStatus, Sequence, SequenceQueues
from engine.sample.beam import BeamCandidate


def new_beam_group(req: Request, max_model_len: int, eos_token_ids: tuple[int, ...]) -> BeamGroup:
    p = req.params
    room = max_model_len - len(req.prompt_token_ids)
    return BeamGroup(
        width=p.beam_width,
        eos_token_ids=frozenset() if p.ignore_eos else frozenset(eos_token_ids),
        stop_token_ids=frozenset(p.stop_token_ids),
        length_penalty=p.length_penalty,
        early_stopping=p.early_stopping,
        max_generated=min(room, p.max_tokens) if p.max_tokens is not None else room,
    )


def advance_beams(
    req: Request,
    beams: list[Sequence],
    ranked: list[BeamCandidate],
    scheduler: SequenceQueues,
    seq_ids: Iterator[int],
) -> None:
    """One step of the request's search, given its running `beams` and their ranked candidates."""
    group = req.beam
    assert group is not None
    cands = [Candidate(beams[c.beam], c.token_id, c.cumulative_logprob) for c in ranked]
    running = group.select(cands, beams[0].num_output_tokens)
    if group.done:
        end_beams(req, scheduler, None)
        return
    # Forks first: a child copies its parent's tokens before the parent appends its own.
    taken: set[int] = set()
    new: list[Sequence] = []
    for c in running:
        parent = c.parent
        if parent.seq_id not in taken:
            taken.add(parent.seq_id)
            new.append(parent)
            continue
        child = Sequence(
            next(seq_ids),
            req,
            group.next_index,
            list(parent.token_ids),
            parent.block_size,
            block_hashes=list(parent.block_hashes),
            num_computed_tokens=parent.num_computed_tokens,
        )
        group.next_index += 1
        scheduler.kv.fork(parent, child)
        new.append(child)
    for seq, c in zip(new, running, strict=True):
        seq.append_token(c.token_id)
        seq.cum_logprob = c.cumulative_logprob
    scheduler.regroup(beams, new)  # frees the dropped beams' blocks
    req.seqs = new
    req.forked = True


def end_beams(req: Request, scheduler: SequenceQueues, reason: str | None) -> None:
    """The search is over (reason None) or failed: every running beam frees its blocks."""
    assert req.beam is not None
    for seq in req.seqs:
        if seq.status is not SeqStatus.FINISHED:
            scheduler.remove(seq)
            seq.finish(reason or "stop")
    req.beam.done = True


def fail_beam_groups(failed: list[tuple[Sequence, str]], scheduler: SequenceQueues) -> None:
    """A beam that failed (already finished with "error") fails its whole group."""
    for seq, _ in failed:
        if seq.request.beam is not None and not seq.request.beam.done:
            end_beams(seq.request, scheduler, "error")
