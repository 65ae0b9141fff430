"""The embedded server's weight endpoints, as SGLang 0.5.23 serves them: the update session, tensor and
distributed updates, the weight group (mixed into :class:`~megatron_rl.rollout.embedded.server.EmbeddedServer`)."""

from __future__ import annotations

import os
from typing import Any, Tuple

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.embedded import guards
from megatron_rl.rollout.embedded.hf_weights import WeightUpdateError
from megatron_rl.rollout.embedded.scheduler_rules import fully_idle
from megatron_rl.rollout.embedded.http_handler import HTTPError, body_field, validation_error, weights_error
from megatron_rl.weights import checksum as weight_checksum
from megatron_rl.weights import group as weight_group


class WeightEndpoints:
    """``/begin_weight_update`` ... ``/end_weight_update``, ``/update_weights_from_tensor`` and
    ``_distributed``, ``/init_weights_update_group``, ``/destroy_weights_update_group``; the server's state
    (engine, session, groups) is EmbeddedServer's."""

    def _begin_update(self, body):
        with self._update_lock:
            if self._session:
                raise weights_error("a weight-update session is already open; call end_weight_update() first")
            self._session = True
        return 200, {"success": True, "message": "Success"}

    def _end_update(self, body):
        with self._update_lock:
            if not self._session:
                raise weights_error("no weight-update session is open; call begin_weight_update() first")
            self._session = False
        return 200, {"success": True, "message": "Success"}

    def _apply(self, buckets, body) -> Tuple[int, Any]:
        """Load the buckets (waiting for the running batch unless paused), then SGLang's post-update rules."""
        version = body_field(body, "weight_version", str, None)
        try:  # nothing of a bucket holding NaN/inf is loaded (nor any request aborted): finite weights stay served
            guards.bounded_version(version, "weight_version")
            guards.require_finite(buckets)
        except ValueError as e:
            raise weights_error(f"Failed to update parameter online: {e}") from None
        if body_field(body, "abort_all_requests", bool, False):
            self.engine.abort(abort_all=True)
            self.queue.abort(None, abort_all=True)
        try:
            self.engine.update_weights(buckets, version if version is not None else self.engine.weight_version)
        except WeightUpdateError as e:
            raise weights_error(f"Failed to update parameter online: {e}") from None
        message = "Succeeded to update parameter online."
        if body_field(body, "flush_cache", bool, True) and not fully_idle(self.queue, self.engine):
            raise weights_error("Weights were updated, but the cache was not flushed because requests are still "
                                 "running or queued. Retract or finish them, then call /flush_cache.")
        if version is not None:
            message += f" Weight version updated to {version}."
        return 200, {"success": True, "message": message}

    def _update_from_tensor(self, body):
        fmt = body_field(body, "load_format", str, None)
        payloads = body_field(body, "serialized_named_tensors", list)
        if not all(isinstance(p, str) for p in payloads):
            raise validation_error("serialized_named_tensors", "Input should be a valid list of base64 strings")
        with self._update_lock:
            if not self._session:
                raise weights_error("update_weights_from_tensor must run between begin_weight_update() and "
                                     "end_weight_update()")
            self._require_weights_resident()
            try:
                if fmt == "safetensors":  # extension
                    buckets = [wire.decode_bucket(p) for p in payloads]
                elif fmt == "safetensors_file":  # extension
                    from safetensors.torch import load_file

                    buckets = [list(load_file(self._weight_file(p)).items()) for p in payloads]
                elif fmt in (None, "direct", weight_group.FLATTENED):  # SGLang's own: one payload per TP rank
                    from megatron_rl.weights.tensor_payload import decode_payloads

                    buckets = [decode_payloads(payloads, fmt, tp_size=self.tp_size)]
                else:
                    raise ValueError(f"Unknown load_format={fmt}")
            except HTTPError:
                raise
            except Exception as e:  # noqa: BLE001 - any decode failure is the client's payload
                raise weights_error(f"cannot decode serialized_named_tensors: {type(e).__name__}: {e}") from None
            self._verify_checksum(buckets, body)
            return self._apply(buckets, body)

    def _verify_checksum(self, buckets, body) -> None:
        """Refuse (nothing loaded) a bucket whose bytes are not what the sender checksummed (extension field)."""
        expected = body.get("checksum") if isinstance(body, dict) else None
        if expected is None:
            return
        if len(buckets) != 1:
            raise validation_error("checksum", f"one checksum covers one bucket; this request has {len(buckets)}")
        try:
            weight_checksum.verify(buckets[0], expected)
        except ValueError as e:
            raise weights_error(f"Failed to update parameter online: {e}") from None

    def _require_weights_resident(self) -> None:
        """SGLang would write into released (unmapped) weight memory -- a crash, not an answer; this double
        refuses instead, so a driver that updates before ``resume_memory_occupation(["weights"])`` fails."""
        if "weights" in self._released:
            raise weights_error("the weights' memory is released: call resume_memory_occupation(tags=['weights']) "
                                 "before updating them")

    def _weight_file(self, path: str) -> str:
        """A weight file the client named: only ours, in the shared-memory folder (never any other path)."""
        real, folder = os.path.realpath(path), os.path.realpath(wire.shared_dir())
        if os.path.dirname(real) != folder or not os.path.basename(real).startswith(wire.WEIGHT_FILE_PREFIX):
            raise weights_error(f"serialized_named_tensors: {path!r} is not a weight file of this machine's shared "
                                 f"folder ({folder}/{wire.WEIGHT_FILE_PREFIX}*); send the bytes (load_format="
                                 "'safetensors') instead")
        return real

    def _init_group(self, body):
        name = body_field(body, "group_name", str, "weight_update_group")
        address, port = body_field(body, "master_address", str), body_field(body, "master_port", int)
        offset, world = body_field(body, "rank_offset", int), body_field(body, "world_size", int)
        backend = body_field(body, "backend", str, "nccl")
        if not name:
            raise weights_error("Group name cannot be empty")
        if self.tp_size > 1:
            raise weights_error(f"this embedded server emulates tp_size={self.tp_size} for tensor payloads only; it "
                                 "joins a weight group as one rank: start it with --tp-size 1")
        try:  # tp_rank 0: this server is one engine rank
            guards.check_group_ranks(offset, world)
            guards.wait_for_master(address, port, self.weight_group_connect_timeout_s)
            group = weight_group.create_weight_group(address, port, offset, world, backend=backend,
                                                     group_name=name, timeout_s=300.0)
        except Exception as e:  # noqa: BLE001
            raise weights_error(f"Failed to initialize custom process group: {e}.") from None
        self._groups[name] = group
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_from_distributed(self, body):
        names, dtypes, shapes = (body_field(body, k, list) for k in ("names", "dtypes", "shapes"))
        name = body_field(body, "group_name", str, "weight_update_group")
        fmt = body_field(body, "load_format", str, None)
        with self._update_lock:
            if not self._session:
                raise weights_error("update_weights_from_distributed must run between begin_weight_update() and "
                                     "end_weight_update()")
            if name not in self._groups:
                raise weights_error(f"Failed to receive weights: Group {name} not in {list(self._groups)}. Please "
                                     "call `init_weights_update_group` first.")
            self._require_weights_resident()
            try:
                bucket = weight_group.receive_bucket(self._groups[name], names, dtypes, shapes, load_format=fmt)
            except Exception as e:  # noqa: BLE001
                raise weights_error(f"Failed to receive weights: {e}") from None
            self._verify_checksum([bucket], body)
            return self._apply([bucket], body)

    def _destroy_group(self, body):
        name = body_field(body, "group_name", str, "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            raise weights_error("The group to be destroyed does not exist.")
        weight_group.destroy_weight_group(group)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

