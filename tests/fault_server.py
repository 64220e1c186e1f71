"""`python -m tests.fault_server [server flags]`: the server with an injected per-request fault (tests only).

Every request whose rid starts with $FAULT_RID_PREFIX fails inside the engine, as a failure of its
own post-processing would, once it has $FAULT_AFTER_TOKENS tokens. `inject` does the same in-process.
"""

from __future__ import annotations

import os
import sys

from engine.runtime.engine import Engine


def inject(prefix: str, after: int, message: str = "injected test fault for rid {rid}") -> None:
    accept = Engine._accept

    def faulty(self, req, *args):
        if req.rid.startswith(prefix) and len(req.output_ids) >= after:
            raise RuntimeError(message.format(rid=req.rid))
        return accept(self, req, *args)

    Engine._accept = faulty


if __name__ == "__main__":
    inject(os.environ["FAULT_RID_PREFIX"], int(os.environ.get("FAULT_AFTER_TOKENS", "0")))
    from server.__main__ import main

    sys.exit(main())
