"""Generated gRPC stubs for the baton.v1 API (scripts/gen_protos.py); do not edit."""
