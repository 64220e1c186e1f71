"""The hierarchical KV cache: host and disk tiers under the radix tree. Greedy multi-turn conversations whose prompts
are longer than the sparse top-k window (init + local + 4 top-k blocks of 64 = 384 tokens) must give the same tokens
with the tier off, on (either write policy), and with a device pool that holds everything; integrity is checked
after every step. A stale or missing buffer of any kind changes the tokens (checked by leaving one uncopied)."""

from __future__ import annotations

import logging
import math
import random
import re
from pathlib import Path

import pytest
import torch

from mem_cache import BUFFER_NAMES, HiCache, MiniMaxSparseKVPool, hicache
from mem_cache.hicache import PAGE
from tests.engine_utils import forced_retraction, make_engine, run_all, submit
from tests.http_utils import generate
from tests.server_utils import live_server

SMALL = 2600  # device slots: a third of what the conversations hold; one conversation fits
WINDOW = (1 + 1 + 4) * 64


def conversations(engine, clients: int = 4, rounds: int = 3, new: int = 450, out: int = 12) -> list[list[int]]:
    """Each client's turns: its whole history plus `new` random tokens, `out` greedy tokens back; all clients of a
    round at once. Returns every turn's output."""
    rng = random.Random(0)
    history = {c: [rng.randrange(5, 4000) for _ in range(new)] for c in range(clients)}
    assert new > WINDOW
    outputs = []
    for _ in range(rounds):
        rids = {c: submit(engine, history[c], max_new_tokens=out, temperature=0)[0] for c in range(clients)}
        done = run_all(engine)  # (check_integrity after every step)
        for c, rid in rids.items():
            outputs.append(done[rid].output_ids)
            history[c] += done[rid].output_ids + [rng.randrange(5, 4000) for _ in range(new)]
    return outputs


def tier(engine) -> HiCache:
    return engine._kv.hicache


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return conversations(make_engine(max_total_tokens=16384))  # holds every conversation: nothing evicted


def test_tier_off_recomputes_what_a_large_pool_keeps(reference) -> None:
    engine = make_engine(max_total_tokens=SMALL)
    assert conversations(engine) == reference
    assert engine.stats().host_tier is None and engine.stats().hit_tokens["host"] == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tier_on_gives_the_same_tokens_and_finds_what_the_device_evicted(reference, policy: str) -> None:
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_write_policy=policy)
    assert conversations(engine) == reference
    hits, host = engine.stats().hit_tokens, engine.stats().host_tier
    large = make_engine(max_total_tokens=16384)
    conversations(large)
    assert hits["host"] > 0 and hits["device"] + hits["host"] == large.stats().hit_tokens["device"]
    assert host["moved_bytes"]["host_to_device"] >= hits["host"] * host["bytes_per_token"] > 0
    assert host["size_tokens"] == 2 * SMALL and 0 < host["used_tokens"] <= host["size_tokens"]


@pytest.mark.parametrize("left_out", BUFFER_NAMES)
def test_a_buffer_kind_left_uncopied_changes_the_tokens(reference, left_out: str, monkeypatch) -> None:
    every = hicache.pool_buffers
    monkeypatch.setattr(hicache, "pool_buffers", lambda pool: [b for b in every(pool) if b[1] != left_out])
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True)
    assert tier(engine).host.buffers and all(name != left_out for _, name, _ in tier(engine).host.buffers)
    assert conversations(engine) != reference


def test_a_full_host_tier_evicts_and_stays_correct(reference) -> None:
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_ratio=0.4)
    assert conversations(engine) == reference
    host = engine.stats().host_tier
    assert host["size_tokens"] == int(0.4 * SMALL) and host["used_tokens"] <= host["size_tokens"]


def test_flush_cache_drops_both_tiers(reference) -> None:
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True)
    conversations(engine, rounds=1)
    assert engine.stats().host_tier["used_tokens"] > 0 and engine.flush_cache()
    assert engine.stats().host_tier["used_tokens"] == 0 == engine.stats().cached_tokens and engine.check_integrity()
    assert conversations(engine) == reference


