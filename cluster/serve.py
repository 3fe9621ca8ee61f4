"""`raypd serve`: start (or join) Ray, launch the prefill/decode workers from a YAML config and
serve them over OpenAI-compatible HTTP (and gRPC when `server.grpc_port` is set).

    raypd serve --config configs/local.yaml --model tiny --port 8000

`start_server(cfg)` does the same in-process, for tests and `raypd run`: it returns a handle
with `.url` and `.stop()`. uvicorn (and the gRPC server) run on the router's event loop
(router/event_loop.py), so a request's tokens reach its stream with no thread in between.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import uvicorn

from cluster.config import RaypdConfig, RaySection
from ingress.auth import KeyRing
from ingress.core import IngressCore, IngressSettings
from ingress.http_app import build_app
from ingress.http_server import uvicorn_config
from ingress.request_checks import ModelLimits
from router.event_loop import RouterLoop

API_KEY_ENV = "RAYPD_API_KEY"


# The local Ray raypd starts keeps no idle worker processes. Ray prestarts one per CPU and keeps
# them for tasks that raypd never sends (its workers are actors, each in a process of its own):
# idle, each still used ~0.4% of a core (measured on a 2-core machine, 20 s of an idle
# `raypd serve`), and on a machine whose cores the engine keeps busy every such slice stalls
# both engine threads. An actor that Ray restarts waits for a new worker process instead.
LOCAL_RAY_SYSTEM_CONFIG = {"num_workers_soft_limit": 0}


def connect_ray(rc: RaySection) -> bool:
    """Start a local Ray (address null) or join one; True when this call started it."""
    if ray.is_initialized():
        return False
    if rc.address is None:
        local = dict(num_cpus=rc.num_cpus, include_dashboard=rc.include_dashboard,
                     log_to_driver=False)
        try:
            ray.init(**local, _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG))
        except ValueError as e:   # RAY_ADDRESS (or `ray start` on this machine) named a
            if "existing cluster" not in str(e):   # running Ray: joined as before, whose
                raise                              # system config is its own
            ray.init(**local)
    else:
        ray.init(address=rc.address, log_to_driver=False)
    return True


@dataclass
class ServerHandle:
    """A running in-process server: `.url`, `.stop()`; `.backend` is the PDCluster."""

    url: str
    host: str
    port: int
    app: Any
    backend: Any
    server: uvicorn.Server
    running: Any                  # the server's run: a Future on the router loop, or a thread
    grpc: Any = None
    _owns_backend: bool = True
    _started_ray: bool = False
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        wait_served(self.running, 15)
        if self.grpc is not None:
            self.grpc.stop()
        self.app.state.ingress.close()
        if self._owns_backend:
            self.backend.shutdown()
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server(cfg: RaypdConfig, host: str | None = None, port: int | None = None, *,
                 api_key: str | None = None, backend: Any = None,
                 max_inflight: int | None = None, log_level: str = "warning") -> ServerHandle:
    """Launch the workers (unless `backend` is given: then serve it and leave it running on
    stop) and serve them on host:port (defaults from cfg.server; port 0 = any free port) in a
    background thread. Returns once the server accepts connections."""
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    started_ray = False
    owns = backend is None
    if owns:
        check_kv_quality_gate(cfg)
        started_ray = connect_ray(cfg.ray)
        try:
            from cluster.pd import PDCluster
            backend = PDCluster(cfg.to_pd_config())
        except BaseException:
            if started_ray:
                ray.shutdown()
            raise
    try:
        settings = ingress_settings(cfg, backend, api_key, max_inflight)
        core = IngressCore(backend, settings)
        app = build_app(backend, settings, core=core)
        server = uvicorn.Server(uvicorn_config(app, host, port, settings.limits, log_level))
        running = serve_on(server, backend)
        deadline = time.monotonic() + 30
        while not server.started:
            if served_out(running) or time.monotonic() > deadline:
                server.should_exit = True
                raise OSError(f"the HTTP server did not start on {host}:{port}")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        grpc = _start_grpc(cfg, backend, host, core)
    except BaseException:
        if owns:
            backend.shutdown()
        if started_ray:
            ray.shutdown()
        raise
    shown = f"[{host}]" if ":" in host else host
    return ServerHandle(f"http://{shown}:{bound}", host, bound, app, backend, server, running,
                        grpc, owns, started_ray)


def check_kv_quality_gate(cfg: RaypdConfig) -> dict | None:
    """The recorded kv-quality gate of a quantized model.kv_dtype for this model revision and
    the weights dtype the workers load (None: a float pool, not gated). Raises ValueError (a
    clear CLI error) when it was never measured, naming the `raypd bench kv-quality` command
    that measures it, or when its figures fail the config's model.kv_gate_* thresholds: a
    quantized pool is never served unmeasured."""
    import torch

    from workers.kv_gate import check_kv_gate, gate_thresholds, resolve_weights_dtype
    from workers.kv_quant import is_quantized
    m = cfg.model
    if not is_quantized(m.kv_dtype):
        return None
    on_gpu = cfg.engine.device == "cuda" or (cfg.engine.device == "auto"
                                             and cfg.workers.num_gpus > 0)
    weights = resolve_weights_dtype(m.name, m.dtype, torch.device("cuda" if on_gpu else "cpu"))
    return check_kv_gate(m.name, m.kv_dtype, weights, gate_thresholds(m))


def model_limits(cfg: RaypdConfig, backend: Any) -> ModelLimits:
    """The vocabulary and context length, from the config or the workers' info."""
    infos = [i for i in getattr(backend, "info", None) or [] if isinstance(i, dict)]
    lens = [i["max_model_len"] for i in infos if i.get("max_model_len")]
    vocabs = [i["vocab_size"] for i in infos if i.get("vocab_size")]
    max_len = cfg.model.max_model_len or (min(lens) if lens else None)
    return ModelLimits(vocab_size=min(vocabs) if vocabs else None, max_model_len=max_len)


