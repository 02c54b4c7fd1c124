"""The shared-memory collectives' set-up decisions, pure functions (the collectives themselves
run over real processes in tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from ingot.distributed import shm_comm
from ingot.distributed.shm_comm import decline_reason, shm_supported, slot_bytes_from_env


def test_every_rank_on_one_host_takes_shared_memory():
    assert decline_reason([(None, "h/boot", 10), (None, "h/boot", 11)]) is None


def test_a_rank_on_another_host_or_with_a_reason_sends_everyone_to_gloo():
    assert decline_reason([(None, "a/1", 10), (None, "b/2", 11)]) == \
        "the ranks are on several hosts"
    assert decline_reason([(None, "h/1", 10), ("backend nccl", "h/1", 11)]) == "backend nccl"


def test_the_switch_and_the_backend(monkeypatch):
    monkeypatch.setenv(shm_comm.ENABLE_ENV, "0")
    assert shm_supported("gloo") == "INGOT_CPU_SHM_ALLREDUCE=0"
    monkeypatch.setenv(shm_comm.ENABLE_ENV, "1")
    assert shm_supported("nccl") == "backend nccl"
    monkeypatch.setattr(shm_comm.platform, "machine", lambda: "aarch64")
    assert "not x86-64" in shm_supported("gloo")
    monkeypatch.setattr(shm_comm.platform, "machine", lambda: "x86_64")
    assert shm_supported("gloo") is None


def test_slot_size(monkeypatch):
    monkeypatch.delenv(shm_comm.SLOT_MB_ENV, raising=False)
    assert slot_bytes_from_env() == 8 * 2**20
    monkeypatch.setenv(shm_comm.SLOT_MB_ENV, "0.5")
    assert slot_bytes_from_env() == 2**19
    for bad in ("x", "0", "-1"):
        monkeypatch.setenv(shm_comm.SLOT_MB_ENV, bad)
        with pytest.raises(ValueError, match="INGOT_CPU_SHM_SLOT_MB"):
            slot_bytes_from_env()
