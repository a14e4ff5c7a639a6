"""From a step's logits to each request's next token.

Per row, in this order: the request's penalties and logit bias (runtime/penalties.py),
the alternatives the model offered (runtime/sampler.py TopK, taken before the mask so they
show what the model itself preferred), the grammar mask (runtime/grammar.py), the draw
(runtime/sampler.py sample). A request with drafts (jump-forward's from its grammar, or
prompt lookup's from earlier n-grams: runtime/prompt_lookup.py) has one row per draft and
each row is picked exactly so, so its output is the one token-by-token decoding gives.

The picker decides; the engine applies (Request.append, events, the stream). A request
whose own logits, grammar or sampling parameters go wrong gets a pick with its error and
fails alone: the rest of its batch goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import EventBus
from sgl_nb.runtime.grammar import GrammarError
from sgl_nb.runtime.model.forward_batch import Alternatives
from sgl_nb.runtime.penalties import adjust_logits
from sgl_nb.runtime.prompt_lookup import MAX_BATCH, PromptLookup
from sgl_nb.runtime.request import Request
from sgl_nb.runtime.sampler import Sampled, TopK, float_cpu, sample, top_alternatives
from sgl_nb.runtime.token_choice import Alternative, TokenChoice


class AheadRows(NamedTuple):
    """One request's rows of a decode ahead."""

    req: Request
    rows: torch.Tensor  # [steps, vocab] fp32: its logits after each step
    alternatives: Alternatives | None = None  # where the step computed them, a row each


class PickRows(NamedTuple):
    """The logits of one step that choose a next token."""

    last: torch.Tensor  # [B, vocab]: each request's row at its last computed token
    ready: list[tuple[int, Request]]  # (row of `last`, request) taking one token
    # Jump-forward: a request with drafts, and its rows (fp32, CPU): the logits after each
    # of its new tokens, the last one's row last.
    drafted: list[tuple[Request, torch.Tensor]]
    # A decode ahead (ForwardBatch.ahead): a request whose drafts are the greedy picks the
    # step took as its later inputs, and its rows, one per step.
    ahead: tuple[AheadRows, ...] = ()


class TokenPick(NamedTuple):
    """One token for a request, or the error it fails with."""

    req: Request
    sampled: Sampled | None = None  # None when it fails
    error: BaseException | None = None
    # The grammar left only this token, or it is a jump-forward draft the model's own pick
    # agreed with.
    forced: bool = False
    allowed: int = -1  # tokens the grammar left at this step; -1: no grammar
    choice: TokenChoice | None = None  # None when alternatives are not recorded
    drafted: bool = False  # a prompt-lookup draft the model's own pick agreed with


class MaskedRows(NamedTuple):
    """Rows after the penalties and the grammar mask: those that still sample a token."""

    rows: torch.Tensor
    reqs: list[Request]
    top: TopK | None  # the alternatives of those rows (None when not recorded)
    failed: list[TokenPick]  # the requests whose penalties or grammar failed, in order


@dataclass
class DraftCounts:
    """Jump-forward's, or prompt lookup's."""

    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # drafts the model's own pick agreed with (taken)
    steps_saved: int = 0  # decode steps those saved