def test_aborts_after_a_load_leave_both_tiers_whole() -> None:
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 4000) for _ in range(900)] for _ in range(4)]  # 4 x 900: more than the device holds
    for p in prompts:
        submit(engine, p, max_new_tokens=2, temperature=0)
    run_all(engine)
    loaded = engine.stats().hit_tokens["host"]
    rids = [submit(engine, [*p, 11, 12], max_new_tokens=30, temperature=0)[0] for p in prompts]  # returning turns
    for _ in range(3):
        engine.step()
        assert engine.check_integrity()
    engine.abort(rids[0])
    engine.abort(rids[2])
    for _ in range(5):
        engine.step()
        assert engine.check_integrity()
    engine.abort(abort_all=True)
    run_all(engine)
    assert engine.stats().hit_tokens["host"] > loaded and engine.check_integrity()


@pytest.mark.parametrize("on", [True, False])
def test_a_retracted_request_recomputes_nothing(on: bool) -> None:
    """A pool too small for every request decoding at once retracts; the retracted request's KV goes through the
    tree to the host tier and comes back, so its readmission prefills only the token it was about to decode
    (without the tier: evicted, recomputed)."""
    engine = make_engine(max_total_tokens=1500, enable_hierarchical_cache=on, max_running_requests=8)
    recomputed = forced_retraction(engine)
    assert recomputed and (list(recomputed.values()) == [0] * len(recomputed)) == on
    assert (engine.stats().hit_tokens["host"] > 0) == on


@pytest.mark.parametrize("kinds", [["sparse_k_only"] * 3, ["dense", "sparse_k_only"], ["sparse_index_kv"] * 2,
                                   ["dense"] * 2, ["sparse_k_only", "sparse_index_kv", "dense"]])
@pytest.mark.parametrize(("dtype", "pieces", "dims"), [(torch.float32, False, (8, 4)), (torch.float32, True, (8, 4)),
                                                      (torch.bfloat16, True, (8, 4)), (torch.bfloat16, False, (3, 3))])
def test_a_layer_mix_the_tier_was_not_written_for_round_trips(kinds: list[str], dtype, pieces: bool, dims,
                                                               monkeypatch) -> None:
    """(pieces: every copy moves 3 tokens at a time. dims (3, 3) in bfloat16: a token's K is 12 bytes and its index K
    6, so the host rows move as 4- or 2-byte words.)"""
    pool = MiniMaxSparseKVPool(64, dtype, kinds, 2, *dims)
    if pieces:
        monkeypatch.setattr(hicache, "STAGING_BYTES", 3 * pool.bytes_per_token())
    names = [(layer, b) for b in BUFFER_NAMES for layer in pool.layers_with(b)]
    for layer, b in names:
        pool.buffer(layer, b).normal_()
    hc = HiCache(pool, 32)
    assert pool.bytes_per_token() == hc.host.bytes_per_token
    word = math.gcd(8, *(pool.buffer(*n)[0].nbytes for n in names))
    assert hc.host.data.element_size() == word and (word < 8) == (dims == (3, 3))
    tokens, first = list(range(100, 120)), torch.arange(1, 21)
    before = {n: pool.buffer(*n)[first].clone() for n in names}
    hc.save(tokens, first)
    for n in names:
        pool.buffer(*n).zero_()
    host, node, from_disk = hc.match([*tokens, 7])
    assert host.numel() == len(tokens) and from_disk == 0
    second = torch.arange(30, 50)
    hc.load(host, second)
    hc.unlock(node)
    assert all(torch.equal(pool.buffer(*n)[second], before[n]) for n in names)
    assert hc.check_integrity()


def test_buffers_that_are_views_of_one_allocation_round_trip() -> None:
    """A pool whose K and V are slices of one fused tensor (rows of 12 bytes, 24 apart) and whose index K starts 2
    bytes into its allocation (rows of 8): the host rows move as 2-byte words, not the 4 the row sizes allow, and
    int32 slots (a table row's) are taken."""
    fused = torch.randn(33, 2, 2, 3, dtype=torch.bfloat16)  # [slots, K | V, heads, dim]
    flat = torch.randn(1 + 33 * 4, dtype=torch.float16)[1:].view(33, 4)

    class FusedPool:
        buffers = {(0, "key"): fused[:, 0], (0, "value"): fused[:, 1], (1, "index_key"): flat}

        def layers_with(self, name: str) -> list[int]:
            return sorted(layer for layer, n in self.buffers if n == name)

        def buffer(self, layer: int, name: str) -> torch.Tensor:
            return self.buffers[(layer, name)]

        def bytes_per_token_by_kind(self) -> dict:
            return {}

    host = hicache.HostKVPool(FusedPool(), 16)
    assert host.data.element_size() == 2 and host.bytes_per_token == 12 + 12 + 8
    before = {k: v.clone() for k, v in FusedPool.buffers.items()}
    first, second = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([7, 8, 9])
    host.save(first, torch.tensor([4, 5, 6], dtype=torch.int32))
    fused.zero_()
    flat.zero_()
    host.load(torch.tensor([4, 5, 6]), second)
    assert all(torch.equal(FusedPool.buffers[k][second], before[k][first.long()]) for k in before)


