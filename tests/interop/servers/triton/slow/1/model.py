"""A slow model: sleeps INPUT0 milliseconds, then answers OUTPUT0 = INPUT0. With one instance, requests arriving
meanwhile wait in Triton's queue (`nv_inference_pending_request_count`)."""

import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            delay = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            time.sleep(int(delay[0]) / 1000)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", delay)]))
        return responses
