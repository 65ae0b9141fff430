"""SGLangClient's weight endpoints (mixed into :class:`~megatron_rl.rollout.client.http_client.SGLangClient`):
the update session, tensor updates (same-machine safetensors files or bytes, or SGLang's per-TP-rank payloads),
the weight group and distributed updates."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.client import weight_files, wire
from megatron_rl.rollout.client.errors import RequestRejected
from megatron_rl.weights import group as weight_group
from megatron_rl.weights.tensor_payload import request_body

log = logging.getLogger("megatron_rl.rollout.client.http_client")  # SGLangClient's log, as before the split


class WeightCalls:
    """``/begin_weight_update`` ... ``/end_weight_update``, ``/update_weights_from_tensor``, the weight group's
    endpoints; requests go through SGLangClient's ``request`` (retries, restart policy)."""

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session; a session left open by a failed sync is closed and reopened."""
        try:
            self._expect_success(self.request("POST", "/begin_weight_update", {}))
        except RequestRejected as e:
            if "already open" not in str(e):
                raise
            log.warning("%s: a weight-update session was left open (an interrupted sync?); closing it", self.url)
            self.end_weight_update()
            self._expect_success(self.request("POST", "/begin_weight_update", {}))

    def end_weight_update(self) -> None:
        self._expect_success(self.request("POST", "/end_weight_update", {}))

    @property
    def takes_checksums(self) -> bool:
        """Whether the server verifies a bucket's ``checksum`` (the embedded server; SGLang has no such field)."""
        if getattr(self, "_takes_checksums", None) is None:
            self._takes_checksums = bool(self.server_info().get("weight_checksum", False))
        return self._takes_checksums

    def update_weights_from_tensor(self, buckets: Iterable[Sequence[Tuple[str, torch.Tensor]]],
                                   checksums: Optional[Sequence[List[int]]] = None) -> None:
        """The embedded server's own formats (``wire.py``): one call per bucket, streamed (buckets may be a
        generator), inside a session the caller opened. Rejected buckets raise ``RequestRejected`` naming the
        bad tensors.

        A server on this machine (``shared_files``, see ``__init__``) is sent the path of a safetensors file
        in shared memory instead of the bytes: base64 + JSON both ways cost ~20 ms per MiB on a CPU core,
        the file ~1 ms. If the server cannot read the file, this and every later bucket go as bytes."""
        for k, bucket in enumerate(buckets):
            bucket = list(bucket)
            extra = {} if checksums is None or not self.takes_checksums else {"checksum": list(checksums[k])}
            if self.shared_files and self._send_bucket_file(bucket, extra):
                continue
            self._expect_success(self.request("POST", "/update_weights_from_tensor", dict(
                serialized_named_tensors=[wire.encode_bucket(bucket)], load_format="safetensors",
                flush_cache=False, **extra)))

    def update_weights_from_payloads(self, payloads: List[str], load_format: Optional[str] = None) -> None:
        """SGLang's own format: one ``tensor_payload`` payload per server TP rank (colocated placement)."""
        self._expect_success(self.request("POST", "/update_weights_from_tensor", request_body(payloads, load_format)))

    def _send_bucket_file(self, bucket: Sequence[Tuple[str, torch.Tensor]], extra: Optional[dict] = None) -> bool:
        """Post ``bucket`` as a shared-memory file; False (bytes from now on) if the server cannot read it."""

        # the writer's pid in the name: a file this rank leaves when killed is found and removed (weight_files.py)
        fd, path = tempfile.mkstemp(prefix=weight_files.file_prefix(), suffix=".safetensors", dir=wire.shared_dir())
        os.close(fd)
        try:
            wire.write_bucket_file(bucket, path)
            self._expect_success(self.request("POST", "/update_weights_from_tensor", dict(
                serialized_named_tensors=[path], load_format="safetensors_file", flush_cache=False, **(extra or {}))))
            return True
        except RequestRejected as e:
            if "cannot decode" not in str(e) and "not a weight file" not in str(e):
                raise  # the tensors themselves were rejected (names, shapes): the same with bytes
            log.warning("%s cannot read weight files from this machine (%s); sending weights as bytes", self.url, e)
            self.shared_files = False
            return False
        finally:
            try:
                os.remove(path)
            except OSError:
                pass

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo") -> None:
        self._expect_success(self.request("POST", "/init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend), idempotent=False))

    def update_weights_from_distributed(self, bucket: Sequence[Tuple[str, torch.Tensor]],
                                        group_name: str = "weight_update_group",
                                        load_format: Optional[str] = None, checksum: Optional[List[int]] = None) -> None:
        """Announce a bucket; the caller broadcasts it on the group concurrently (this call returns once the
        server has received and loaded it). Inside a session; the cache is flushed once per sync, not here."""
        body = dict(weight_group.bucket_metadata(bucket), group_name=group_name, flush_cache=False)
        if load_format is not None:
            body["load_format"] = load_format
        if checksum is not None and self.takes_checksums:
            body["checksum"] = list(checksum)
        self._expect_success(self.request("POST", "/update_weights_from_distributed", body, idempotent=False))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._expect_success(self.request("POST", "/destroy_weights_update_group", dict(group_name=group_name)))
