"""CPU vs CUDA: the same code on --device cuda. Skipped on machines without CUDA.

fp32 on CUDA against fp32 on CPU (shipped weights, a prompt past the sparse layers' top-k budget, so block
selection runs on both); bf16 on CUDA as a smoke test against fp32 (top-1 agreement and mean KL: bf16 rounding
flips a few block selections, so its logits are not held to fp32's tolerance); captured decode against eager
over 80 tokens that cross a block boundary, with the graphs replayed (one a batch size: Triton's kernels read each
row's key count); the model's decode step
and steady engine steps under CUDA's sync debug mode (no host sync); the overlap schedule against reading each step
back; the server over HTTP; the host KV tier under a CUDA pool.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_utils import TINY, make_engine, run_all, solo, submit
from server_utils import live_server

from engine.model.loader import load_model
from engine.runtime.request import LogprobOptions, NewRequest
from engine.runtime.sampling_params import SamplingParams
from tests.forward_utils import PagedModel

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_failed_launch")]  # (a Triton kernel that fell back fails the test)

PROMPT = [(7 * i) % 3900 + 30 for i in range(600)]  # past 4 blocks of 64 keys: selection runs
GREEDY = {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cpu_logits() -> torch.Tensor:
    return PagedModel(load_model(TINY)).logits(PROMPT).float()


def test_fp32_logits_cuda_equal_cpu(cpu_logits):
    torch.backends.cuda.matmul.allow_tf32 = False
    got = PagedModel(load_model(TINY, torch.float32, "cuda"), size=4096).logits(PROMPT).float().cpu()
    rel = ((got - cpu_logits).norm(dim=-1) / cpu_logits.norm(dim=-1)).max().item()
    assert rel < 1e-4, f"relative logit error {rel} between fp32 CUDA and fp32 CPU"


def test_bf16_cuda_smoke_against_fp32(cpu_logits):
    got = PagedModel(load_model(TINY, torch.bfloat16, "cuda"), size=4096).logits(PROMPT).float().cpu()
    top1 = (got.argmax(-1) == cpu_logits.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), cpu_logits.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    assert top1 > 0.9 and kl < 0.05, (top1, kl)


@pytest.mark.parametrize("compiled", [False, True])
def test_captured_decode_on_cuda_matches_eager(compiled):
    """Our own CUDA graphs (one per batch size, the key table as wide as the longest context) of the eager step, or
    of the compiled one (--enable-torch-compile), against the step eager, fp32: 80 greedy tokens from a 300-token
    prompt cross the block boundary at 320."""
    prompt = PROMPT[:300]
    eager = make_engine(device="cuda", dtype="float32", model_path=TINY, load_format="auto")
    graphs = make_engine(device="cuda", dtype="float32", model_path=TINY, load_format="auto",
                         disable_cuda_graph=False, cuda_graph_bs=[1, 4], enable_torch_compile=compiled)
    graphs.warm_up()
    assert graphs.stats().captured_batch_sizes == (1, 4)
    info = graphs._runner.graphs.info()
    assert info["graphs"] == 2 and len(info["key_buckets"]) == 1 and info["replays"] == 0
    assert info["compiled"] == compiled
    want, got = solo(eager, prompt, **GREEDY), solo(graphs, prompt, **GREEDY)
    assert got.output_ids == want.output_ids
    info = graphs._runner.graphs.info()
    assert info["replays"] >= 79 and info["eager_steps"] == 0  # (every decode step)
    assert info["guard_misses"] == info["compiles_since_warm_up"] == 0, info
    assert graphs.check_integrity()


def test_serving_builds_no_triton_kernel_after_warm_up():
    """Nothing is built once /health is 200 (tests/test_triton_build.py checks the keys on a CPU; here Triton's own
    caches): after an engine's start-up and warm-up, extends within the top-k budget and past it, mixed with decoding
    requests, greedy and sampled, build no Triton kernel."""
    from engine.kernels import triton_decode, triton_indexer, triton_pointwise
    from tests.test_triton_build import KERNELS

    kernels = [getattr(m, n) for m in (triton_decode, triton_indexer, triton_pointwise) for n in KERNELS & set(vars(m))]
    device = torch.cuda.current_device()
    engine = make_engine(device="cuda", dtype="bfloat16", model_path=TINY, load_format="auto",
                         disable_cuda_graph=False, cuda_graph_bs=[1, 4])
    engine.warm_up()
    built = [len(k.device_caches[device][0]) for k in kernels]
    for n, temperature in ((5, 0), (40, 0.8), (300, 0), (700, 0.8)):
        submit(engine, PROMPT[:n], max_new_tokens=20, temperature=temperature, ignore_eos=True)
        engine.step()  # (the next request's extend mixed with this one's decoding)
    run_all(engine)
    assert [len(k.device_caches[device][0]) for k in kernels] == built


def test_decode_step_has_no_host_sync():
    p = PagedModel(load_model(TINY, torch.bfloat16, "cuda"), size=4096)
    kvs = [p.kv.admit([]) for _ in range(3)]
    p.step(kvs, [PROMPT[:400], PROMPT[:90], PROMPT[:7]])
    batch = p.decode_batch(kvs, [5, 6, 7])
    p.decode_step(batch)  # (Triton's decode kernels built first: a step, not a first build, is what is held to it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p.decode_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_overlapped_steps_on_cuda_match_steps_read_back_one_by_one():
    """The overlap schedule (CUDA's default) against `disable_overlap_schedule`: greedy, seeded and stopped requests."""
    def run(**kw) -> list[list[int]]:
        e = make_engine(device="cuda", dtype="float32", model_path=TINY, load_format="auto", disable_cuda_graph=False,
                        cuda_graph_bs=[8], **kw)
        e.warm_up()
        reqs = [(PROMPT[:n], {"max_new_tokens": 40, "temperature": t, "sampling_seed": n, "stop_token_ids": [n % 50]})
                for n in (30, 300, 420, 599) for t in (0.0, 0.8)]
        rids = [e.add_requests([NewRequest(p, SamplingParams.from_dict(sp))])[0][0] for p, sp in reqs]
        got = run_all(e)
        assert e.check_integrity() and e.flush_cache()
        return [got[r].output_ids for r in rids]

    torch.backends.cuda.matmul.allow_tf32 = False
    assert run() == run(disable_overlap_schedule=True)


def test_steady_engine_steps_have_no_host_sync():
    """Steady decode steps through `engine.step()` (captured graphs, overlapped, greedy and sampled rows, one asking
    for output logprobs) under CUDA's sync debug mode: the sampled ids (and the logprobs) reach the host through
    pinned memory and an event, never a synchronizing copy."""
    e = make_engine(device="cuda", model_path=TINY, load_format="auto", disable_cuda_graph=False, cuda_graph_bs=[4],
                    max_total_tokens=1700)
    e.warm_up()
    for i in range(20):  # (a prefix cache the steady steps must evict from: its frees must not sync either)
        solo(e, [100 + i] * 25, max_new_tokens=1)
    for n, t in ((30, 0.0), (300, 0.8), (420, 0.0), (599, 0.8)):  # (one row asking for logprobs: they come with the ids)
        e.add_requests([NewRequest(PROMPT[:n], SamplingParams.from_dict(
            {"max_new_tokens": 60, "temperature": t, "sampling_seed": n, "ignore_eos": True}),
            LogprobOptions(True, top_logprobs_num=3, token_ids_logprob=[5, 9]) if n == 300 else LogprobOptions())])
    for _ in range(4):  # (the prefills, then steady decode)
        e.step()
    torch.cuda.synchronize()
    cached = e.stats().cached_tokens
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            assert all(len(o.new_ids) == 1 for o in e.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert e._overlap and e.stats().num_running == 4 and e.stats().cached_tokens < cached


def test_http_round_trip_on_cuda(tmp_path):
    with live_server("--model-path", TINY, "--device", "cuda", log_dir=tmp_path) as srv:
        r = httpx.post(srv.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 8,
                       "temperature": 0, "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        r = httpx.post(srv.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 8,
                       "temperature": 0.8, "sampling_seed": 3}}, timeout=120)
        assert r.status_code == 200
        pools = httpx.get(srv.url + "/pools", timeout=30).json()
        assert pools["device"].startswith("cuda") and pools["dtype"] == "bfloat16"


def test_host_tier_on_cuda_gives_the_same_tokens():
    """The hierarchical cache with the device pool on CUDA (host rows, copies each way): greedy
    multi-turn conversations past the top-k window, identical to a pool that holds everything."""
    from tests.test_hicache import SMALL, conversations

    def engine(**kw):
        return make_engine(device="cuda", dtype="float32", model_path=TINY, load_format="auto", **kw)

    torch.backends.cuda.matmul.allow_tf32 = False
    on = engine(max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_write_policy="write_back")
    assert conversations(on) == conversations(engine(max_total_tokens=16384))
    assert on.stats().hit_tokens["host"] > 0 and on.check_integrity()
