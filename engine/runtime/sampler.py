"""Batched, per-request-reproducible token sampler. Per row: logit_bias → repetition penalty (prompt + output tokens) →
frequency and presence penalties (output tokens) → suppressed ids at -inf → greedy argmax, or temperature, top-k, top-p,
min-p and a random draw. Top-k, top-p and min-p filter one temperature-scaled distribution, as SGLang: a token survives
if among the k most likely, if the mass strictly before it is < top_p, and if its probability is >= min_p × the largest.

The draw is an exponential race, argmax(p / E) with E ~ Exp(1) per token: token i with probability p_i / sum(p), no
renormalizing. E is a hash of (the request's seed, the position drawn, the token id), not a generator's state: a seeded
request gets the same tokens wherever it sits in any batch (an unseeded one gets a random seed at admission)."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels import triton_pointwise as fused
from engine.runtime.sampling_params import SamplingParams

Ids = Sequence[Sequence[int]]  # token ids, a list per row
Suppressed = Sequence[set[int] | frozenset[int] | None] | None  # per row, the ids it may not sample now (None: none)


def _token_counts(rows: Ids, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 counts of each token id per row; ids outside [0, V) are ignored."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        ids = torch.tensor([list(r) + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
        ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # padding/out-of-range → spare column
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler:
    """The last call's per-row tensors (settings, draw keys, penalty token counts) stay on the device for a `carried`
    call (the same requests, a token further), which builds no tensor from Python lists (each a host-to-device copy)."""

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}  # the last call's per-row tensors and tokens; `_on_device`'s (list, tensor)s

    def process_logits(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Ids, prompt_ids: Ids,
                       suppress: Suppressed = None, carried: bool = False) -> torch.Tensor:
        """Apply logit_bias, penalties and suppression: float32 [B, V], the input untouched (returned itself,
        as float32, when no row needs anything). `carried`: the same requests as the last call, one token further."""
        b, v = logits.shape
        if not len(params) == len(output_ids) == len(prompt_ids) == b or (suppress is not None and len(suppress) != b):
            lens = "/".join("-" if z is None else str(len(z)) for z in (params, output_ids, prompt_ids, suppress))
            raise ValueError(f"sampler got {b} logit rows but params/output_ids/prompt_ids/suppress of lengths {lens}")
        sup = [(i, t) for i, s in enumerate(suppress or ()) for t in (s or ()) if 0 <= t < v]
        bias = [(i, int(k), float(val)) for i, p in enumerate(params) for k, val in (p.logit_bias or {}).items()]
        pen = any((p.repetition_penalty, p.frequency_penalty, p.presence_penalty) != (1.0, 0.0, 0.0) for p in params)
        x = logits.float()
        if not (sup or pen or bias):
            return x
        x = x.clone() if x is logits else x
        if bias:  # (one accumulate-scatter of every (row, token, bias))
            t = self._on_device("bias", bias, torch.float64, x.device)
            x.index_put_((t[:, 0].long(), t[:, 1].long()), t[:, 2].float(), accumulate=True)
        if pen:  # every row, its neutral penalties (1, 0, 0) leaving it as it is
            counts, seen, cols = self._penalty_rows(params, output_ids, prompt_ids, v, x.device, carried)
            rep, freq, pres = cols[:, 0:1], cols[:, 1:2], cols[:, 2:3]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)  # repetition: prompt + output tokens
            x = x - (freq * counts + pres * (counts > 0))  # frequency and presence: output tokens
        if sup:  # EOS / stop ids before min_new_tokens can never be chosen
            t = self._on_device("suppress", sup, torch.int64, x.device)
            x[t[:, 0], t[:, 1]] = float("-inf")
        return x

    def _on_device(self, key: str, rows: list[tuple], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """torch.tensor(rows) on `device`, built again only when `rows` changed (each build a host-to-device sync)."""
        if self._state.get(key, (None,))[0] != rows:
            self._state[key] = (rows, torch.tensor(rows, dtype=dtype, device=device))
        return self._state[key][1]

    def _penalty_rows(self, params: Sequence[SamplingParams], output_ids: Ids, prompt_ids: Ids, v: int,
                      device: torch.device, carried: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's output-token counts [B, V], whether each token is in its prompt or output [B, V], and its
        (repetition, frequency, presence) penalties [B, 3]: carried, the last call's with its tokens added."""
        st = self._state
        if carried and "counts" in st:
            t = st["tokens"][:, None]
            st["counts"].scatter_add_(1, t, torch.ones_like(t, dtype=torch.float32))
            st["seen"].scatter_(1, t, True)
        else:
            st["counts"] = _token_counts(output_ids, v, device)
            st["seen"] = _token_counts([list(a) + list(b) for a, b in zip(prompt_ids, output_ids)], v, device) > 0
            st["penalties"] = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                            for p in params], dtype=torch.float32, device=device)
        return st["counts"], st["seen"], st["penalties"]

    def filtered(self, logits: torch.Tensor, params: Sequence[SamplingParams], cols: torch.Tensor) -> torch.Tensor:
        """Processed logits [B, V] with the tokens top-k / top-p / min-p remove from the temperature softmax at -inf,
        every row as sampling (a greedy row keeps its most likely token); row i's settings: cols[i] (see `sample`)."""
        v = logits.shape[1]
        if not any(0 < p.top_k < v or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            return logits
        sp, order = torch.softmax(logits / cols[:, :1], dim=-1).sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(v, device=logits.device)[None, :]
        mass_before = F.pad(torch.cumsum(sp, dim=-1)[:, :-1], (1, 0))  # the mass strictly before each position
        drop = (ranks >= cols[:, 1:2]) | (mass_before >= cols[:, 2:3]) | (sp < sp[:, :1] * cols[:, 3:4])
        drop[:, 0] = False  # (the most likely token always survives)
        return logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Ids, prompt_ids: Ids,
               seeds: Sequence[int], suppress: Suppressed = None, carried: bool = False) -> torch.Tensor:
        """One token per row of raw logits [B, V] (int64 [B], on their device); row i's draw keyed by (seeds[i], the
        position it fills). `carried`: the requests of the last call, in its order, each fed the token it sampled."""
        if len(seeds) != logits.shape[0]:
            raise ValueError(f"sampler got {logits.shape[0]} logit rows but {len(seeds)} seeds")
        st, x = self._state, self.process_logits(logits, params, output_ids, prompt_ids, suppress, carried)
        if all(p.is_greedy for p in params):
            tokens = _argmax(x)
        else:
            v, dev = x.shape[1], x.device
            if not (carried and "pos" in st):  # NOTE: seeds and token ids hashed here, not at every step (half the ops)
                rows = torch.tensor([[_int64(s), len(a) + len(b) - 1, p.is_greedy] for s, a, b, p in
                                     zip(seeds, prompt_ids, output_ids, params)], dtype=torch.int64, device=dev)
                st.update(seed=seed_hash(rows[:, 0]), pos=rows[:, 1], greedy=rows[:, 2] > 0, vocab=token_hash(v, dev),
                          settings=torch.tensor([[p.temperature if not p.is_greedy else 1.0, p.top_k if 0 < p.top_k < v
                                                  else v, p.top_p if p.top_p < 1.0 else 2.0, p.min_p] for p in params],
                                                dtype=torch.float32, device=dev))  # (top-k off: V, top-p off: 2)
            st["pos"] = st["pos"] + 1  # (the position each row's token fills)
            x = self.filtered(x, params, st["settings"])  # NOTE: one race for every row: a draw is its own row's alone
            tokens = race(x, st["seed"], st["pos"], st["greedy"], st["settings"][:, 0], st["vocab"])
        st["tokens"] = tokens
        return tokens

    def logprob_table(self, logits: torch.Tensor, tokens: torch.Tensor, top_n: int, ids: list[int]) -> torch.Tensor:
        """Each row's sampled token, its logprob under the raw logits, the top_n logprobs, their ids and the logprobs
        of `ids`: float64 [B, 2 + 2 * top_n + len(ids)] on the device (read back as the step's one copy)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = lp.topk(top_n, dim=-1)
        asked = lp[:, self._on_device("logprob_ids", ids, torch.int64, lp.device)] if ids else lp[:, :0]
        return torch.cat([tokens[:, None], lp.gather(1, tokens[:, None]), top.values, top.indices, asked], 1).double()


_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2^32); every product stays below
    2^63 (multipliers under 2^31), so no step overflows int64 on any device."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def seed_hash(seeds: torch.Tensor) -> torch.Tensor:  # [B] int64 -> [B] 32-bit hashes
    return _mix(_mix(seeds & _M32) ^ ((seeds >> 32) & _M32))


def token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    return _mix(torch.arange(vocab, dtype=torch.int64, device=device) + 0x9E3779B9)  # [V]


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 Exp(1) noise, a pure function of (seed, position, token id) given as `seed_hash`es [B], positions
    [B] and `token_hash`es [V]: -log(u), u from 23 hashed bits (`unit`): never 0 or infinite (at most 16.6)."""
    row = _mix(seeds ^ (positions & _M32))  # [B]
    return -torch.log(unit(_mix(row[:, None] ^ tokens[None, :])))


def unit(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 in [0, 2^32)) as float32 in (0, 1): (k + 0.5) / 2^23 of their top 23 bits, exact in
    float32 (24 bits would round the top value up to 1, and -log(1) is a noise of 0)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0 ** -23


def _int64(seed: int) -> int:
    """A seed of any size (requests may give [-2^63, 2^64), n > 1 adds the sample's index) as an int64."""
    return (seed + 2**63) % 2**64 - 2**63


def race(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, greedy: torch.Tensor,
         temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The race in log space, argmax(x / t - log E) = argmax(softmax(x / t) / E); greedy rows' argmax. CUDA: 1 kernel."""
    if fused.serves(x):
        return fused.race(x, seeds, positions, greedy, temperature, tokens)
    keys = x / temperature[:, None] - torch.log(exponential_noise(seeds, positions, tokens))
    return _argmax(torch.where(greedy[:, None], x, keys))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first on a tie. NOTE: `max(dim).indices`, not `argmax`: 58 vs 173 us."""
    return x.max(dim=-1).indices
