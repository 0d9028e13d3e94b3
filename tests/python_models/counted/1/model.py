"""Counts requests and the sum of IN in custom metrics, logs through pb_utils.Logger."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # The families are kept: as in Triton, a family that goes away takes its metrics with it.
        self.families = [
            pb_utils.MetricFamily(
                name="counted_requests_total", description="Requests the model saw", kind=pb_utils.MetricFamily.COUNTER
            ),
            pb_utils.MetricFamily(
                name="counted_last_value", description="The last IN", kind=pb_utils.MetricFamily.GAUGE
            ),
            pb_utils.MetricFamily(name="counted_value", description="IN values", kind=pb_utils.MetricFamily.HISTOGRAM),
        ]
        self.requests = self.families[0].Metric(labels={"model": args["model_name"], "kind": "all"})
        self.last = self.families[1].Metric(labels={"model": args["model_name"]})
        self.sizes = self.families[2].Metric(labels={"model": args["model_name"]}, buckets=[1.0, 10.0])
        pb_utils.Logger.log_info("counted is initialized")

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.requests.increment(1)
            self.last.set(float(data[0]))
            self.sizes.observe(float(data[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data)]))
        return responses
