"""A decoupled model, for streams: a request with INPUT0 = N is answered with N responses, OUTPUT0 = 0, 1, ..., N-1,
then the final flag on its own. Triton refuses it on unary inference; it is reached with ModelStreamInfer."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().reshape(-1)[0])
            for step in range(count):
                output = pb_utils.Tensor("OUTPUT0", np.array([step], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
