"""The router's control model: one JSON command in, one JSON result out, over gRPC."""

from __future__ import annotations

import json

CONTROL_MODEL = "poolpipe_control"


def send_control(router_grpc: str, command: dict, timeout_s: float = 600.0) -> dict:
    """Send one command to a router's control model over gRPC (another process)."""
    import numpy as np
    import tritonclient.grpc as tg

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