def test_mem_cache_asks_the_pool_what_it_has_instead_of_checking_classes() -> None:
    for path in (Path(__file__).parents[1] / "mem_cache").glob("*.py"):
        source = path.read_text()
        assert not re.search(r"isinstance\([^)]*Pool", source), path
        assert "except NotImplementedError" not in source, path


def pages(directory: Path) -> list[Path]:
    return sorted(directory.glob("?" * 64))


@pytest.mark.parametrize("policy, ratio", [("write_through", 2.0), ("write_back", 0.4)])
def test_the_disk_tier_survives_a_restart_and_no_other_model_reads_it(reference, tmp_path: Path, policy: str,
                                                                      ratio: float) -> None:
    """Write-through writes a page with its host copy; write-back when the host evicts it (a small host tier)."""
    disk = dict(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                hicache_write_policy=policy, hicache_ratio=ratio)
    assert conversations(make_engine(max_total_tokens=SMALL, **disk)) == reference
    assert pages(tmp_path) and all(p.stat().st_size == len(hicache.DiskStore.MAGIC) + 36 + PAGE * 5248 for p in pages(tmp_path))
    restarted = make_engine(max_total_tokens=SMALL, **disk)
    assert conversations(restarted) == reference
    assert restarted.stats().hit_tokens["disk"] > 0
    other = make_engine(max_total_tokens=SMALL, random_seed=1, **disk)  # other weights: another fingerprint
    conversations(other, rounds=1)
    assert other.stats().hit_tokens["disk"] == 0


