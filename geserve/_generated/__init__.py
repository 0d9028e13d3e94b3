"""Protobuf and gRPC modules generated from protos/."""
