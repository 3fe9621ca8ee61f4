"""The ingress: everything between a client and the router's `run_request` (HTTP OpenAI-compatible
and gRPC servers, request validation, limits, API keys, the error map, the bad-input catalogue).

Layering: cluster/ > ingress/ > router/ > ... ; torch-free like router/.
"""
