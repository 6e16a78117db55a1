"""Triton Python-backend model: one partition (an ONNX file) run with ONNX Runtime.

Copied into each rendered repository as <partition>/1/model.py beside model.onnx; the thread
count comes from the config's `intra_op_threads` parameter (a node class's device type).
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        threads = int(params.get("intra_op_threads", {}).get("string_value", "1"))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        # as profiled (poolpipe.offline.engines.OrtEngine): idle threads must not spin
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                feeds = {
                    name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in self.inputs
                }
                outs = self.session.run(self.outputs, feeds)
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor(n, np.ascontiguousarray(v))
                            for n, v in zip(self.outputs, outs)
                        ]
                    )
                )
            except Exception as exc:  # answer this request with the error, keep serving
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
