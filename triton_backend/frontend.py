"""The router's front door: a PyTriton model per served model (KServe v2 HTTP/gRPC), and
the `poolpipe_control` model through which other processes roll out plans and read figures.
Clients reach the runtime only through here."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from poolpipe.client.control import CONTROL_MODEL
from poolpipe.runtime import BadRequest
from triton_backend.env import fix_this_process, free_ports
from triton_backend.nodes import descendants, reap
from triton_backend.repository import kserve_dtype
from triton_backend.router import BAD_REQUEST_MARKER, DROP_MARKER, ModelIO, RouterCore


class Frontend:
    """PyTriton serving the router's models on loopback ports; `warmed` counts the warm-up
    requests answered (one per router instance)."""

    def __init__(
        self,
        core: RouterCore,
        ios: Sequence[ModelIO],
        instances: int,
        control: Callable[[dict], dict] | None = None,
        log_file: Path | None = None,
    ):
        self.log_file = log_file  # the router's Triton log (default: the console)
        self.core = core
        self.ios = list(ios)
        self.instances = instances
        self.control = control
        self.http_port = 0
        self.grpc_port = 0
        self.warmed = 0
        self.triton: Any = None

    def start(self, attempts: int = 5) -> Frontend:
        # PyTriton 0.7 has a start-up race between a model's instances (instance k may
        # connect to instance 0's handshake socket between its bind and its listen, and the
        # load fails with "Connection refused"); a fresh start is the cure.
        for attempt in range(1, attempts + 1):
            try:
                self._start_pytriton()
                break
            except Exception as exc:
                if attempt == attempts or "handshake" not in str(exc):
                    raise
                logging.getLogger(__name__).warning(
                    "router start-up hit PyTriton's handshake race; starting again"
                )
        self._warm_up()
        return self

    def stop(self) -> None:
        if self.triton is not None:
            stubs = descendants(pid) if (pid := self._server_pid()) else []
            self.triton.stop()
            self.triton = None
            reap(stubs)  # PyTriton's server may exit "with failure" and leave a stub running

    def _server_pid(self) -> int | None:
        """The pid of PyTriton's tritonserver (private to PyTriton 0.7; None if it moved)."""
        try:
            return int(self.triton._triton_server._tritonserver_running_cmd.pid)
        except (AttributeError, TypeError, ValueError):
            return None

    def _start_pytriton(self) -> None:
        fix_this_process()
        logging.getLogger("pytriton.proxy.inference").addFilter(_no_drop_tracebacks)
        _patch_pytriton_proxy()
        from pytriton.model_config import ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        self.http_port, self.grpc_port, metrics = free_ports(3)
        triton = Triton(
            config=TritonConfig(
                http_address="127.0.0.1",
                http_port=self.http_port,
                grpc_address="127.0.0.1",
                grpc_port=self.grpc_port,
                metrics_port=metrics,
                exit_timeout_secs=2,
                log_file=self.log_file,
            ),
        )  # PyTriton's own short workspace path: its Unix sockets must fit in 108 bytes
        try:
            for io in self.ios:
                triton.bind(
                    model_name=io.name,
                    infer_func=[router_callable(self.core, io)] * self.instances,
                    inputs=[
                        Tensor(name=t.name, dtype=t.dtype, shape=(-1, *t.dims)) for t in io.inputs
                    ],
                    outputs=[
                        Tensor(name=t.name, dtype=t.dtype, shape=(-1, *t.dims)) for t in io.outputs
                    ],
                    config=ModelConfig(batching=False),
                    strict=True,
                )
            if self.control is not None:
                triton.bind(
                    model_name=CONTROL_MODEL,
                    infer_func=control_callable(self.control),
                    inputs=[Tensor(name="command", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="result", dtype=bytes, shape=(1,))],
                    config=ModelConfig(batching=False),
                )
            triton.run()
        except BaseException:
            triton.stop()
            raise
        self.triton = triton

    def _warm_up(self) -> None:
        """One request per router instance, all at once, so that each instance has served
        before any client does: a PyTriton instance's first call costs about 40 ms more
        (measured: with 32 instances, 21 of the first 300 requests over 30 ms, then none).
        Then the router's statistics start from zero."""
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio

        async def warm() -> int:
            client = grpcaio.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
            try:
                calls = []
                for io in self.ios:
                    slo_us = self.core.topo.models[self.core.topo.model_index(io.name)].slo_us
                    inputs = []
                    for t in io.inputs:
                        i = grpcclient.InferInput(t.name, [1, *t.dims], kserve_dtype(t.dtype))
                        i.set_data_from_numpy(np.zeros((1, *t.dims), t.dtype))
                        inputs.append(i)
                    params = {"slo_ms": 10 * slo_us / 1e3}  # no drop for lack of time
                    calls += [
                        client.infer(io.name, inputs, parameters=params)
                        for _ in range(self.instances)
                    ]
                answers = await asyncio.gather(*calls, return_exceptions=True)
                return sum(not isinstance(a, BaseException) for a in answers)
            finally:
                await client.close()

        with ThreadPoolExecutor(1) as pool:  # asyncio.run needs a thread without a loop
            self.warmed = pool.submit(asyncio.run, warm()).result()
        self.core.reset_stats()


