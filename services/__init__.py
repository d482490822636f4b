"""gRPC services (imported as ``baton.services``)."""
