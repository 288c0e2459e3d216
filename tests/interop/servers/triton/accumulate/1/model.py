"""A stateful sequence model: OUTPUT0 is the running sum of INPUT0 over the requests of one sequence. Triton's
sequence batcher gives each request the sequence's correlation id (CORRID) and whether it starts the sequence (START);
the sums live in this process, so a sequence's requests must all reach this server."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def scalar(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])

            corrid = scalar("CORRID")
            total = scalar("INPUT0") + (0 if scalar("START") else self.sums.get(corrid, 0))
            self.sums[corrid] = total
            output = pb_utils.Tensor("OUTPUT0", np.array([total], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
