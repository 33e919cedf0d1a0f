"""Benchmark only: times BLS hops of a [B,3,224,224] GPU tensor to hop_sink (as its input X_<DTYPE>).

CONFIG = [batch, dtype (0: fp32, 1: fp16), mode (0: DLPack, 1: as_numpy), iterations]; MS = one time per hop.
A hop is the whole synchronous BLS call: sender -> server -> receiving stub -> tensor usable on the GPU there.
"""

import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

DTYPES = {0: (torch.float32, "fp32"), 1: (torch.float16, "fp16")}
DLPACK, NUMPY = 0, 1


class TritonPythonModel:
    def initialize(self, args):
        self.device = torch.device("cuda", int(args["model_instance_device_id"]))
        torch.cuda.set_device(self.device)
        self.gpu = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, self.device.index)

    def hop(self, x, name, mode):
        start = time.perf_counter()
        if mode == DLPACK:
            tensor = pb_utils.Tensor.from_dlpack(name, x)  # zero-copy view; syncs torch's stream
        else:
            tensor = pb_utils.Tensor(name, x.cpu().numpy())  # the copy path: GPU -> host here, host -> GPU there
        mode_tensor = pb_utils.Tensor("MODE", np.array([mode], dtype=np.int64))
        request = pb_utils.InferenceRequest(
            model_name="hop_sink", inputs=[tensor, mode_tensor], requested_output_names=["ON_GPU"]
        )
        response = request.exec()
        elapsed = (time.perf_counter() - start) * 1e3
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        on_gpu = pb_utils.get_output_tensor_by_name(response, "ON_GPU").as_numpy()
        return elapsed, on_gpu

    def execute(self, requests):
        responses = []
        for request in requests:
            batch, dtype, mode, iterations = (
                int(v) for v in pb_utils.get_input_tensor_by_name(request, "CONFIG").as_numpy()
            )
            torch_dtype, name = DTYPES[dtype]
            x = torch.randn(batch, 3, 224, 224, device=self.device).to(torch_dtype)
            times = []
            for _ in range(iterations):
                elapsed, on_gpu = self.hop(x, f"X_{name.upper()}", mode)
                times.append(elapsed)
            # the DLPack path must deliver on the GPU without a host copy; the numpy path arrives on the host
            expected = [1, 1] if mode == DLPACK else [0, 1]
            if on_gpu.tolist() != expected:
                raise pb_utils.TritonModelException(f"hop arrived as {on_gpu.tolist()}, expected {expected}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("MS", np.array(times, dtype=np.float64))]))
        return responses
