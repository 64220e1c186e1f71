"""The engine's request ids (under the engine's lock): which are live (submitted, not finished) and which samples each
n > 1 request expanded into (`group`), so that a duplicate id is refused and an abort reaches all of its samples."""


class RidTable:
    def __init__(self) -> None:
        self.live: set[str] = set()  # rids submitted and not finished
        self.group: dict[str, list[str]] = {}  # rid of an n > 1 request -> every rid it expanded into
        self.member: dict[str, str] = {}  # expanded rid -> its group's rid

    def add(self, rids: list[str], ns: list[int]) -> list[list[str]]:
        """Take a call's rids (each with its n), all or none: each one's samples' rids; ValueError on a duplicate."""
        if (taken := [r for r in rids if r in self.live or r in self.member]) or len(set(rids)) < len(rids):
            raise ValueError(f"Duplicate request ID: {taken[0] if taken else rids}.")
        out = [[rid] if n == 1 else [f"{rid}_{i}" for i in range(n)] for rid, n in zip(rids, ns)]
        for rid, n, samples in zip(rids, ns, out):
            self.live.update(samples)
            if n > 1:
                self.group[rid] = samples + [f"{rid}__prefill"]
                self.member.update({s: rid for s in self.group[rid]})
        return out

    def finished(self, rids: list[str]) -> None:
        """Forget finished rids (an n > 1 request with its last sample)."""
        for rid in rids:
            self.live.discard(rid)
            if (group := self.member.get(rid)) is not None and not any(r in self.live for r in self.group[group]):
                for r in self.group.pop(group):
                    self.member.pop(r, None)
