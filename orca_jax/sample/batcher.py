"""What each row of a batch asks of the sampler, as host arrays (numpy, no jax).

Each iteration `SamplingBatcher.rows` turns the plan's rows into the sampling program's per-row inputs:
the sampling parameters, and, for a batch where any row processes its logits, a sparse per-row logit
table (bias or ban entries from the rows' LogitsRules, some conditional on the previous token when that
token is still on device), the packed allowed-token bitmask (allowed_token_ids, and whatever a
TokenMaskSource, structured output's seam, allows this step), and the penalty slots: rows of the
device's token-count tables that the host assigns to requests using penalties and fills from their
tokens when a request gets one (first sample, after a preemption, or after its slot went to another
request).

The batch's sampling mode is static (one program each, see ops/sampling.py): GREEDY when no kept row
samples; SAMPLE when every sampled row has 0 < top_k <= TOP_K_CANDIDATES (drawn from a bounded
candidate set) or needs the whole vocabulary with no threshold (top_k 0, top_p 1); SEARCH when some
row needs a top-p threshold over the whole vocabulary (top_p < 1, top_k 0); SEARCH_TOP_K when some
row has a top_k above TOP_K_CANDIDATES (a top-k threshold too: rare, and twice SEARCH's passes).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from orca_jax.core.request import Request
from orca_jax.core.sched.output import ScheduledRequest, keeps_sample
from orca_jax.sample.inputs import SamplingInputs
from orca_jax.sample.mode import FILL_ENTRIES, FILL_RESETS, TOP_K_CANDIDATES, SampleMode
from orca_jax.sample.rules import LogitsRules
from orca_jax.sampling_params import SamplingParams


def sample_mode(sampled: Sequence[SamplingParams]) -> SampleMode:
    """The mode a batch whose sampled rows (kept, temperature > 0) have these parameters needs."""
    if not sampled:
        return SampleMode.GREEDY
    if any(sp.top_k > TOP_K_CANDIDATES for sp in sampled):
        return SampleMode.SEARCH_TOP_K
    if any(sp.top_k == 0 and sp.top_p < 1.0 for sp in sampled):
        return SampleMode.SEARCH
    return SampleMode.SAMPLE


_NO_RULES = LogitsRules(np.zeros(0, np.int32), np.zeros(0, np.float32), (), np.zeros(0, np.int32), 0, False, None)


class PenaltySlots:
    """Which request owns which row of the device's token-count tables (host side only).

    A request keeps its slot until it finishes; when every slot is taken, the least recently used one
    held by a request outside the current batch is taken over (its owner is filled again from its
    tokens if it returns). A slot is filled for one KV lifetime (generation = num_preemptions): a
    preempted request's in-flight token may have been counted and then dropped, so it is refilled.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._owner: list[tuple[Request, int] | None] = [None] * num_slots
        self._slot_of: dict[Request, int] = {}
        self._last_used = [0] * num_slots
        self._clock = 0

    def slot_of(self, request: Request) -> int | None:
        return self._slot_of.get(request)

    def assign(self, request: Request, busy: set[int]) -> tuple[int, bool]:
        """(the request's slot, whether it must be filled from its tokens); `busy`: slots of the current
        batch's rows, never taken over."""
        self._clock += 1
        slot = self._slot_of.get(request)
        fresh = slot is None or self._owner[slot][1] != request.num_preemptions
        if slot is None:
            free = [s for s, owner in enumerate(self._owner) if owner is None]
            if free:
                slot = free[0]
            else:
                candidates = [s for s in range(self.num_slots) if s not in busy]
                if not candidates:
                    raise RuntimeError(f"all {self.num_slots} penalty slots are in this batch")
                slot = min(candidates, key=self._last_used.__getitem__)
                del self._slot_of[self._owner[slot][0]]
            self._slot_of[request] = slot
        self._owner[slot] = (request, request.num_preemptions)
        self._last_used[slot] = self._clock
        return slot, fresh

    def release(self, request: Request) -> None:
        slot = self._slot_of.pop(request, None)
        if slot is not None:
            self._owner[slot] = None


