"""lm-eval's HFLM, with the vocabulary projected only at the positions a request scores.

HFLM asks the model for logits at every input position and log-softmaxes all of them, while a
loglikelihood request reads only its continuation's positions; for a small model with a large
vocabulary that projection is a large share of the forward (docs/performance.md, "Zero-shot
scoring"). ``TailLogitsLM`` passes ``logits_to_keep`` so that the model projects the batch's last positions
only, from the earliest position any of its rows scores. HFLM itself places a row's continuation
from the end of the logits it gets (``inplen + logits_len - padded_len``), so every score is the
one HFLM computes; the zero-shot tests compare them with plain HFLM's on lm-eval's built-in tasks.

A model call does not say which requests its rows are, so ``_loglikelihood_tokens`` first records
each request's model input (the same truncation HFLM applies) with the position its scoring starts
at, and ``_model_call`` finds each right-padded row among them. Where a row is not found (or a call
comes from elsewhere) the call keeps every position, as HFLM does.
"""

from __future__ import annotations

import torch
from lm_eval.models.huggingface import HFLM

PAD = 0  # lm-eval pads causal batches on the right with zeros (lm_eval.models.utils.pad_and_concat)


class TailLogitsLM(HFLM):
    """HFLM that projects to the vocabulary only from the first position a batch row scores."""

    _scored_from: dict[tuple[int, ...], int] | None = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        scored_from = {}
        for _, context, continuation in requests:
            inp = tuple((context + continuation)[-(self.max_length + 1):][:-1])
            # the logits at [len(inp) - len(continuation), len(inp)) predict the continuation; one input
            # may end two requests split differently, so keep the earlier start
            start = max(0, len(inp) - len(continuation))
            scored_from[inp] = min(start, scored_from.get(inp, start))
        self._scored_from = scored_from
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._scored_from = None

    def _first_scored(self, row: list[int]) -> int | None:
        """Where the request this right-padded row holds starts being scored (None: not a known request)."""
        for length in range(len(row), 0, -1):
            start = self._scored_from.get(tuple(row[:length]))
            if start is not None:
                return start
            if row[length - 1] != PAD:  # a real token: the input cannot be shorter than this
                return None
        return None

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        if self._scored_from is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        starts = [self._first_scored(row) for row in inps.tolist()]
        if any(s is None for s in starts):
            return super()._model_call(inps)
        keep = inps.shape[1] - min(starts)
        dtype = getattr(self, "mixed_precision_dtype", None)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None):
            return self.model(inps, logits_to_keep=keep).logits
