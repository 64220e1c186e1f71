"""Logprobs from the model's raw distribution (before temperature, penalties and bias: SGLang's default),
and which logits rows of a step score which prompt tokens."""

from dataclasses import dataclass

import torch

from engine.runtime.request import Entry, Logprobs, Req


def logprob_entries(logits: torch.Tensor, targets: list[int], top_n: int, ids: list[int] | None
                    ) -> tuple[list[Entry], list[list[Entry]] | None, list[list[Entry]] | None, list[int]]:
    """Per row of raw logits [n, V]: logprob of targets[i], top_n, asked ids, rank of targets[i] (1 + more likely)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1))
    ranks, token = ((lp > chosen_t).sum(dim=-1) + 1).tolist(), list(zip(chosen_t[:, 0].tolist(), targets))
    top = None
    if top_n > 0:
        vals, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        top = [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    wanted = [list(zip(row, ids)) for row in lp[:, torch.tensor(ids, device=lp.device)].tolist()] if ids else None
    return token, top, wanted, ranks


@dataclass
class PromptRows:
    """The logits rows of a step that score request prompt tokens: rows[first:first + len(targets)]."""

    first: int
    targets: list[int]
    null_first: bool  # this chunk starts the prompt at logprob_start_len 0: one entry with no logprob


def plan_prompt_rows(req: Req, prefix: int, n: int, offset: int, rows: list[int]) -> PromptRows:
    """Append to `rows` the batch rows whose logits score prompt tokens prefix..prefix+n-1 (batch offset `offset`)."""
    lp, p, first = req.logprob, len(req.prompt_ids), len(rows)
    if not lp.return_logprob or lp.logprob_start_len < 0 or req.prompt_logprobs_done:
        return PromptRows(first, [], False)
    lo, hi = max(prefix, lp.logprob_start_len - 1), min(prefix + n, p - 1)
    rows.extend(offset + j - prefix for j in range(lo, hi))
    req.prompt_logprobs_done = prefix + n >= p
    return PromptRows(first, [req.prompt_ids[j + 1] for j in range(lo, hi)], prefix == 0 and lp.logprob_start_len == 0)


def record_prompt(req: Req, plan: PromptRows, logits: torch.Tensor) -> None:
    if plan.null_first:
        req.pending.extend(Logprobs(input_token=[(None, req.prompt_ids[0])], input_top=[None],
                                    input_ids=[None], input_rank=[None]))
    if plan.targets:
        tok, top, ids, ranks = logprob_entries(logits[plan.first:plan.first + len(plan.targets)], plan.targets,
                                               req.logprob.top_logprobs_num, req.logprob.token_ids_logprob)
        none = [None] * len(tok)
        req.pending.extend(Logprobs(input_token=tok, input_top=top or none, input_ids=ids or none, input_rank=ranks))


def record_output(req: Req, row: list[float], top_n: int, ids: list[int]) -> None:
    """A read-back row of `Sampler.logprob_table(..., top_n, ids)`: sampled token, its logprob, top-n and asked ids."""
    k, asked, tops = min(req.logprob.top_logprobs_num, top_n), req.logprob.token_ids_logprob, 2 + top_n
    top = [list(zip(row[2:2 + k], map(int, row[tops:tops + k])))] if k else []
    picked = [[(row[tops + top_n + ids.index(i)], i) for i in asked]] if asked else []
    req.pending.extend(Logprobs(output_token=[(row[1], int(row[0]))], output_top=top, output_ids=picked))