class Refused(Exception):
    """The router refused the request at the door (answered as INVALID_ARG: HTTP 400)."""


def router_callable(core: RouterCore, io: ModelIO):
    """The PyTriton inference callable of one served model (one client request per call)."""

    async def infer(requests):
        responses = []
        for req in requests:
            slo_ms = req.parameters.get("slo_ms") if req.parameters else None
            try:
                futures = core.submit(io.name, {t.name: req[t.name] for t in io.inputs}, slo_ms)
            except BadRequest as exc:
                raise Refused(f"{BAD_REQUEST_MARKER}: {exc}") from None
            rows = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            responses.append(
                {t.name: np.concatenate([r[t.name] for r in rows]) for t in io.outputs}
            )
        return responses

    return infer


def control_callable(handle: Callable[[dict], dict]):
    """PyTriton callable of the control model: one JSON command in, one JSON result out."""

    def infer(requests):
        out = []
        for req in requests:
            raw = req["command"].reshape(-1)[0]
            try:
                result = handle(json.loads(raw.decode() if isinstance(raw, bytes) else raw))
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            out.append({"result": np.array([json.dumps(result).encode()], dtype=object)})
        return out

    return infer


_HANDSHAKE_PATCHES = (
    (b"timeout_s: float = 1.0", b"timeout_s: float = 60.0"),
    (
        b"""        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.0, should_stop_before_s - time.time()))
        sock.connect(socket_path.as_posix())
""",
        b"""        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.0, should_stop_before_s - time.time()))
            try:
                sock.connect(socket_path.as_posix())
                break
            except ConnectionRefusedError:
                sock.close()
                if time.time() >= should_stop_before_s:
                    raise
                time.sleep(0.01)
""",
    ),
)


# The proxy model PyTriton runs inside Triton answers every error of a callable as INTERNAL
# with its whole traceback; the router's own answers get their code and one line.
_ERROR_PATCHES = (
    (  # one response per request (the router's models are not decoupled)
        b"                    triton_responses_or_error = pb_utils.TritonModelException("
        b"  # pytype: disable=module-attr\n"
        b'                        responses_payload.decode("utf-8")\n'
        b"                    )",
        b"""                    triton_responses_or_error = _poolpipe_errors(
                        pb_utils, responses_payload.decode("utf-8"), len(triton_requests)
                    )""",
    ),
    (  # decoupled models
        b"""error=pb_utils.TritonError(responses_payload.decode("utf-8"))""",
        b"""error=_poolpipe_error(pb_utils, responses_payload.decode("utf-8"))""",
    ),
)
_ERROR_FUNCTION = b'''

_POOLPIPE_CODES = {
    "POOLPIPE_BAD_REQUEST": "INVALID_ARG",
    "POOLPIPE_DROPPED": "UNAVAILABLE",
    "POOLPIPE_STAGE_FAILED": "INTERNAL",
}


def _poolpipe_error(pb_utils, text):
    """poolpipe's explicit answers: the exception's line with its own code (a request the
    router refused is the client's error; a drop is overload), not a traceback."""
    for marker, code in _POOLPIPE_CODES.items():
        at = text.rfind(marker)
        if at >= 0:
            line = text[at:].splitlines()[0]
            return pb_utils.TritonError(line, getattr(pb_utils.TritonError, code))
    return pb_utils.TritonError(text)


def _poolpipe_errors(pb_utils, text, n):
    """Error responses for poolpipe's answers; PyTriton's exception for anything else."""
    if not any(marker in text for marker in _POOLPIPE_CODES):
        return pb_utils.TritonModelException(text)
    return [pb_utils.InferenceResponse(error=_poolpipe_error(pb_utils, text)) for _ in range(n)]
'''


def _patch_proxy_files(files: dict) -> dict:
    for key, content in files.items():
        if key.endswith("communication.py") and all(
            old in content for old, _ in _HANDSHAKE_PATCHES
        ):
            for old, new in _HANDSHAKE_PATCHES:
                content = content.replace(old, new)
        elif key.endswith("model.py") and all(old in content for old, _ in _ERROR_PATCHES):
            for old, new in _ERROR_PATCHES:
                content = content.replace(old, new)
            content += _ERROR_FUNCTION
        files[key] = content
    return files


def _patch_pytriton_proxy() -> None:
    """PyTriton 0.7 gives a model's instances 1 s and a single connection attempt to fetch
    their configuration from instance 0, which starts alongside them: with many instances on
    few cores, instance 0 has created its socket but is not listening yet, and the model
    fails to load ("Connection refused"). The proxy files PyTriton sends to Triton get a
    60 s timeout with retries, and the error answers above. A no-op where the code differs."""
    from pytriton.models import model as ptmodel

    original = ptmodel.Model.get_proxy_model_files
    if getattr(original, "_poolpipe", False):
        return

    def patched(self):
        return _patch_proxy_files(original(self))

    patched._poolpipe = True  # type: ignore[attr-defined]
    ptmodel.Model.get_proxy_model_files = patched


def _no_drop_tracebacks(record: logging.LogRecord) -> bool:
    """PyTriton logs every exception of a callable with its traceback; an explicit drop is
    an answer the client gets, not an error of the router."""
    text = record.getMessage()
    return DROP_MARKER not in text and BAD_REQUEST_MARKER not in text
