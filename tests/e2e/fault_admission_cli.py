"""`ingot` with faults injected into the engine core for requests whose prompt starts with a
marker, so that a failure while admitting or finishing one request can be provoked in a real
server. Run as ``python fault_admission_cli.py serve ...`` (tests/e2e/server_utils.run_server's
launcher); importing it patches nothing (the tests import the markers)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Prompts (token ids) that start with these fail as described.
ENGINE_FAULT = (250, 1, 250, 1)  # admission raises RuntimeError: the engine's fault, a 500
REQUEST_FAULT = (250, 2, 250, 2)  # admission raises ValueError: the request's own, a 400
FINISH_FAULT = (250, 3, 250, 3)  # freeing its blocks raises once it has finished
# What the injected engine fault says: internals that must reach the log only.
LEAKY_MESSAGE = "injected fault at /src/ingot/core/kv_cache_manager.py (grammar_matcher.cc:489)"


def _patch() -> None:
    from ingot.core.kv_cache_manager import KVCacheManager

    admit, free = KVCacheManager.admit, KVCacheManager.free
    finishing_faults: set[str] = set()

    def faulty_admit(self: KVCacheManager, request_id: str,
                     prompt_token_ids: Sequence[int] = (), salt: bytes = b"") -> int:
        head = tuple(prompt_token_ids[:4])
        if head == ENGINE_FAULT:
            raise RuntimeError(LEAKY_MESSAGE)
        if head == REQUEST_FAULT:
            raise ValueError("injected: this request's own fault")
        if head == FINISH_FAULT:
            finishing_faults.add(request_id)
        return admit(self, request_id, prompt_token_ids, salt)

    def faulty_free(self: KVCacheManager, request_id: str) -> None:
        free(self, request_id)
        if request_id in finishing_faults:
            finishing_faults.discard(request_id)
            raise RuntimeError("injected fault while finishing")

    KVCacheManager.admit = faulty_admit  # type: ignore[method-assign]
    KVCacheManager.free = faulty_free  # type: ignore[method-assign]


if __name__ == "__main__":
    _patch()
    from ingot.cli import main as cli

    sys.exit(cli.main(sys.argv[1:]))
