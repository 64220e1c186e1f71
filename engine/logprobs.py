"""Logprobs from the model's raw distribution (before temperature, penalties and bias: SGLang's default)."""

from __future__ import annotations

import torch

Entry = tuple[float, int]


def logprob_entries(logits: torch.Tensor, targets: list[int], top_n: int, ids: list[int] | None
                    ) -> tuple[list[Entry], list[list[Entry]] | None, list[list[Entry]] | None]:
    """For each row of raw logits [n, V]: (logprob of targets[i], top_n alternatives, requested ids)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1))[:, 0].tolist()
    token = [(v, t) for v, t in zip(chosen, targets)]
    top = None
    if top_n > 0:
        vals, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        top = [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    wanted = None
    if ids:
        picked = lp[:, torch.tensor(ids, device=lp.device)].tolist()
        wanted = [list(zip(row, ids)) for row in picked]
    return token, top, wanted
