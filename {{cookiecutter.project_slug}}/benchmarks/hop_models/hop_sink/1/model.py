"""Benchmark only: the receiving stage of one hop, for both precisions (input X_FP32 or X_FP16).

ON_GPU = [arrived on the GPU, tensor now on the GPU].
"""

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack

DLPACK, NUMPY = 0, 1


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = next(tensor for tensor in request.inputs() if tensor.name() != "MODE")  # X_FP32 or X_FP16
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            if mode == DLPACK:
                t = from_dlpack(x.to_dlpack())
            else:
                t = torch.from_numpy(x.as_numpy()).cuda()
            on_gpu = np.array([not x.is_cpu(), t.is_cuda], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ON_GPU", on_gpu)]))
        return responses
