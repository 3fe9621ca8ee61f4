"""gRPC page service: the producer serves staged pages as a stream of msgpack/raw frames; the
consumer pulls them and verifies size limits and the checksum. Works across nodes.

Wire format of ``/raypd.kvtransfer.PageService/Fetch`` (unary request, streamed response, bytes
in and out through generic handlers, no protoc):
    request  msgpack {"transfer_id": str}
    frame 0  msgpack header {"v", "transfer_id", "request_id", "block_hashes", "layer_range",
             "dtype", "shape", "nbytes", "checksum", "checksum_algo", "chunk_bytes"}
    frame 1+ raw page bytes, ``chunk_bytes`` each (the last one may be shorter)
The server starts lazily on the first stage, in background threads of the producer process.
A failed transfer only ends its own stream; the server keeps serving the others.
"""

from __future__ import annotations

import hmac
from concurrent import futures
from dataclasses import replace

import grpc
import msgpack
import numpy as np
import torch

from kvtransfer.base import (
    KVTransport,
    TransferError,
    TransferHandle,
    as_bytes,
    crc32,
    torch_dtype,
)

SERVICE = "raypd.kvtransfer.PageService"
FETCH_METHOD = f"/{SERVICE}/Fetch"
WIRE_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_FRAME_BYTES = 16 << 20
MAX_HEADER_BYTES = 1 << 20
SECRET_HEADER = "x-raypd-kv-secret"


def _default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover
        pass
    return "127.0.0.1"


