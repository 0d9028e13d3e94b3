"""The gRPC front-end (inference.GRPCInferenceService and grpc.health.v1) on grpc.aio."""