def test_corrupt_truncated_and_unwritable_disk_pages_are_recomputed(reference, tmp_path: Path, caplog) -> None:
    disk = dict(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    conversations(make_engine(max_total_tokens=SMALL, **disk))
    for i, page in enumerate(pages(tmp_path)):
        raw = bytearray(page.read_bytes())
        if i % 3 == 0:
            raw[len(raw) // 2] ^= 0xFF
        page.write_bytes(raw[:len(raw) // 2] if i % 3 == 1 else raw)
    with caplog.at_level(logging.WARNING, logger="mem_cache.hicache"):
        engine = make_engine(max_total_tokens=SMALL, **disk)
        assert conversations(engine) == reference
    bad = caplog.text.count("corrupt or truncated")
    assert bad and engine.check_integrity()
    caplog.clear()  # a bad page and the ones after it were removed, recomputed and written again
    with caplog.at_level(logging.WARNING, logger="mem_cache.hicache"):
        restarted = make_engine(max_total_tokens=SMALL, **disk)
        assert conversations(restarted) == reference
    assert "corrupt" not in caplog.text and restarted.stats().hit_tokens["disk"] > 0
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="mem_cache.hicache"):
        unwritable = make_engine(max_total_tokens=SMALL, **{**disk, "hicache_storage_dir": str(blocked / "pages")})
        assert conversations(unwritable) == reference
    assert "cannot write disk pages" in caplog.text


def test_flush_drops_the_disk_pages_too(tmp_path: Path) -> None:
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_storage_backend="file",
                         hicache_storage_dir=str(tmp_path))
    prompt = list(range(5, 600))
    submit(engine, prompt, max_new_tokens=2)
    run_all(engine)
    assert pages(tmp_path) and engine.flush_cache() and not pages(tmp_path)
    (rid,) = submit(engine, prompt, max_new_tokens=2)
    assert run_all(engine)[rid].cached_tokens == 0


def test_a_failed_step_caches_nothing_on_any_tier() -> None:
    """The slots of a step that raised were allocated but maybe never written: none reaches the tree or the host."""
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True)
    submit(engine, list(range(5, 600)), max_new_tokens=2)

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    engine._runner.forward = broken
    with pytest.raises(RuntimeError):
        engine.step()
    engine.fail_all("a kernel failed")
    assert engine.stats().cached_tokens == 0 == engine.stats().host_tier["used_tokens"] and engine.check_integrity()


@pytest.mark.parametrize(("policy", "failing"), [("write_through", "save"), ("write_back", "save"),
                                                ("write_through", "load")])
def test_a_failed_copy_between_the_tiers_keeps_serving_the_same_tokens(reference, policy: str, failing: str,
                                                                        monkeypatch, caplog) -> None:
    """A copy that raises (on a GPU: out of memory for its staging rows): a save at release or at eviction, or a
    load at admission. Logged, the tokens the same (recomputed), integrity after every step, no host hit."""
    engine = make_engine(max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_write_policy=policy)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(tier(engine).host, failing, out_of_memory)
    with caplog.at_level(logging.ERROR, logger="mem_cache.hicache"):
        assert conversations(engine) == reference
    assert failing.rstrip("e") + "ing" in caplog.text and engine.check_integrity() and engine.stats().hit_tokens["host"] == 0
    assert (tier(engine).host.allocator.used_size() == 0) == (failing == "save")


def test_the_host_tier_is_capped_at_half_the_memory_available(monkeypatch, caplog) -> None:
    from engine.runtime import setup

    monkeypatch.setattr(setup, "_available_bytes", lambda: 20 * 5248 * 1000)  # room for 10,000 tokens at half
    with caplog.at_level(logging.WARNING, logger="engine.runtime.setup"):
        engine = make_engine(max_total_tokens=SMALL * 4, enable_hierarchical_cache=True)  # the ratio asks 20,800
    assert engine.stats().host_tier["size_tokens"] == 10_000 - 1 and "capped at 9999 tokens" in caplog.text
    with pytest.raises(ValueError, match="more than half"):
        make_engine(enable_hierarchical_cache=True, hicache_size=0.1)  # 100 MB > 52 MB


def test_bad_tier_settings_are_refused() -> None:
    for bad, match in ((dict(hicache_write_policy="write_around"), "hicache_write_policy"),
                       (dict(hicache_storage_backend="s3"), "hicache_storage_backend"),
                       (dict(hicache_ratio=0), "hicache_ratio"),
                       (dict(disable_radix_cache=True), "disable_radix_cache")):
        with pytest.raises(ValueError, match=match):
            make_engine(enable_hierarchical_cache=True, **bad)
    with pytest.raises(ValueError, match="holds no token"):
        make_engine(enable_hierarchical_cache=True, hicache_size=1e-9)


def test_the_server_reports_the_host_tier_and_counts_its_hits() -> None:
    with live_server("--max-total-tokens", "1200", "--enable-hierarchical-cache", "--enable-metrics",
                     "--hicache-write-policy", "write_back") as s, s.client() as c:
        rng = random.Random(3)
        first = [[rng.randrange(5, 4000) for _ in range(500)] for _ in range(3)]
        for ids in first:  # three conversations: together more than the device pool holds
            generate(c, input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
        back = generate(c, input_ids=first[0] + [9, 10], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert back["meta_info"]["cached_tokens"] == 500  # found on the host: counted like a device hit
        pools = c.get("/pools").json()
        host = pools["host_tier"]
        assert host["size_tokens"] == 2400 and host["write_policy"] == "write_back"
        assert host["bytes_per_token"] == pools["bytes_per_token"]  # every buffer of every layer counted
        # model.md §5 for configs/tiny, float32: main K+V 2 x 2 heads x 32; index K (and V) 1 x 32 each
        assert host["bytes_per_token_by_kind"] == {"dense": 512, "sparse_index_kv": 768, "sparse_k_only": 640}
        metrics = c.get("/metrics").text
        found = {m[0]: float(m[1]) for m in re.findall(r'sglang:cache_hit_tokens_total\{.*tier="(\w+)"\} (\S+)',
                                                       metrics)}
        assert found["host"] >= 500 and 'sglang:hicache_moved_bytes_total' in metrics