class TokenMaskSource(Protocol):
    """Allowed tokens a component outside the sampler decides per step (structured output's grammar
    matcher): the seam through which such masks reach the device's bitmask."""

    def token_mask(self, request: Request, step: int) -> np.ndarray | None:
        """i32[ceil(V / 32)] (pack_token_mask's layout) for the request's sample after `step` outputs,
        or None: no constraint from this source."""
        ...


@dataclasses.dataclass(slots=True)
class _Fill:
    resets: list[int] = dataclasses.field(default_factory=list)
    entries: list[np.ndarray] = dataclasses.field(default_factory=list)  # i32[n, 3] pieces
    num_entries: int = 0


class SamplingBatcher:
    """The sampling inputs of each batch (`rows`), and the penalty slots behind them."""

    def __init__(self, num_penalty_slots: int, logits_width: int, table_width: int,
                 max_logprobs: int = SamplingParams.MAX_TOP_LOGPROBS, token_masks: TokenMaskSource | None = None):
        self.slots = PenaltySlots(num_penalty_slots)
        self.token_masks = token_masks  # per-step allowed tokens from outside (None: allowed_token_ids only)
        self.logits_width = logits_width  # V of the logits; an id of V in the table is padding (dropped)
        self.table_width = table_width
        self.max_logprobs = max_logprobs

    def release(self, request: Request) -> None:
        """A finished request gives its penalty slot back."""
        self.slots.release(request)

    def rows(self, scheduled: Sequence[ScheduledRequest], s_pad: int) -> SamplingInputs:
        """The sampling inputs of these rows, padded to s_pad."""
        n = len(scheduled)
        out = {"temperature": np.zeros(s_pad, np.float32), "top_k": np.zeros(s_pad, np.int32),
               "top_p": np.ones(s_pad, np.float32), "min_p": np.zeros(s_pad, np.float32),
               "seed": np.zeros(s_pad, np.uint32), "step": np.zeros(s_pad, np.int32)}
        # One pass over the rows (this runs every iteration, per row): what each keeps and asks for.
        kept, seeds, steps = [False] * n, [0] * n, [0] * n
        sampled: list[int] = []  # kept rows drawn with their own parameters
        ruled: list[int] = []  # kept rows whose LogitsRules apply at this step
        wants_top = False
        for i, item in enumerate(scheduled):
            seeds[i], steps[i] = item.seed, item.step
            if not keeps_sample(item):
                continue  # a discarded sample is drawn greedily: never asks for a slower program
            kept[i] = True
            sp = item.sampling
            if sp.temperature != 0.0:  # not sp.greedy (inlined: per row)
                sampled.append(i)
            if sp.logprobs:
                wants_top = True
            rules = item.request.logits_rules
            if rules is not None and rules.applies_at(item.step):
                ruled.append(i)
        if n:
            out["seed"][:n] = seeds
            out["step"][:n] = steps
        params = [scheduled[i].sampling for i in sampled]
        if sampled:  # greedy rows keep the arrays' defaults (0, 0, 1, 0)
            for name in ("temperature", "top_k", "top_p", "min_p"):
                out[name][sampled] = [getattr(sp, name) for sp in params]
        mode = sample_mode(params)
        masks = {}  # row -> packed allowed tokens from the mask source
        if self.token_masks is not None:
            masks = {i: mask for i, item in enumerate(scheduled)
                     if kept[i] and (mask := self.token_masks.token_mask(item.request, item.step)) is not None}
        processed = sorted(masks.keys() | set(ruled)) if masks else ruled
        # SEARCH programs always process logits; processed ones always return the top logprobs
        # (sampler.sample_variants).
        is_processed = bool(processed) or mode >= SampleMode.SEARCH
        out.update(sample_mode=mode, num_top_logprobs=self.max_logprobs if wants_top or is_processed else 0,
                   logits_processed=is_processed)
        if out["logits_processed"]:
            out.update(self._processing(scheduled, processed, masks, s_pad))
        return SamplingInputs(**out)

    def _processing(self, scheduled: Sequence[ScheduledRequest], processed: list[int], masks: dict[int, np.ndarray],
                    s_pad: int) -> dict:
        """The logits-processing arrays (ops/penalties.py's LogitsArrays' fields, the bitmask, the slot fills)."""
        w = self.table_width
        out = {"presence_penalty": np.zeros(s_pad, np.float32), "frequency_penalty": np.zeros(s_pad, np.float32),
               "repetition_penalty": np.ones(s_pad, np.float32), "penalty_slot": np.full(s_pad, -1, np.int32),
               "sampled_source": np.full(s_pad, -1, np.int32),
               "bias_token_ids": np.full((s_pad, w), self.logits_width, np.int32),
               "bias_values": np.zeros((s_pad, w), np.float32), "bias_conditions": np.full((s_pad, w), -1, np.int32)}
        rules_of = {i: scheduled[i].request.logits_rules or _NO_RULES for i in processed}
        busy = {slot for i in processed if rules_of[i].uses_penalties
                and (slot := self.slots.slot_of(scheduled[i].request)) is not None}
        fills: list[tuple[int, Request]] = []
        mask = None
        penalized: list[tuple[int, int, SamplingParams]] = []  # (row, slot, its parameters)
        for i in processed:
            item = scheduled[i]
            request, rules = item.request, rules_of[i]
            pending = item.token_source >= 0
            if rules.has_entries:  # most rows (penalties alone) have no table entries: skip the work
                ids, values, conditions = rules.entries(request.output_token_ids, item.step, pending)
                out["bias_token_ids"][i, :len(ids)] = ids
                out["bias_values"][i, :len(ids)] = values
                out["bias_conditions"][i, :len(ids)] = conditions
            row_masks = [m for m in (rules.allowed_mask, masks.get(i)) if m is not None]
            if row_masks:
                if mask is None:
                    mask = np.full((s_pad, -(-self.logits_width // 32)), -1, np.int32)
                mask[i] = np.bitwise_and.reduce(row_masks)
            if rules.uses_penalties:
                slot, fresh = self.slots.assign(request, busy)
                busy.add(slot)
                penalized.append((i, slot, item.sampling))
                if fresh:
                    if pending:  # a row fed from the device was in the last batch, with this slot
                        raise RuntimeError(f"request {request.request_id!r} lost its penalty slot while in flight")
                    fills.append((slot, request))
        out["sampled_source"][processed] = [scheduled[i].token_source for i in processed]
        if penalized:  # the per-row scalars in one assignment per column
            rows = [i for i, _, _ in penalized]
            out["penalty_slot"][rows] = [slot for _, slot, _ in penalized]
            out["presence_penalty"][rows] = [sp.presence_penalty for _, _, sp in penalized]
            out["frequency_penalty"][rows] = [sp.frequency_penalty for _, _, sp in penalized]
            out["repetition_penalty"][rows] = [sp.repetition_penalty for _, _, sp in penalized]
        out["allowed_mask"] = mask
        out["penalty_resets"], out["penalty_fill"] = self._fill_calls(fills)
        return out

    @staticmethod
    def _fill_calls(fills: list[tuple[int, Request]]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(i32[calls, FILL_RESETS] slots to zero, i32[calls, FILL_ENTRIES, 3] (slot, token, count)
        entries after them; count 0 marks a prompt token), padded with -1; (None, None) for none."""
        if not fills:
            return None, None
        calls = [_Fill()]
        for slot, request in fills:
            prompt = np.unique(np.asarray(request.prompt_token_ids, np.int32))
            outputs, counts = np.unique(np.asarray(request.output_token_ids, np.int32), return_counts=True)
            entries = np.concatenate([np.stack([np.full_like(prompt, slot), prompt, np.zeros_like(prompt)], 1),
                                      np.stack([np.full_like(outputs, slot), outputs, counts.astype(np.int32)], 1)])
            if len(calls[-1].resets) == FILL_RESETS:
                calls.append(_Fill())
            calls[-1].resets.append(slot)  # before every entry of its slot, in this call or a later one
            while len(entries):
                room = FILL_ENTRIES - calls[-1].num_entries
                if room == 0:
                    calls.append(_Fill())
                    continue
                calls[-1].entries.append(entries[:room])
                calls[-1].num_entries += len(entries[:room])
                entries = entries[room:]
        resets = np.full((len(calls), FILL_RESETS), -1, np.int32)
        table = np.full((len(calls), FILL_ENTRIES, 3), -1, np.int32)
        for c, call in enumerate(calls):
            resets[c, :len(call.resets)] = call.resets
            if call.entries:
                table[c, :call.num_entries] = np.concatenate(call.entries)
        return resets, table
