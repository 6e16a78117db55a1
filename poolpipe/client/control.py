"""The router's control model: one JSON command in, one JSON result out, over gRPC; and the
shared secret (a token file) that control requests and the nodes' model repository API
require.

A router, its nodes and the processes that control it share one token (`--token-file`,
or $POOLPIPE_TOKEN_FILE). Control commands carry it; the router refuses those that do
not. Nodes restrict Triton's model-repository, model-config, shared-memory, statistics,
trace and logging APIs to requests with a header derived from it (`node_key`: Triton takes the
header's value on its command line, where local users of the node's host can read it, so
it is not the token itself)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from poolpipe.errors import PoolpipeError

CONTROL_MODEL = "poolpipe_control"
TOKEN_FILE_VAR = "POOLPIPE_TOKEN_FILE"
NODE_KEY_HEADER = "poolpipe-key"  # HTTP header; gRPC: triton-grpc-protocol-poolpipe-key
RESTRICTED = "model-repository,model-config,shared-memory,statistics,trace,logging"


class TokenError(PoolpipeError):
    pass


def read_token(path: str | Path) -> str:
    """The token in `path`: a file only its owner may read, holding one line."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise TokenError(f"token file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"token file {path} may be read by other users (mode {stat.filemode(mode)}); "
            f"run: chmod 600 {path}"
        )
    if len(text) < 16 or any(c.isspace() for c in text):
        raise TokenError(
            f"token file {path} must hold one token of at least 16 characters, no spaces "
            "(make one: python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)"
        )
    return text


def new_token_file(path: Path) -> str:
    """Write a fresh token to `path` (mode 0600) and return it."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def token_from(path: str | Path | None) -> str | None:
    """The token of `path`, else of $POOLPIPE_TOKEN_FILE, else None."""
    where = path or os.environ.get(TOKEN_FILE_VAR) or None
    return read_token(where) if where else None


def node_key(token: str) -> str:
    """The header value the nodes' restricted APIs expect, derived from the token."""
    return hmac.new(token.encode(), b"poolpipe node api", hashlib.sha256).hexdigest()[:40]


def chain_signature(key: str, chain: str) -> str:
    """What a node checks before it forwards a feature map along `chain` (the JSON of the
    hops after it): HMAC-SHA256 with the nodes' key (as python_onnx_model.py computes)."""
    return hmac.new(key.encode(), chain.encode(), hashlib.sha256).hexdigest()


def node_headers(key: str | None, grpc: bool = True) -> dict[str, str] | None:
    if key is None:
        return None
    return {("triton-grpc-protocol-" if grpc else "") + NODE_KEY_HEADER: key}


def node_restrictions(key: str | None) -> list[str]:
    """tritonserver options that restrict a node's management APIs to `key`."""
    if key is None:
        return []
    spec = f"{RESTRICTED}:{NODE_KEY_HEADER}={key}"
    return [f"--grpc-restricted-protocol={spec}", f"--http-restricted-api={spec}"]


def authorised(command: dict, token: str | None) -> bool:
    """Whether a control command carries the router's token (always, without one)."""
    if token is None:
        return True
    given = command.get("token")
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


def send_control(
    router_grpc: str, command: dict, timeout_s: float = 600.0, token: str | None = None
) -> dict:
    """Send one command to a router's control model over gRPC (another process), with
    the token when given."""
    import numpy as np
    import tritonclient.grpc as tg

    if token is not None:
        command = {**command, "token": token}
    client = tg.InferenceServerClient(router_grpc)
    try:
        x = np.array([json.dumps(command).encode()], dtype=object)
        i = tg.InferInput("command", [1], "BYTES")
        i.set_data_from_numpy(x)
        r = client.infer(CONTROL_MODEL, [i], client_timeout=timeout_s)
        raw = r.as_numpy("result").reshape(-1)[0]
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    finally:
        client.close()