class TokenPicker:
    def __init__(self, tokenizer, settings: EngineConfig, events: EventBus,
                 drop_drafts: Callable[[Request], None]):
        """drop_drafts: the scheduler's, which frees the KV a step computed for drafts
        that the model's pick turned down."""
        self.tokenizer, self.events = tokenizer, events
        self.settings = settings  # read at each step: the engine may swap it (Engine.settings)
        self._drop_drafts = drop_drafts
        self.jumps = DraftCounts()
        self.lookups = DraftCounts()
        self.aheads = DraftCounts()  # decode ahead's: steps_saved counts engine passes
        self.lookup = PromptLookup()
        self._step_size = 0  # requests picking a token in the current step
        # Token id -> its text, decoded once: every step names k alternatives (a decode
        # is ~2 us, a lookup a tenth of that).
        self._token_texts: dict[int, str] = {}

    def pick(self, rows: PickRows) -> Iterator[TokenPick]:
        """The step's picks, in the order they are to be applied. The caller applies each
        one (Request.append) before it asks for the next: a draft's next row is penalized
        and masked from the output and grammar state that the previous pick left, and new
        drafts are proposed from the state after a request's token."""
        self._step_size = len(rows.ready) + len(rows.drafted) + len(rows.ahead)
        if rows.ready:
            yield from self._pick_ready(rows.last, rows.ready)
        for req, logits in rows.drafted:
            yield from self._pick_drafted(req, logits)
        for ahead in rows.ahead:
            yield from self._pick_ahead(ahead)

    def token_text(self, token: int) -> str:
        """One token's own text (as the token event has always given it), decoded once."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _pick_ready(self, last: torch.Tensor,
                    ready: list[tuple[int, Request]]) -> Iterator[TokenPick]:
        """One token for each request from its last row of logits, sampled together."""
        reqs = [r for _, r in ready]
        if len(ready) < last.shape[0]:
            last = last[torch.tensor([i for i, _ in ready], device=last.device)]
        rows, reqs, top, failed = self._mask_rows(float_cpu(last), reqs)
        yield from failed
        if not reqs:
            return
        sampled = sample(rows, [r.params for r in reqs], [r.generator for r in reqs],
                         all_logprobs=self.events.active, top=top)
        alts = top.lists(rows, [s.token for s in sampled]) if top is not None else None
        for b, (req, s) in enumerate(zip(reqs, sampled)):
            yield self._token_pick(req, s, alts[b] if alts else None)
            self._propose_drafts(req)

    def _pick_drafted(self, req: Request, rows: torch.Tensor) -> Iterator[TokenPick]:
        """A request that had draft tokens: rows[j] are the logits after its j-th new token.
        Each row picks the next token exactly as a decode step would (penalties, grammar
        mask, sampler, seeded generator in the same order), so the output is the one token
        by token decoding gives. While the pick is the next draft, the draft is taken
        (jump-forward's: forced; prompt lookup's: drafted); the first pick that differs is
        taken instead, and the drafts after it are dropped with their KV.

        Under sampling this is speculative sampling's rejection rule for a draft that is a
        single token d (a point mass q = 1 at d): the pick is drawn from the row's p, so
        the draft is taken with probability p(d) = min(1, p(d) / q(d)); when it is not, the
        pick is distributed as p(x) / (1 - p(d)) over x != d, which is the rule's residual
        max(0, p - q) renormalized. Each row's p is conditioned on the drafts taken before
        it, as decoding's would be, so every token has decoding's distribution (and a
        seeded request draws the same numbers in the same order: the same tokens).
        tests/test_prompt_lookup.py checks both frequencies."""
        ours = self.lookup.drafting(req.rid)
        counts = self.lookups if ours else self.jumps
        taken = agreed_n = 0
        for j in range(rows.shape[0]):
            row, kept, top, failed = self._mask_rows(rows[j : j + 1], [req])
            yield from failed
            if not kept:
                return
            s = sample(row, [req.params], [req.generator], all_logprobs=self.events.active,
                       top=top)[0]
            agreed = self._against_draft(req, s, counts)
            s.forced = agreed and not ours
            agreed_n += agreed
            yield self._token_pick(req, s, top.lists(row, [s.token])[0] if top is not None
                                   else None, drafted=agreed and ours)
            taken += 1
            if req.finished or not agreed:
                break  # the rows after a pick of its own belong to dropped drafts
        counts.steps_saved += max(taken - 1, 0)
        if ours and not req.draft_ids:
            self.lookup.checked(req.rid, agreed_n, len(req.output_ids))
        if not req.draft_ids:
            self._propose_drafts(req)

    def _pick_ahead(self, ahead: AheadRows) -> Iterator[TokenPick]:
        """A request that decoded ahead: rows[j] are its logits after its j-th new token,
        its drafts the greedy picks the step took. Its rows are independent of its picks
        (Scheduler._steps_ahead: greedy, no grammar or penalties), so they are masked and
        sampled together, and each pick is taken in order as _pick_drafted takes a
        draft's: while it is the next draft, that draft is taken; at the first that
        differs (a tie the step broke otherwise) the drafts after it are dropped with
        their KV. Its tokens are then the ones a step a token gives."""
        req, rows = ahead.req, ahead.rows
        rows, reqs, top, failed = self._mask_rows(float_cpu(rows), [req] * rows.shape[0],
                                                  ahead.alternatives)
        yield from failed[:1]
        if failed or not reqs:
            return
        sampled = sample(rows, [req.params] * len(reqs), [req.generator] * len(reqs),
                         all_logprobs=self.events.active, top=top)
        alts = top.lists(rows, [s.token for s in sampled]) if top is not None else None
        self.aheads.drafted += len(req.draft_ids)
        for j, s in enumerate(sampled):
            agreed = self._against_draft(req, s, self.aheads)
            yield self._token_pick(req, s, alts[j] if alts else None)
            if req.finished or not agreed:
                break
        self.aheads.steps_saved += j
        if not req.draft_ids:
            self._propose_drafts(req)

    def _against_draft(self, req: Request, s: Sampled, counts: DraftCounts) -> bool:
        """Whether pick s is req's next draft. If so the draft is taken (and counted);
        if not, req's drafts are dropped with their KV: the rows after a pick of its own
        belong to tokens it did not pick."""
        agreed = bool(req.draft_ids) and s.token == req.draft_ids[0]
        if agreed:
            req.draft_ids.pop(0)
            counts.accepted += 1
        else:
            self._drop_drafts(req)
        return agreed

    def _propose_drafts(self, req: Request) -> None:
        """The drafts req's next step computes together with its last token: the text its
        grammar forces next (jump-forward), else, where its context has the n-gram its
        output ends with, the tokens that followed it there (prompt lookup)."""
        self.lookup.clear(req.rid)  # drafts the scheduler dropped unchecked (no memory)
        if req.finished:
            return
        left = req.max_new_tokens - len(req.output_ids)
        if req.grammar is not None and req.params.uses_jump_forward(self.settings.jump_forward):
            req.draft_ids = req.grammar.jump_forward(self.tokenizer, left)
            self.jumps.drafted += len(req.draft_ids)
            if req.draft_ids:
                return
        if (self._step_size > MAX_BATCH
                or not req.params.uses_prompt_lookup(self.settings.prompt_lookup)):
            return
        # A grammar's request: only drafts its grammar could take (a rejected draft never
        # reaches the matcher either way: it is accepted only once picked).
        allowed = req.grammar.allowed_prefix if req.grammar is not None else None
        req.draft_ids = self.lookup.propose(req.rid, req.prompt_ids, req.output_ids, left,
                                            allowed)
        self.lookups.drafted += len(req.draft_ids)

    def _mask_rows(self, rows: torch.Tensor, reqs: list[Request],
                   computed: Alternatives | None = None) -> MaskedRows:
        """Penalties, then the top alternatives, then the grammar masks, on each request's
        row of logits (in place). The alternatives come between the two so that they show
        what the model offered, masked or not. computed: the rows' alternatives where the
        step gave them (AheadRows; rows without penalties)."""
        failed: list[TokenPick] = []
        # Only rows with penalties: indexing a row is a torch op (see sampler.float_cpu).
        penalized = [i for i, r in enumerate(reqs) if r.params.adjusts_logits]
        failed_rows = set(penalized) - set(
            self._rows_that(self._penalize, rows, penalized, reqs, failed))
        keep = [i for i in range(len(reqs)) if i not in failed_rows]
        k = self.settings.token_alternatives
        if k and computed is not None and not penalized and computed[0] and \
                len(computed[0][0]) == min(k, rows.shape[-1]):  # as many as asked for now
            top = TopK(*computed, argmax_first=True)
        else:
            top = top_alternatives(rows, k) if k else None  # the whole batch at once
        grammars = [i for i in keep if reqs[i].grammar is not None]
        if grammars:
            masked = set(self._rows_that(self._mask, rows, grammars, reqs, failed))
            keep = [i for i in keep if i in masked or reqs[i].grammar is None]
            if top is not None:
                top.mark_masked(rows)
        if len(keep) < len(reqs):
            rows, reqs = rows[keep], [reqs[i] for i in keep]
            top = top.select(keep) if top is not None else None
        return MaskedRows(rows, reqs, top, failed)

    @staticmethod
    def _rows_that(fn: Callable[[torch.Tensor, Request], None], rows: torch.Tensor,
                   which: Iterable[int], reqs: list[Request],
                   failed: list[TokenPick]) -> list[int]:
        """fn(row, request) for each row in `which`; those it did not fail on. A failure
        goes to `failed` as that request's pick."""
        ok = []
        for i in which:
            try:
                fn(rows[i], reqs[i])
            except Exception as e:  # noqa: BLE001 - handed to the request's caller
                failed.append(TokenPick(reqs[i], error=e))
                continue
            ok.append(i)
        return ok

    @staticmethod
    def _penalize(row: torch.Tensor, r: Request) -> None:
        adjust_logits(row, r.params, r.prompt_ids, r.output_ids, sorted(r.stop_tokens))

    @staticmethod
    def _mask(row: torch.Tensor, r: Request) -> None:
        p = r.params
        r.grammar.mask(row)
        if r.grammar.allowed == 0:
            what = f"regex {p.regex!r}" if p.regex is not None else "JSON schema"
            raise GrammarError(
                f"request {r.rid}: its {what} allows no next token after "
                f"{len(r.output_ids)} generated ({r.text[-40:]!r}): no token of the "
                "model's vocabulary continues it")

    def _token_pick(self, req: Request, s: Sampled, alts: tuple | None,
                    drafted: bool = False) -> TokenPick:
        """alts: its row of TopK.lists (None when alternatives are not recorded)."""
        if s.error is not None:  # its own sampling parameters: a ValueError, like bad input
            return TokenPick(req, error=ValueError(f"request {req.rid}: {s.error}"))
        grammar = req.grammar
        forced = s.forced or (grammar is not None and grammar.forced)
        allowed = grammar.allowed if grammar is not None else -1
        choice = None
        if alts is not None and req.token_choices is not None:
            choice = self._choice(s.token, forced, allowed, alts)
        return TokenPick(req, s, None, forced, allowed, choice, drafted)

    def _choice(self, token: int, forced: bool, allowed: int, alts: tuple) -> TokenChoice:
        ids, logprobs, masked, chosen = alts
        text = self.token_text
        top = [Alternative(t, text(t), lp, m) for t, lp, m in zip(ids, logprobs, masked)]
        return TokenChoice(token, text(token), chosen, forced, allowed, top)
