"""ZML's gRPC API (``zml.v1``, proto/zml/v1/zml.proto): the generated messages and stubs
(``zml_pb2``, ``zml_pb2_grpc``: regenerate with ``python proto/generate.py``) and the codec
between them and ZML's JSON bodies (:mod:`zmlcore.rpc.codec`) and the ZML code <-> gRPC status
mapping (:mod:`zmlcore.rpc.status`), shared by the gateway's gRPC
front (zml_gateway.grpc_front) and the SDK's ``grpc://`` transport. docs/grpc.md describes it.
"""