class GrpcTransport(KVTransport):
    """``checksum`` defaults to on here (pages cross a wire). ``chunk_bytes`` is the producer's
    frame size (at most ``max_frame_bytes``); ``max_frame_bytes`` and ``max_total_bytes`` bound
    what either side sends or accepts."""

    name = "grpc"

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_threads: int = 4,
        checksum: bool = True,
        secret: str | None = None,
        **cfg,
    ):
        super().__init__(checksum=checksum, **cfg)
        self.secret = secret   # per cluster: a Fetch without it is refused (PERMISSION_DENIED)
        self.host = host
        self.port = int(port)
        self.chunk_bytes = min(int(chunk_bytes), int(max_frame_bytes))
        self.max_frame_bytes = int(max_frame_bytes)
        self.server_threads = int(server_threads)
        self._server: grpc.Server | None = None
        self._address = ""
        self._channels: dict[str, grpc.Channel] = {}

    # -- producer ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The "host:port" of this producer's page server (starts it if needed)."""
        self._ensure_server()
        return self._address

    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        checksum, algo = self._checksum_of(as_bytes(pages))
        handle = replace(handle, checksum=checksum, checksum_algo=algo, address=self.address)
        self._keep(handle.transfer_id, (handle, pages))
        return handle

    def take(self, transfer_id: str) -> torch.Tensor:
        return self._kept(transfer_id)[1]

    def close(self) -> None:
        super().close()
        with self._lock:
            server, self._server = self._server, None
            channels, self._channels = self._channels, {}
        if server is not None:
            server.stop(grace=None)
        for channel in channels.values():
            channel.close()

    def _ensure_server(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            host = self.host or _default_host()
            server = grpc.server(
                futures.ThreadPoolExecutor(
                    max_workers=self.server_threads, thread_name_prefix="kv-pages"
                ),
                options=[("grpc.max_send_message_length", self.max_frame_bytes)],
            )
            handler = grpc.method_handlers_generic_handler(
                SERVICE, {"Fetch": grpc.unary_stream_rpc_method_handler(self._serve)}
            )
            server.add_generic_rpc_handlers((handler,))
            port = server.add_insecure_port(f"{host}:{self.port}")
            if port == 0:
                raise TransferError(f"cannot bind the KV page server to {host}:{self.port}")
            server.start()
            self._server, self._address = server, f"{host}:{port}"

    def _serve(self, request: bytes, context: grpc.ServicerContext):
        if self.secret is not None:
            sent = dict(context.invocation_metadata() or ()).get(SECRET_HEADER, "")
            if not hmac.compare_digest(sent.encode(), self.secret.encode()):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "KV page server: wrong or "
                              "missing cluster secret")
        try:
            transfer_id = str(msgpack.unpackb(request)["transfer_id"])
        except Exception:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed Fetch request")
        try:
            handle, pages = self._kept(transfer_id)   # held: a concurrent release cannot free it
        except TransferError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        yield msgpack.packb(
            {
                "v": WIRE_VERSION,
                "transfer_id": handle.transfer_id,
                "request_id": handle.request_id,
                "block_hashes": list(handle.block_hashes),
                "layer_range": [0, handle.shape[0]],
                "dtype": handle.dtype,
                "shape": list(handle.shape),
                "nbytes": handle.nbytes,
                "checksum": handle.checksum,
                "checksum_algo": handle.checksum_algo,
                "chunk_bytes": self.chunk_bytes,
            }
        )
        data = memoryview(as_bytes(pages))
        for offset in range(0, handle.nbytes, self.chunk_bytes):
            yield bytes(data[offset : offset + self.chunk_bytes])

    # -- consumer ---------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(
                    address,
                    options=[("grpc.max_receive_message_length", self.max_frame_bytes)],
                )
                self._channels[address] = channel
            return channel

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        self._check_handle(handle)
        fetch = self._channel(handle.address).unary_stream(FETCH_METHOD)
        md = ((SECRET_HEADER, self.secret),) if self.secret is not None else None
        call = fetch(msgpack.packb({"transfer_id": handle.transfer_id}), timeout=self.timeout_s,
                     metadata=md)
        try:
            return self._receive(handle, call)
        except grpc.RpcError as exc:
            raise self._rpc_error(handle, exc) from exc
        finally:
            call.cancel()  # no-op when the stream completed; frees the server on errors

    def _receive(self, handle: TransferHandle, frames) -> torch.Tensor:
        frames = iter(frames)
        first = next(frames, None)
        if first is None:
            raise TransferError(f"transfer {handle.transfer_id}: stream ended before the header")
        if len(first) > MAX_HEADER_BYTES:
            raise TransferError(
                f"transfer {handle.transfer_id}: header frame of {len(first)} bytes"
            )
        header = msgpack.unpackb(first)
        self._check_header(handle, header)
        nbytes, out = header["nbytes"], torch.empty(header["nbytes"], dtype=torch.uint8)
        dest, offset, crc = out.numpy(), 0, 0
        for frame in frames:
            if len(frame) > self.max_frame_bytes:
                raise TransferError(
                    f"transfer {handle.transfer_id}: frame of {len(frame)} bytes exceeds "
                    f"max_frame_bytes={self.max_frame_bytes}"
                )
            end = offset + len(frame)
            if end > nbytes:
                raise TransferError(
                    f"transfer {handle.transfer_id}: producer sent more than the {nbytes} bytes "
                    "announced in the header"
                )
            dest[offset:end] = np.frombuffer(frame, dtype=np.uint8)
            if header["checksum"] is not None:
                crc = crc32(frame, crc)
            offset = end
        if offset != nbytes:
            raise TransferError(
                f"transfer {handle.transfer_id}: stream ended after {offset} of {nbytes} bytes"
            )
        self._verify(handle, None, crc=crc)
        return out.view(torch_dtype(handle.dtype)).reshape(handle.shape)

    def _check_header(self, handle: TransferHandle, header: dict) -> None:
        expected = {
            "transfer_id": handle.transfer_id,
            "dtype": handle.dtype,
            "shape": list(handle.shape),
            "nbytes": handle.nbytes,
            "checksum": handle.checksum,
        }
        for key, value in expected.items():
            if header.get(key) != value:
                raise TransferError(
                    f"transfer {handle.transfer_id}: header {key}={header.get(key)!r} does not "
                    f"match the handle's {value!r}"
                )
        if header.get("v") != WIRE_VERSION:
            raise TransferError(f"unsupported page wire version {header.get('v')!r}")

    def _rpc_error(self, handle: TransferHandle, exc: grpc.RpcError) -> TransferError:
        code, details = exc.code(), exc.details()
        where = f"transfer {handle.transfer_id} (request {handle.request_id}) from {handle.address}"
        if code == grpc.StatusCode.NOT_FOUND:
            return TransferError(f"{where}: not found: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TransferError(f"{where}: timed out after {self.timeout_s}s")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return TransferError(
                f"{where}: oversized frame, larger than max_frame_bytes={self.max_frame_bytes}: "
                f"{details}"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return TransferError(f"{where}: producer unreachable: {details}")
        return TransferError(f"{where}: gRPC {code.name}: {details}")
