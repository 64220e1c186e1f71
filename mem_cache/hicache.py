"""The hierarchical KV cache's lower tiers (SGLang's HiCache): a host-memory radix tree under the device one, and an
optional disk tier of fixed-size pages. Written against the pool's capability API alone: the host rows hold every
(layer, buffer) `layers_with` names, so a layer kind this file has never seen needs nothing new here."""

import contextlib
import hashlib
import logging
import math
import os
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from mem_cache.allocator import TokenSlotAllocator
from mem_cache.pool_info import BUFFER_NAMES
from mem_cache.radix_cache import RadixCache, TreeNode

logger = logging.getLogger(__name__)
WRITE_POLICIES = ("write_through", "write_back")
PAGE = 64  # tokens per disk page
STAGING_BYTES = 64 << 20  # a copy between the tiers moves at most this much at once (a transfer's device rows)


def pool_buffers(pool: Any) -> list[tuple[int, str, torch.Tensor]]:
    """Every buffer the pool has, as (global layer id, buffer name, tensor): what a lower tier copies."""
    return [(layer, name, pool.buffer(layer, name)) for name in BUFFER_NAMES for layer in pool.layers_with(name)]


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # (an unwritable directory: the page stays, and is refused again when read)
        path.unlink(missing_ok=True)


class HostKVPool:
    """Host memory for every device buffer, token-major: host slot s is row s of `data` ([size + 1, words per token],
    row 0 unused), each buffer's bytes in turn: a copy either way is one transfer (on CUDA one sync), a disk page its
    rows as they lie. A word is the widest integer type dividing every buffer's bytes per token (NOTE: index_select /
    index_copy_ go element by element: 0.2 ms as int64 vs 3.2 as bytes). Not pinned (a transfer's host end is a gathered
    or scattered copy of rows), uninitialized (a row is read only once written): resident memory grows with use."""

    def __init__(self, pool: Any, size: int) -> None:
        self.buffers, self.bytes_per_token_by_kind = pool_buffers(pool), pool.bytes_per_token_by_kind()
        self.bytes_per_token = sum(d[0].numel() * d.element_size() for *_, d in self.buffers)  # (every buffer's row)
        width = math.gcd(8, *(n * d.element_size() for *_, d in self.buffers for n in
                              (d[0].numel(), d.stride(0), d.storage_offset())))  # (a row, a row's stride, the start)
        self.word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
        self.data = torch.empty((size + 1, self.bytes_per_token // width), dtype=self.word)
        self.allocator = TokenSlotAllocator(size, keep_sorted=False)
        # each buffer's rows (each contiguous) as words, viewed once (a buffer whose rows cannot be: fails here)
        self.rows = [d.view(len(d), -1).view(self.word) for *_, d in self.buffers]

    def save(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        for dev, host in self._pieces(device_slots, host_slots):
            self.data.index_copy_(0, host, torch.cat([r.index_select(0, dev) for r in self.rows], dim=1).cpu())

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        for dev, host in self._pieces(device_slots, host_slots):
            rows = self.data.index_select(0, host).to(dev.device, non_blocking=True)
            for r, part in zip(self.rows, rows.split([r.shape[1] for r in self.rows], dim=1)):
                r.index_copy_(0, dev, part)

    def _pieces(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Any:
        """(device slots, host slots) in pieces whose rows take at most STAGING_BYTES on the device."""
        step, host = max(1, STAGING_BYTES // self.bytes_per_token), host_slots.long()  # (index_copy_ takes int64 only)
        dev = device_slots.to(self.rows[0].device, torch.int64)
        return ((dev[i:i + step], host[i:i + step]) for i in range(0, len(dev), step))


class DiskStore:
    """One file per page of PAGE tokens, named by a hash chained over the model's fingerprint and every token up to
    the page's end (a restarted server finds its pages, another model never does): a magic, its name, a CRC-32, the
    bytes. One that fails a check is logged, removed and read as a miss (it and the pages after it recomputed)."""

    MAGIC = b"MMKV2"  # (2: token-major pages)

    def __init__(self, directory: str, fingerprint: str, host: HostKVPool) -> None:
        self.dir, self.host, self.writable = Path(directory), host, True
        self.seed, self.page_bytes = hashlib.sha256(fingerprint.encode()).digest(), PAGE * host.bytes_per_token
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._stop_writing(e)

    def _stop_writing(self, e: OSError) -> None:
        logger.warning("hicache: cannot write disk pages in %s (%s); the disk tier stops writing", self.dir, e)
        self.writable = False

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The name of each whole page of `tokens`."""
        key, out = self.seed, []
        for p in range(len(tokens) // PAGE):
            key = hashlib.sha256(key + torch.tensor(tokens[p * PAGE:(p + 1) * PAGE]).numpy().tobytes()).digest()
            out.append(key)
        return out

    def write(self, tokens: list[int], host_slots: torch.Tensor) -> int:
        """Write the whole pages of `tokens` (their KV in `host_slots`) not written yet; the bytes written."""
        done = 0
        for p, key in enumerate(self.keys(tokens) if self.writable else []):
            if (path := self.dir / key.hex()).exists():
                continue
            rows, tmp = host_slots[p * PAGE:(p + 1) * PAGE], path.with_suffix(f".{os.getpid()}.tmp")
            body = self.host.data.index_select(0, rows).numpy().tobytes()
            try:  # (a file of its own per process, renamed whole: a reader never sees half a page)
                tmp.write_bytes(self.MAGIC + key + zlib.crc32(body).to_bytes(4, "little") + body)
                os.replace(tmp, path)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                self._stop_writing(e)
                break
            done += len(body)
        return done

    def read(self, key: bytes, host_slots: torch.Tensor) -> bool | None:
        """Page `key` into `host_slots`: True; None if there is none; False if it fails a check (then removed)."""
        path = self.dir / key.hex()
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            logger.warning("hicache: cannot read disk page %s (%s); recomputing its tokens", path, e)
            return False
        head, body = raw[:len(self.MAGIC) + 36], raw[len(self.MAGIC) + 36:]
        if (head[:-4] != self.MAGIC + key or len(body) != self.page_bytes
                or zlib.crc32(body) != int.from_bytes(head[-4:], "little")):
            logger.warning("hicache: disk page %s is corrupt or truncated (%d bytes); removed, its tokens recomputed "
                           "(and written again)", path, len(raw))
            _remove(path)
            return False
        page = torch.frombuffer(bytearray(body), dtype=self.host.word).view(PAGE, -1)
        self.host.data.index_copy_(0, host_slots, page)
        return True


class HiCache:
    """`save` copies down the tokens of a prefix the host lacks; `match` finds the longest prefix the host holds, disk
    pages brought up first. Either policy saves what the device evicts; write-through also every prefix it takes in."""

    def __init__(self, pool: Any, size: int, write_policy: str = "write_through", storage_dir: str | None = None,
                 fingerprint: str = "") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
        self.host, self.write_policy = HostKVPool(pool, size), write_policy
        self.write_through = write_policy == "write_through"
        self.disk = DiskStore(storage_dir, fingerprint, self.host) if storage_dir else None
        write_back_to_disk = self.disk is not None and not self.write_through
        self.tree = RadixCache(self.host.allocator, on_evict=self._to_disk if write_back_to_disk else None)
        self.moved_bytes: Counter[str] = Counter()  # KV bytes copied, by direction

    def _alloc(self, n: int, keep: TreeNode) -> torch.Tensor | None:
        """`n` host slots, evicting least recently used host nodes (never `keep`'s path); None if they cannot be had."""
        self.tree.inc_lock_ref(keep)
        self.tree.evict(n - self.host.allocator.available_size())
        self.tree.dec_lock_ref(keep)
        return self.host.allocator.alloc(n) if self.host.allocator.can_alloc(n) else None

    def _insert(self, tokens: list[int], slots: torch.Tensor, node: TreeNode, own_from: int) -> None:
        self.tree.inc_lock_ref(node)  # (cache_finished_req releases a lock)
        self.tree.cache_finished_req(tokens, slots, node, own_from)

    def _to_disk(self, tokens: list[int], host_slots: torch.Tensor) -> None:
        if self.disk is not None:
            self.moved_bytes["host_to_disk"] += self.disk.write(tokens, host_slots)

    def save(self, tokens: list[int], device_slots: torch.Tensor) -> None:
        """Keep a host copy of the prefix `tokens` (KV in `device_slots`): its tokens the host lacks are copied."""
        have, node = self.tree.match_prefix(tokens)
        n = len(tokens) - have.numel()
        if n <= 0 or (new := self._alloc(n, node)) is None:
            return
        try:  # (a copy that fails, e.g. out of device memory for its staging rows, only leaves the prefix unkept)
            self.host.save(device_slots[have.numel():], new)
        except Exception:  # noqa: BLE001 - the device tree and the request go on whole
            logger.exception("hicache: saving %d tokens to the host tier failed; they are not kept below", n)
            self.host.allocator.free(new)
            return
        self.moved_bytes["device_to_host"] += n * self.host.bytes_per_token
        self._insert(tokens, slots := torch.cat([have, new]), node, have.numel())
        if self.write_through:
            self._to_disk(tokens, slots)

    def match(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode, int]:
        """Host slots of `tokens`' longest prefix below the device, its node (locked: `unlock` it), tokens from disk."""
        slots, node = self.tree.match_prefix(tokens)
        found = slots.numel()
        if self.disk is not None:
            start, pages, keys = found // PAGE * PAGE, [], self.disk.keys(tokens)[found // PAGE:]
            for i, key in enumerate(keys):
                if (page := self._alloc(PAGE, node)) is None:
                    break
                if not (read := self.disk.read(key, page)):
                    self.host.allocator.free(page)
                    for later in keys[i + 1:] if read is False else ():  # (recomputed, so written again)
                        _remove(self.disk.dir / later.hex())
                    break
                pages.append(page)
            if pages:
                self.moved_bytes["disk_to_host"] += len(pages) * self.disk.page_bytes
                self._insert(tokens[:start + len(pages) * PAGE], torch.cat([slots[:start], *pages]), node, start)
                slots, node = self.tree.match_prefix(tokens)
        self.tree.inc_lock_ref(node)
        return slots, node, slots.numel() - found

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> bool:
        """Copy host slots' KV into device slots; False when the copy failed (logged: the caller recomputes)."""
        try:
            self.host.load(host_slots, device_slots)
        except Exception:  # noqa: BLE001 - e.g. out of device memory for the staging rows
            logger.exception("hicache: loading %d tokens from the host tier failed; recomputing them", len(host_slots))
            return False
        self.moved_bytes["host_to_device"] += host_slots.numel() * self.host.bytes_per_token
        return True

    def unlock(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)

    def flush(self) -> None:
        """Drop the host tier, and the disk tier's pages: a flushed cache finds nothing."""
        self.tree.flush()
        if self.disk is not None:
            for page in self.disk.dir.glob("?" * 64):  # (a page's name: 32 bytes in hex)
                _remove(page)

    def info(self) -> dict[str, Any]:
        """The host tier for GET /pools: size, occupancy, bytes per token (by layer kind), policy, disk, bytes moved."""
        a = self.host.allocator
        return {"size_tokens": a.size, "used_tokens": a.used_size(), "bytes_per_token": self.host.bytes_per_token,
                "bytes_per_token_by_kind": self.host.bytes_per_token_by_kind,
                "total_bytes": self.host.data.nbytes, "write_policy": self.write_policy,
                "storage_dir": str(self.disk.dir) if self.disk else None, "moved_bytes": dict(self.moved_bytes)}

    def check_integrity(self) -> bool:
        assert self.tree.check_integrity() and self.host.allocator.check_integrity()
        assert self.tree.protected_size() == 0, f"HiCache: {self.tree.protected_size()} host tokens left locked"
        used, held = self.host.allocator.used_size(), self.tree.total_size()
        assert used == held, f"HiCache: {used} host slots in use, the host tree holds {held}"
        return True