def ingress_settings(cfg: RaypdConfig, backend: Any, api_key: str | None = None,
                     max_inflight: int | None = None) -> IngressSettings:
    """The ingress's settings: keys (file, else `api_key`, else server.api_key, else
    $RAYPD_API_KEY; an empty string: none), limits, the model's vocabulary and context."""
    s = cfg.server
    if s.api_keys_file:
        keys = KeyRing.load(s.api_keys_file)
    else:
        key = api_key if api_key is not None else (s.api_key or os.environ.get(API_KEY_ENV))
        keys = KeyRing.single(key) if key else None
    return IngressSettings(model_name=cfg.served_model_name,
                           max_inflight=max_inflight or cfg.router.max_inflight,
                           limits=s.limits, request_limits=s.request_limits,
                           model=model_limits(cfg, backend), keys=keys,
                           protect_metrics=s.protect_metrics,
                           lora_names=tuple(cfg.model.lora_adapters))


def _start_grpc(cfg: RaypdConfig, backend: Any, host: str, core: IngressCore) -> Any:
    if cfg.server.grpc_port is None:
        return None
    from ingress.grpc_server import start_grpc_server
    return start_grpc_server(backend, host, cfg.server.grpc_port, core=core)

def serve_forever(cfg: RaypdConfig, log_level: str = "info") -> int:
    """`raypd serve`: launch the workers and serve them until SIGINT / SIGTERM (or the joined
    Ray cluster goes away); every worker is released on the way out."""
    # SIGTERM unwinds like Ctrl-C: the main thread (waiting on the server's run on the router
    # loop) stops the server gracefully, then the `finally` below releases everything.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    started_ray = backend = grpc = app = server = running = None
    gate = check_kv_quality_gate(cfg)
    if gate is not None:
        floor = gate["noise_floor"]
        print(f"raypd: kv_dtype {cfg.model.kv_dtype} passed its quality gate "
              f"({gate['evidence']}, {gate['dtype']} weights): teacher-forced agreement "
              f"{gate['teacher_forced_agreement']:.4f} (bf16 floor "
              f"{floor['teacher_forced_agreement']:.4f}), mean_kl {gate['mean_kl']:.2e} (floor "
              f"{floor['mean_kl']:.2e}), ppl_delta_pct {gate['ppl_delta_pct']:.3f}",
              file=sys.stderr, flush=True)
    gone = threading.Event()
    try:
        started_ray = connect_ray(cfg.ray)
        if cfg.ray.address is not None:      # joined a cluster: do not outlive it
            gone = watch_cluster(ray.get_runtime_context().gcs_address)
        from cluster.pd import PDCluster
        w = cfg.workers
        print(f"raypd: launching {w.prefill.count} prefill + {w.decode.count} decode workers "
              f"({cfg.model.name}, transport {cfg.transfer.transport}, policy "
              f"{cfg.router.policy})", file=sys.stderr, flush=True)
        backend = PDCluster(cfg.to_pd_config())
        settings = ingress_settings(cfg, backend)
        core = IngressCore(backend, settings)
        app = build_app(backend, settings, core=core)
        grpc = _start_grpc(cfg, backend, cfg.server.host, core)
        if grpc is not None:
            print(f"raypd: gRPC ingress on {grpc.address}", file=sys.stderr, flush=True)
        print(f"raypd: serving {cfg.served_model_name!r} on "
              f"http://{cfg.server.host}:{cfg.server.port}", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn_config(app, cfg.server.host, cfg.server.port,
                                               settings.limits, log_level))
        running = serve_on(server, backend)
        wait_served(running, None)
    except KeyboardInterrupt:
        if server is not None:
            server.should_exit = True
            wait_served(running, 10)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("raypd: shutting down", file=sys.stderr, flush=True)
        if gone.is_set():      # nothing to release: the cluster took the workers with it
            print("raypd: the Ray cluster is gone (ray down / ray stop); exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)
        if grpc is not None:
            grpc.stop()
        if app is not None:
            app.state.ingress.close()
        if backend is not None:
            backend.shutdown()
        if started_ray:
            ray.shutdown()
    return 0



def serve_on(server: uvicorn.Server, backend: Any) -> Any:
    """Start `server` on the backend's router loop (router/event_loop.py: the ingress and
    the request flow share one loop, no thread between them): the run's Future. A backend
    without a loop (a stand-in) gets a thread running the server's own loop."""
    loop = getattr(backend, "loop", None)
    if isinstance(loop, RouterLoop):
        return asyncio.run_coroutine_threadsafe(server.serve(), loop.loop)
    thread = threading.Thread(target=server.run, name="raypd-http", daemon=True)
    thread.start()
    return thread


def served_out(running: Any) -> bool:
    """Whether the server's run ended."""
    return not running.is_alive() if isinstance(running, threading.Thread) else running.done()


def wait_served(running: Any, timeout: float | None) -> None:
    """Wait (at most `timeout`) for the server's run to end."""
    if isinstance(running, threading.Thread):
        running.join(timeout)
        return
    try:
        running.result(timeout)
    except concurrent.futures.TimeoutError:
        pass


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


CLUSTER_CHECK_S = 2.0
CLUSTER_MISSES = 3


def watch_cluster(gcs_address: str) -> threading.Event:
    """A joined cluster's GCS stops answering (`ray down` stops Ray under the router): SIGTERM
    ourselves so the router does not outlive its cluster. Returns the event set when it did."""
    import socket
    host, _, port = gcs_address.rpartition(":")
    gone = threading.Event()

    def watch() -> None:
        misses = 0
        while misses < CLUSTER_MISSES:
            time.sleep(CLUSTER_CHECK_S)
            try:
                socket.create_connection((host, int(port)), timeout=CLUSTER_CHECK_S).close()
                misses = 0
            except OSError:
                misses += 1
        gone.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="raypd-cluster-watch").start()
    return gone


